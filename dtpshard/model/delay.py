"""The delay schedule of docs/design.md §1: own-partial scale s_m and which broadcasts land when.

Update at module m, for integer δ:  x_l ← x_l + s_m·p_l^m + Σ_{j≠l} p_j^{m-δ}.
Fractional δ = d + a: module m's broadcast lands with weight (1-a) after module m+d and a after
m+d+1, and s_m is interpolated the same way, so the forward is continuous in δ. Per-module delay:
only the modules of a set are delayed; the others' sums land at once, where they are made.

The schedule is data, and everything that follows from it is derived here once: when each
module's sum is last needed (`last_use`), which modules run before it has landed (`edges`, what
calibration scores), whether it is plain tensor parallelism. model/exchange.py carries it out.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from dtpshard.core.delayed import is_delayed
from dtpshard.core.settings import DTPSettings


def _first_landing(modules: int, delay: int, delayed: tuple[int, ...] | None) -> int:
    """The first module after which some sum lands, at a whole δ: δ itself unless a plain module
    (its sum lands where it is made) comes first."""
    if delayed is None:
        return delay
    chosen = set(delayed)
    plain = next((k for k in range(modules) if k not in chosen), modules)
    return min(plain, delayed[0] + delay)


def _own_scale_int(m: int, modules: int, devices: int, delay: int, stage3: str, first: int,
                   delayed: tuple[int, ...] | None = None) -> float:
    """s_m at a whole δ: √L before the first landing (stage 1), the stage-3 scale for a delayed
    module whose sum never lands, 1 otherwise (a plain module, and the steady state)."""
    if m < first:  # stage 1: nothing has arrived yet
        return math.sqrt(devices)
    if is_delayed(m, delayed) and m >= modules - delay:  # stage 3: this broadcast never lands
        return math.sqrt(devices) if stage3 == "sqrt" else 1.0
    return 1.0


@dataclass(frozen=True)
class Step:
    own_scale: float  # s_m
    arrivals: tuple[tuple[int, float], ...]  # (source module k, weight): others' p^k added at module m


@dataclass(frozen=True)
class Schedule:
    """Per module m its Step; indexable and iterable as the sequence of steps. What follows from
    the steps is computed once, when it is made, as plain attributes (a compiler tracing a forward
    reads them as constants):

    - `last_use`: module k -> the last module its sum lands at (absent: it never lands, stage 3, so
      it is never sent);
    - `tensor_parallel`: δ = 0, every module's sum lands at once where it is made (the devices'
      streams stay equal)."""

    steps: tuple[Step, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "last_use", {k: m for m, step in enumerate(self.steps) for k, _ in step.arrivals})
        object.__setattr__(self, "tensor_parallel", all(step.arrivals == ((m, 1.0),) and step.own_scale == 1
                                                        for m, step in enumerate(self.steps)))

    last_use: dict[int, int] = field(init=False, compare=False, repr=False)
    tensor_parallel: bool = field(init=False, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, m: int) -> Step:
        return self.steps[m]

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def edges(self) -> list[tuple[int, int]]:
        """(a, b): module b computes before module a's sum has first landed (never, in stage 3), on
        streams that lack the other devices' p^a; the edges calibration scores (docs/design.md §2)."""
        first: dict[int, int] = {}
        for m, step in enumerate(self.steps):
            for k, _ in step.arrivals:
                first.setdefault(k, m)
        M = len(self)
        return [(a, b) for b in range(M) for a in range(b) if b <= first.get(a, M)]


def schedule(modules: int, devices: int, delay: float, stage3: str,
             delayed: tuple[int, ...] | None = None) -> Schedule:
    """Per module m: s_m and the arrivals, for the settings of a core.settings.DTPSettings (checked
    by core.settings.resolve_dtp); `schedule_for(M, settings)` takes the settings whole. `delayed`:
    the modules whose sums land δ modules later (None: all); every other module's sum lands at
    once, at the module itself, after the delayed arrivals (docs/design.md §1, per-module delay)."""
    d = math.floor(delay)
    a = delay - d
    first = {k: _first_landing(modules, k, delayed) for k in (d, d + 1)}
    steps = []
    for m in range(modules):
        s = _own_scale_int(m, modules, devices, d, stage3, first[d], delayed)
        if a > 0:
            s = (1 - a) * s + a * _own_scale_int(m, modules, devices, d + 1, stage3, first[d + 1], delayed)
        arrivals = [(k, w) for k, w in ((m - d, 1.0 - a), (m - d - 1, a))
                    if k >= 0 and w > 0 and is_delayed(k, delayed)]
        if not is_delayed(m, delayed):
            arrivals.append((m, 1.0))
        steps.append(Step(s, tuple(arrivals)))
    return Schedule(tuple(steps))


def schedule_for(modules: int, settings: DTPSettings) -> Schedule:
    return schedule(modules, settings.devices, settings.delay, settings.stage3, settings.delayed)
