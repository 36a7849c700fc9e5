"""Which transport a process group's ranks move their partials over, decided once, on every rank alike.

The shared-memory ring (transport/shared.py) where the ranks share a host and keep their partials
in host memory on x86-64, whatever the engine's own communicator uses (vLLM's CPU build on a host
without AVX-512 all-reduces over gloo: there the ring matters most); otherwise the caller's
collective Reduce (gloo on a CPU across hosts, NCCL on CUDA). `DTPSHARD_EXCHANGE` overrides:
`auto` (the default), `shared` (refused in one line where it cannot run) or `collective`. The
caller says the choice and its reason out loud: a throughput number means something only next to
the transport it was measured on.
"""
from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dtpshard.core.errors import UserError
from dtpshard.transport import native
from dtpshard.transport.shared import SharedReduce, open_ring, ring_slots

VARIABLE = "DTPSHARD_EXCHANGE"
CHOICES = ("auto", "shared", "collective")
SLOT_BYTES = 8 << 20  # the most a slot holds; a larger message (a long prefill) takes the collective


def wanted() -> str:
    v = os.environ.get(VARIABLE, "auto").strip().lower() or "auto"
    if v not in CHOICES:
        raise UserError(f"environment variable {VARIABLE}={v[:40]!r}: give one of {', '.join(CHOICES)}")
    return v


def why_not_shared(device: torch.device | str) -> str:
    """Why the shared ring cannot serve these ranks ("" if it can, as far as one rank can tell)."""
    if wanted() == "collective":
        return f"{VARIABLE}=collective"
    if torch.device(device).type != "cpu":
        return f"the partials are on {torch.device(device).type} (transport/symmetric.py is CUDA's design)"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the ring relies on x86-64's store order; this is {platform.machine()}"
    return ""


def choose(group: dist.ProcessGroup, key: str, schedule: Any, message_bytes: int, timeout: float,
           collective: Callable[[], Any], device: torch.device | str = "cpu", latency: float = 0.0
           ) -> tuple[Any, str]:
    """Collective over `group` -> (the Reduce, what it travels over and why). `message_bytes`: the
    largest message the ring should hold (capped at SLOT_BYTES); `collective()` makes the fallback."""
    native.wanted()  # a mistyped DTPSHARD_NATIVE is refused here, before any segment is made
    why = why_not_shared(device)
    whys = [None] * dist.get_world_size(group)
    dist.all_gather_object(whys, why, group=group)  # one rank's reason is every rank's
    why = next((w for w in whys if w), "")
    ring = None
    if not why:
        ring, why = open_ring(group, key, ring_slots(schedule), min(message_bytes, SLOT_BYTES), timeout, latency)
    if ring is not None:
        kernels = "native kernels" if ring.native else f"Python kernels: {ring.native_why}"
        return SharedReduce(ring, key), (f"shared memory (one-sided ring: {ring.slots} slots × {ring.world} ranks "
                                         f"× {ring.capacity / 2**20:.2g} MiB; larger messages by the collective; "
                                         f"{kernels})")
    if wanted() == "shared":
        raise UserError(f"{VARIABLE}=shared: the shared-memory exchange cannot run here: {why}")
    backend = dist.get_backend(group)
    return collective(), f"{backend} all-reduce ({why})"


def blocking_sum(reduce: Any, engine_sum: Callable[[torch.Tensor], torch.Tensor]
                 ) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
    """The path of the sums that block anyway (a plain module's, the final mean's) -> (the sum, in
    words): the ring, started and taken at once, wherever the partials take it; else the engine's
    own all-reduce. Measured in vLLM at TP 2 (docs/benchmarks.md, "Every host on the ring"): every
    sum blocking, the ring is 1.38-1.40x vLLM's gloo all-reduce and 0.96-1.10x its shared-memory
    one; the full student's final mean on the ring rather than vLLM's shared-memory all-reduce
    took it from 0.96x to 1.13x TP (two runs)."""
    if getattr(reduce, "transport", None) == SharedReduce.transport:
        return reduce.now, "the ring"
    return engine_sum, "the engine's own all-reduce"
