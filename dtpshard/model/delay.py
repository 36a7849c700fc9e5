"""The delay schedule of docs/design.md §1: own-partial scale s_m and which broadcasts land when.

Update at module m, for integer δ:  x_l ← x_l + s_m·p_l^m + Σ_{j≠l} p_j^{m-δ}.
Fractional δ = d + a: module m's broadcast lands with weight (1-a) after module m+d and a after
m+d+1, and s_m is interpolated the same way, so the forward is continuous in δ.
Shared by the single-process simulator (model.py) and the multi-process runtime.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dtpshard.core.vocab import STAGE3


def _own_scale_int(m: int, modules: int, devices: int, delay: int, stage3: str) -> float:
    if m < delay:  # stage 1: nothing has arrived yet
        return math.sqrt(devices)
    if m >= modules - delay:  # stage 3: these broadcasts never land
        return math.sqrt(devices) if stage3 == "sqrt" else 1.0
    return 1.0


@dataclass(frozen=True)
class Step:
    own_scale: float  # s_m
    arrivals: tuple[tuple[int, float], ...]  # (source module k, weight): others' p^k added at module m


def schedule(modules: int, devices: int, delay: float, stage3: str = "sqrt") -> list[Step]:
    if stage3 not in STAGE3:
        raise ValueError(f"stage3={stage3!r}, expected one of {STAGE3}")
    d = math.floor(delay)
    a = delay - d
    steps = []
    for m in range(modules):
        s = _own_scale_int(m, modules, devices, d, stage3)
        arrivals = [(m - d, 1.0 - a)]
        if a > 0:
            s = (1 - a) * s + a * _own_scale_int(m, modules, devices, d + 1, stage3)
            arrivals.append((m - d - 1, a))
        steps.append(Step(s, tuple((k, w) for k, w in arrivals if k >= 0 and w > 0)))
    return steps


def horizon(delay: float) -> int:
    """How many past modules' partials must be kept: the oldest arrival is m - ceil(δ)."""
    return math.ceil(delay)
