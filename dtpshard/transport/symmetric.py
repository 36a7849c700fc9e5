"""The one-sided exchange on CUDA: the shared ring's protocol (transport/shared.py) over torch's
symmetric memory, with every step stream-ordered so that a CUDA graph can capture it.

Each rank allocates the same ring, [slots, ranks, capacity] elements, with
`torch.distributed._symmetric_memory.empty` and rendezvouses it on the group; then:

- `start(p)`: for each peer, wait (on the stream) for the peer's signal that it has read this
  slot's previous sum (channel `slots + slot`, skipped the first time round), copy p into row
  `rank` of the peer's slot through NVLink (a plain copy into `get_buffer(peer, ...)`), and set the
  peer's signal for the slot (`put_signal`, channel `slot`). The copy and the signal are kernels on
  the current stream: the host never waits, and the next module's kernels queue behind them.
- `value(token)`: wait (on the stream) for every peer's signal on the slot (`wait_signal`), sum
  the slot's rows in rank order from local memory, and signal every peer that the slot is read.

Signals count: a wait consumes the one signal it waits for, so every put has exactly one wait and
every read exactly one acknowledgement, however the sums interleave. Sums are numbered per
forward (`begin()`), so a captured forward replays the same slots in the same order; each forward
ends with every acknowledgement taken (`finish()`), so the next forward starts on a quiet ring.

Status: written against torch's symmetric-memory API (2.13) and run by bench/cuda_check.py's
`symmetric` section, which needs two or more GPUs for the exchange itself (one GPU checks the
allocation, the rendezvous and CUDA-graph capture of the calls on a one-rank group). It has not
run in this project yet: no machine with two GPUs was lent. No engine chooses it yet
(transport/choose.py gives CUDA the functional collectives, NCCL); cuda_check drives it through
model/exchange.py directly.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class SymmetricReduce:
    """A Reduce (model/exchange.py) over a symmetric-memory ring on `group` (CUDA only)."""

    transport = "symmetric memory"

    def __init__(self, group: dist.ProcessGroup, slots: int, capacity: int, dtype: torch.dtype,
                 device: torch.device):
        from torch.distributed import _symmetric_memory as symm_mem

        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.slots, self.capacity, self.dtype = slots, capacity, dtype
        self.ring = symm_mem.empty((slots, self.world, capacity), dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.ring, group)
        self.peers = [r for r in range(self.world) if r != self.rank]
        self.remote = {r: self.handle.get_buffer(r, (slots, self.world, capacity), dtype) for r in self.peers}
        self.issued = 0
        self.unacked: list[int] = []  # slots whose readers' acknowledgements this rank has not taken

    def begin(self) -> None:
        """A new forward: number its sums from 0 (the same slots on every replay of a captured forward)."""
        self.issued = 0

    def start(self, p: torch.Tensor) -> tuple[int, torch.Tensor]:
        if p.numel() > self.capacity or p.dtype != self.dtype:
            raise ValueError(f"symmetric exchange: a partial of {p.numel()} {p.dtype} elements, the ring holds "
                             f"{self.capacity} {self.dtype}")
        slot = self.issued % self.slots
        self.issued += 1
        flat = p.reshape(-1)
        for r in self.peers:
            if slot in self.unacked:  # r has read the slot's previous sum
                self.handle.wait_signal(r, channel=self.slots + slot)
            self.remote[r][slot, self.rank, :flat.numel()].copy_(flat)
            self.handle.put_signal(r, channel=slot)
        if slot in self.unacked:
            self.unacked.remove(slot)
        self.ring[slot, self.rank, :flat.numel()].copy_(flat)
        self.unacked.append(slot)
        return slot, p

    def value(self, handle: tuple[int, torch.Tensor]) -> torch.Tensor:
        slot, p = handle
        for r in self.peers:
            self.handle.wait_signal(r, channel=slot)
        total = self.ring[slot, :, :p.numel()].sum(0).view(p.shape)
        for r in self.peers:
            self.handle.put_signal(r, channel=self.slots + slot)  # r may write this slot again
        return total

    def finish(self) -> None:
        """Take every outstanding acknowledgement: the ring is quiet for the next forward."""
        for slot in self.unacked:
            for r in self.peers:
                self.handle.wait_signal(r, channel=self.slots + slot)
        self.unacked = []
