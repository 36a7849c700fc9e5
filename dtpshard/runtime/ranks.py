"""DTP across processes on torch.distributed: one rank is one device of docs/design.md §1.

The model definition (dtpshard.model) has no distributed code; this file is the runtime. Rank l
reads only its own slices of the checkpoint (its KV groups' q/k/v rows and o_proj columns, its
neurons' gate/up rows and down_proj columns; a layout's permutation is applied while reading),
and runs the simulator's decoder built for that shard with one device (L = 1): the same modules,
the same schedule loop. Its exchange is the `Link`: after module m it posts its partial p_l^m as
an asynchronous all-reduce, and the sum is waited for only where the delay schedule lands it, δ
modules later, so the transfer overlaps δ modules of compute; the others' share is
Σ_j p_j^m - p_l^m. (An all-reduce rather than an all-gather: the same collective as the
baseline, and less traffic for L ≥ 3.) Every rank issues the same collectives in the same order:
the schedule decides them. δ = 0 is ordinary tensor parallelism, the baseline: a blocking
all-reduce after every module. The end is the mean over ranks of FinalNorm(x_l) (one
all-reduce), then the LM head.
"""
from __future__ import annotations

import datetime
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dtpshard.core.errors import UserError
from dtpshard.core.launch import RankFailure, at_shutdown, cause
from dtpshard.core.layout import Layout, as_layout
from dtpshard.core.permutation import permutation_spec, unit_index
from dtpshard.core.settings import DTPSettings, resolve_dtp
from dtpshard.core.shape import check_devices
from dtpshard.model.checkpoint import Checkpoint, open_checkpoint
from dtpshard.model.decoder import Decoder
from dtpshard.model.delay import schedule_for
from dtpshard.model.exchange import Exchange
from dtpshard.transport.choose import choose
from dtpshard.transport.shared import ring_slots


# -- refusing a bad world size before any collective ---------------------------------------
def check_world(model: Path | Checkpoint, world: int,
                layout: Path | Layout | None = None) -> tuple[Checkpoint, Layout | None]:
    """Open the checkpoint (headers only; an open one is taken as it is) and refuse a shape or
    layout that `world` ranks cannot run (δ is core.settings.resolve_dtp's to check). A shared
    layout's count goes into the returned checkpoint's shape (docs/design.md §6)."""
    ckpt = model if isinstance(model, Checkpoint) else open_checkpoint(model)
    lay = as_layout(layout)
    if lay is not None and ckpt.defaults is not None:  # a student's or permuted checkpoint's weights hold theirs
        held = ckpt.defaults.get("layout_sha256")
        if lay.content_sha256() != held:
            raise UserError(f"layout {layout}: the weights of {ckpt.path} are in another layout's order already "
                            f"(sha256 {held or 'none: contiguous'}): leave --layout out, or give the dense model")
        lay = None  # the same layout: never applied twice
    if lay is not None:
        lay.check_model(ckpt.shape, where=f"layout {layout}")
        if lay.devices != world:
            raise UserError(f"layout {layout} was made for devices={lay.devices}, the world size is {world}")
        if ckpt.shape.shared:  # its shared neurons are last already: a permutation would move them
            raise UserError(f"layout {layout}: {ckpt.path} already holds {ckpt.shape.shared} shared neurons a layer, "
                            "last; a layout applies to the dense model it was made from")
        ckpt = replace(ckpt, shape=replace(ckpt.shape, shared=lay.shared))
    try:
        check_devices(ckpt.shape, world)
    except UserError as e:
        raise UserError(f"world size {world} does not fit {ckpt.path}: {e}") from None
    return ckpt, lay


# -- reading only this rank's slices ---------------------------------------------------------
def load_shard(ckpt: Checkpoint, rank: int, world: int, layout: Layout | None,
               dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Rank `rank`'s state dict: its 1/world of every sharded tensor (after the layout's permutation:
    position p holds original unit perm[p], rank l the positions [l·U/L, (l+1)·U/L) of the U sharded
    ones), then the shape's shared neurons (the last positions, every rank's), the rest whole."""
    s = ckpt.shape
    spec = permutation_spec(s)
    out = {}
    for name in ckpt.files.keys():
        if name.endswith("rotary_emb.inv_freq") or (s.tied and name == "lm_head.weight"):
            continue
        if name not in spec:  # embedding, norms, LM head: every rank needs them whole
            out[name] = ckpt.files.get(name).to(dtype)
            continue
        m, axis, rows = spec[name]
        n, shared = s.units(m), s.shared if m % 2 else 0
        perm = np.arange(n) if layout is None else np.asarray(layout.perm(m))
        k = n - shared
        own = np.concatenate([perm[rank * k // world:(rank + 1) * k // world], perm[k:]])
        out[name] = ckpt.files.get_units(name, unit_index(own, rows).numpy(), axis).to(dtype)
    return out


# -- transfers -------------------------------------------------------------------------------
class Link:
    """This rank's Reduce (model/exchange.py): an asynchronous all-reduce per sum, its value waited
    for where the exchange asks (δ modules later; at once under tensor parallelism).

    `latency` (seconds) and `bandwidth` (bytes/s, 0: unlimited) emulate a slower link: a sum of
    n bytes is available latency + n / bandwidth after the local transfer itself completed. The
    emulated wire time is in series with the transfer's own cost (gloo's copies and sums on the
    host), as a real link's is with the collective's software; taking the later of the two instead
    would let a slow loopback transfer hide the added latency from δ = 0. A blocking transfer
    therefore waits all of it; one taken δ modules later waits only for what the compute in
    between has not covered.
    """

    transport = "collective"

    def __init__(self, rank: int, timeout: float, latency: float = 0.0, bandwidth: float = 0.0,
                 device: str | torch.device = "cpu"):
        self.rank, self.latency, self.bandwidth = rank, latency, bandwidth
        self.timeout = datetime.timedelta(seconds=timeout)
        # NCCL: a wait with a timeout polls the work's CUDA event from the host (a blocked CPU, and
        # no CUDA-graph capture); without one it makes the current stream wait on NCCL's, and the
        # process group's own timeout (its watchdog) covers a hang. Gloo's wait is the host's.
        self.stream_ordered = torch.device(device).type == "cuda"
        self.posted: list[Any] = []  # works started and not yet waited for (close waits for them)
        at_shutdown(self.close)  # process_group closes it before it ends the group

    def _completion(self, work: Any) -> list[float]:
        """[t]: set to the time the transfer completes (by the backend's thread), when a link is emulated."""
        done = [0.0]
        if self.latency > 0 or self.bandwidth > 0:
            work.get_future().add_done_callback(lambda _: done.__setitem__(0, time.perf_counter()))
        return done

    def _wait(self, work: Any, done: list[float], what: str, nbytes: int = 0) -> None:
        try:
            work.wait() if self.stream_ordered else work.wait(self.timeout)
        except RuntimeError as e:
            raise RankFailure(f"rank {self.rank}: {what} failed ({cause(e)}); another rank died, hung "
                              "or was stopped") from None
        if self.latency <= 0 and self.bandwidth <= 0:
            return
        wire = nbytes / self.bandwidth if self.bandwidth > 0 else 0.0
        left = (done[0] or time.perf_counter()) + self.latency + wire - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def start(self, p: torch.Tensor) -> list[Any]:
        """Post Σ over ranks of p (p itself is kept: the exchange still needs the own partial)."""
        buf = p.clone()  # summed in place by the backend while this rank computes on
        work = dist.all_reduce(buf, async_op=True)
        self.posted.append(work)
        return [work, buf, self._completion(work)]

    def value(self, handle: list[Any]) -> torch.Tensor:
        work, buf, done = handle
        self._wait(work, done, "a transfer of partials", buf.numel() * buf.element_size())
        if work in self.posted:
            self.posted.remove(work)
        return buf

    def close(self, wait: bool = True) -> bool:
        """Forget every posted transfer, first waiting for each if `wait` (a clean end) -> whether none
        is still in flight: a group with one in flight cannot be destroyed without waiting on it."""
        works, self.posted = self.posted, []
        for work in works if wait else ():
            self._wait(work, [0.0], "a transfer posted before the end")
        return wait or all(work.is_completed() for work in works)


# -- the per-rank model ----------------------------------------------------------------------
class RankModel(Decoder):
    """Device `rank` of a DTP model with `world` devices: the decoder of its shard, exchanging over
    a Link. Calling it is collective: every rank must make the same calls in the same order (same
    input shapes), as with any tensor-parallel model."""

    def __init__(self, ckpt: Checkpoint, rank: int, settings: DTPSettings, layout: Layout | None = None,
                 dtype: torch.dtype = torch.float32, timeout: float = 60, latency: float = 0,
                 device: str | torch.device = "cpu"):
        """`settings` (core.settings.resolve_dtp's): its devices are the world size."""
        world = settings.devices
        if layout is not None and layout.shared != ckpt.shape.shared:  # its count into the shape, as run's
            ckpt, layout = check_world(ckpt, world, layout)
        with torch.device("meta"):
            super().__init__(ckpt.hf_config, ckpt.shape.shard(world))
        self.rank, self.world, self.full_shape = rank, world, ckpt.shape
        shard = load_shard(ckpt, rank, world, layout, dtype)
        self.load_state_dict({k: v.to(device) for k, v in shard.items()}, strict=True, assign=True)
        self.requires_grad_(False)
        self.rebuild_buffers()
        self.sharded = set(permutation_spec(ckpt.shape)) & set(shard)
        self.timeout, self.latency, self.device_kind = timeout, latency, torch.device(device).type
        self.transport: Any = None  # the Reduce chosen for this group (transport/choose.py)
        self.link: Any = None  # what forward exchanges over: the transport (bench/bench_runtime.py swaps it)
        self.use(settings)

    def use(self, settings: DTPSettings) -> None:
        self.settings = settings.check(self.full_shape)
        self.delay, self.stage3 = settings.delay, settings.stage3
        self.steps = schedule_for(self.shape.modules, settings)
        ring = getattr(self.transport, "ring", None)
        if self.transport is None or (ring is not None and ring.slots < ring_slots(self.steps)):
            self._choose_transport()

    def _choose_transport(self) -> None:
        """Collective: the shared-memory ring where the ranks share a host's memory, else the Link
        (transport/choose.py); rank 0 says which on stderr. A schedule with more sums in flight than
        the ring holds (set_delay) chooses again."""
        message = 4096 * self.shape.hidden * self.lm_head_weight.element_size()  # choose caps it at a slot's most
        old = self.transport
        self.transport, said = choose(dist.group.WORLD, "run", self.steps, message, self.timeout,
                                      lambda: Link(self.rank, self.timeout, self.latency, device=self.device_kind),
                                      self.device_kind, self.latency)
        if self.transport.transport != "collective":
            at_shutdown(self.transport.close)
        if self.link is None or self.link is old:
            self.link = self.transport
        if self.rank == 0 and old is None:
            print(f"dtpshard run: the partials travel over {said}", file=sys.stderr, flush=True)

    def set_delay(self, delay: float | None = None, stage3: str | None = None) -> None:
        """Change δ (and the stage-3 rule; one not given stays); the weights and L stay. Collective
        order follows the schedule."""
        self.use(resolve_dtp(self.full_shape, devices=self.world, delay=delay, stage3=stage3,
                             record=self.settings.to_json()))

    def sharded_bytes(self) -> int:
        sd = self.state_dict()
        return sum(sd[n].numel() * sd[n].element_size() for n in self.sharded)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: Any = None, logits_to_keep: int = 0) -> torch.Tensor:
        """input_ids [B, T] (the same on every rank) -> logits [B, T, V] (or the last `logits_to_keep`)."""
        exchange = Exchange(self.steps, self.link, self.world)  # self.link: bench/bench_runtime.py swaps it
        x = self.run_streams(input_ids, 1, exchange, cache)
        if logits_to_keep:
            x = x[:, :, -logits_to_keep:]
        return self.logits(self.head_input(x, exchange))
