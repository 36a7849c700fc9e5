"""Data-parallel distillation: the process group of a run's processes.

Under torchrun, or the local launcher of `--nproc K` (dtpshard.core.launch, which sets the same
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* environment), each process joins the group here. The
group's timeout bounds every collective, so a rank that dies outside either launcher still
ends the others after --timeout seconds; the local launcher stops a rank that has not joined
(launch.joined) as soon as another fails. Backend: NCCL on CUDA, gloo on CPU.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtpshard.core.devices import pick_device
from dtpshard.core.errors import UserError
from dtpshard.core.launch import _InFlight, end_group, join_group, joined
from dtpshard.core.launch_checks import torchrun_env


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (a copy on the group's device; returned on the CPU)."""
        if self.world == 1:
            return t.cpu()
        x = t.to(self.device, copy=True)
        dist.all_reduce(x)
        return x.cpu()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def setup(cfg: Any) -> Dist:
    env = torchrun_env()
    world, device = env.world or 1, pick_device(cfg.device)
    if world == 1:
        return Dist(device=device)
    rank, local = env.rank, env.local_rank or 0
    if cfg.nproc not in (1, world):
        raise UserError(f"--nproc {cfg.nproc} but this process group has WORLD_SIZE={world}")
    if device.startswith("cuda"):
        if torch.cuda.device_count() <= local:
            raise UserError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} CUDA devices are visible")
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if dist.is_initialized():
        joined()  # from now on a peer's failure reaches this rank through the group
    else:
        join_group(cfg.timeout, backend)  # launch's join: the same line when the ranks do not all join
    return Dist(rank, world, local, device)


def run_distributed(cfg: Any, train: Callable[[Any, Dist], Path]) -> Path:
    """train(cfg, d) in this process's group, which is ended in order afterwards (launch.end_group):
    after a clean run every rank reaches a barrier before any destroys the group; after an error
    the group is destroyed at once (the collectives here block, so none is left in flight)."""
    d = setup(cfg)
    if d.world == 1:
        return train(cfg, d)
    try:
        out = train(cfg, d)
    except BaseException:
        with contextlib.suppress(_InFlight):  # nothing to wait on; the error says what happened
            end_group(False, cfg.timeout)
        raise
    end_group(True, cfg.timeout)
    return out
