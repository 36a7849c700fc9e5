"""The delay schedule of docs/design.md §1: own-partial scale s_m and which broadcasts land when.

Update at module m, for integer δ:  x_l ← x_l + s_m·p_l^m + Σ_{j≠l} p_j^{m-δ}.
Fractional δ = d + a: module m's broadcast lands with weight (1-a) after module m+d and a after
m+d+1, and s_m is interpolated the same way, so the forward is continuous in δ.
The schedule is data; an exchange carries it out. `LocalExchange` is the simulator's, with every
device's partials on this machine (the leading axis of [L, B, T, D]); the runtime's `Link`
(runtime/ranks.py) posts each partial to the other processes and waits where the schedule lands it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dtpshard.core.settings import DTPSettings
from dtpshard.model.ops import residual_update


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


def schedule(modules: int, devices: int, delay: float, stage3: str) -> list[Step]:
    """Per module m: s_m and the arrivals, for the settings of a core.settings.DTPSettings (checked
    by core.settings.resolve_dtp); `schedule_for(M, settings)` takes the settings whole."""
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


def schedule_for(modules: int, settings: DTPSettings) -> list[Step]:
    return schedule(modules, settings.devices, settings.delay, settings.stage3)


def horizon(delay: float) -> int:
    """How many past modules' partials must be kept: the oldest arrival is m - ceil(δ)."""
    return math.ceil(delay)


class LocalExchange:
    """The simulator's transfers: device l's share of what arrives is Σ_j p_j^k - p_l^k, all of it
    at hand, so a module's partials are kept for ⌈δ⌉ modules and then dropped."""

    def __init__(self, delay: float):
        self.keep = horizon(delay)
        self.recent: dict[int, torch.Tensor] = {}  # module -> its partials [L, B, T, D]

    def update(self, m: int, x: torch.Tensor, p: torch.Tensor, step: Step) -> torch.Tensor:
        """x_l ← x_l + s_m·p_l^m + Σ_(k, w) w·Σ_{j≠l} p_j^k, for every device l at once."""
        self.recent[m] = p
        # one device (the dense model, L = 1) has no others: Σ_{j≠l} is empty, not a sum that cancels
        arrivals = [(self.recent[k], w) for k, w in step.arrivals] if x.shape[0] > 1 else []
        x = residual_update(x, p, step.own_scale, arrivals)
        self.recent.pop(m - self.keep, None)
        return x

    def mean(self, h: torch.Tensor) -> torch.Tensor:
        """[L, B, T, D] -> the mean over devices [B, T, D]."""
        return h.mean(0)
