"""Data-parallel distillation: the process group of a run's processes.

Under torchrun, or the local launcher of `--nproc K` (dtpshard.core.launch, which sets the same
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* environment), each process joins the group here. The
group's timeout bounds every collective, so a rank that dies outside either launcher still
ends the others after --timeout seconds. Backend: NCCL on CUDA, gloo on CPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from dtpshard.core.errors import UserError


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
    from dtpshard.core.devices import pick_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = pick_device(cfg.device)
    if world == 1:
        return Dist(device=device)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.nproc not in (1, world):
        raise UserError(f"--nproc {cfg.nproc} but this process group has WORLD_SIZE={world}")
    if device.startswith("cuda"):
        if torch.cuda.device_count() <= local:
            raise UserError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} CUDA devices are visible")
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=cfg.timeout))
    return Dist(rank, world, local, device)


def run_distributed(cfg: Any, train: Callable[[Any, Dist], Path]) -> Path:
    d = setup(cfg)
    try:
        return train(cfg, d)
    finally:
        if d.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
