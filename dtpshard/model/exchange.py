"""The exchange: the delay schedule carried out, once, for every engine.

After module m each device l adds its own partial at once, s_m·p_l^m, and starts the sum of
module m's partials over the devices; where the schedule lands module k's sum it adds the other
devices' share, w·(Σ_j p_j^k − p_l^k), and the own partial and the sum are dropped at their last
use. The float order is the same in every engine (ops.residual_update): x + s·p, then + w·Σ,
then − w·p_l. A schedule that lands every sum where it is made (δ = 0, tensor parallelism) adds
x + Σ_j p_j^m, which keeps the devices' streams equal.

What moves the partials is a `Reduce`, which supplies two things: `start(p)`, begin Σ_j p_j, and
`value(handle)`, that sum, waiting for it if it is still on its way:

- `DeviceAxis` (here): the simulator holds every device's partials on the leading axis of
  [L, B, T, D]: nothing travels, and the sum is taken over that axis where it lands;
- runtime/ranks.py `Link`: an asynchronous torch.distributed all-reduce per module (the runtime);
- serve/reduce.py `FunctionalReduce`: a functional collective, for vLLM eager and compiled.

A backend never decides when: the exchange starts a reduce right after its module and asks for
its value only where the schedule lands it, so whatever runs in between overlaps the transfer.
A plain module's sum (per-module delay: it lands where it is made) is taken at once, through the
Reduce's `total` where the engine sets one (vLLM's: transport/choose.py `blocking_sum`), else by
start and value.
`settle()` asks for every pending value at once; waiting earlier than the landing changes
nothing that is computed, and it lets a forward that a compiler splits into separately captured
pieces keep no transfer open across a split (serve/vllm_model.py).
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from dtpshard.model.delay import Schedule
from dtpshard.model.ops import residual_update


class Reduce(Protocol):
    def start(self, p: torch.Tensor) -> Any:
        """Begin Σ over the devices of the partials p; returns a handle for `value`."""

    def value(self, handle: Any) -> torch.Tensor | None:
        """The sum the handle stands for (None: the devices are p's leading axis, summed where it lands)."""


class DeviceAxis:
    """The simulator's Reduce: every device's partials are at hand, on the leading axis."""

    def start(self, p: torch.Tensor) -> None:
        return None

    def value(self, handle: None) -> None:
        return None


class Exchange:
    """One forward's transfers under `schedule` among `devices` devices, moved by `reduce`.
    Made per forward: the pending sums are this forward's, never a module's state."""

    def __init__(self, schedule: Schedule, reduce: Any, devices: int):
        self.schedule, self.reduce, self.devices = schedule, reduce, devices
        self.pending: dict[int, list[Any]] = {}  # module k -> [p_l^k, handle, Σ once taken]

    def _sum(self, k: int) -> torch.Tensor | None:
        entry = self.pending[k]
        if len(entry) == 2:  # a fractional δ lands the same sum twice: taken once
            entry.append(self.reduce.value(entry[1]))
        return entry[2]

    def settle(self) -> None:
        """Take every pending sum now (see the module docstring)."""
        for k in self.pending:
            self._sum(k)

    def update(self, m: int, x: torch.Tensor, p: torch.Tensor, local: torch.Tensor | None = None) -> torch.Tensor:
        """x_l ← x_l + s_m·p_l^m + Σ_(k, w) w·(Σ_j p_j^k − p_l^k) + local_l: the streams after module m.
        `local`: what device l adds at once, unscaled, and never sends (a shared FFN's shared
        neurons, docs/design.md §6), added last in every engine."""
        x = self._update(m, x, p)
        return x if local is None else x + local

    def _update(self, m: int, x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        step = self.schedule[m]
        if self.devices == 1:  # no other device: nothing is sent and nothing arrives
            return residual_update(x, p, step.own_scale, [])
        if self.schedule.tensor_parallel:
            total = self.reduce.value(self.reduce.start(p))
            return x + (p.sum(0, keepdim=True) if total is None else total)
        if self.schedule.last_use.get(m) == m and getattr(self.reduce, "total", None) is not None:
            self.pending[m] = [p, None, self.reduce.total(p)]  # a plain module: the blocking sum, now
        elif m in self.schedule.last_use:  # stage 3's partials never land: not sent
            self.pending[m] = [p, self.reduce.start(p)]
        arrivals = [(self._sum(k), self.pending[k][0], w) for k, w in step.arrivals]
        x = residual_update(x, p, step.own_scale, arrivals)
        for k, _ in step.arrivals:
            if self.schedule.last_use[k] == m:
                del self.pending[k]
        return x

    def mean(self, h: torch.Tensor) -> torch.Tensor:
        """The mean over the devices of h (each device's FinalNorm(x_l)): the LM head's input, the
        devices' axis (if any) gone. Under tensor parallelism the streams are already equal."""
        if self.devices == 1 or self.schedule.tensor_parallel:
            return h[0] if h.dim() > 2 else h
        total = getattr(self.reduce, "total", None)
        s = total(h) if total is not None else self.reduce.value(self.reduce.start(h))
        if s is None:
            return h.mean(0)
        s = s / self.devices
        return s[0] if s.dim() > 2 else s
