"""Data-parallel distillation: the process group, and `--nproc K` as a small torchrun of its own.

Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* in the environment) each process joins the
group directly. `--nproc K` spawns K processes on 127.0.0.1 itself; when one of them fails the
others are terminated and the run ends with that rank's one-line error, never a hang. The
group's timeout bounds every collective, so a rank that dies outside either launcher still
ends the others after --timeout seconds. Backend: NCCL on CUDA, gloo on CPU.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import traceback
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


# -- --nproc K: spawn the processes ourselves -------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, cfg: Any, world: int, port: int, errors: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if "OMP_NUM_THREADS" not in os.environ:  # K processes share the cores, as under torchrun
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from dtpshard.training.distill import distill

    said = Path(errors) / f"rank{rank}.txt"
    try:
        distill(cfg)
    except UserError as e:
        said.write_text("user\t" + str(e))  # the launcher prints it, once
        sys.exit(2)
    except BaseException as e:  # a bug, or a peer lost: the launcher shows the root cause's traceback
        (Path(errors) / f"rank{rank}.traceback").write_text(traceback.format_exc())
        said.write_text(f"error\t{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        sys.exit(1)


def launch(cfg: Any) -> Path:
    """Spawn cfg.nproc processes running this same distillation; returns the run directory."""
    import logging
    import tempfile

    import torch.multiprocessing as mp

    world = cfg.nproc
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # we report the failure ourselves
    with tempfile.TemporaryDirectory(prefix="dtpshard-ranks-") as errors:
        ctx = mp.start_processes(_worker, args=(cfg, world, _free_port(), errors), nprocs=world, join=False,
                                 start_method="spawn")
        try:
            while not ctx.join():
                pass
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
            codes = [p.exitcode for p in ctx.processes]
            raise UserError(_root_cause(Path(errors), codes, e.error_index, world)) from None
    return Path(cfg.out).absolute()


def _root_cause(errors: Path, codes: list[int | None], first: int, world: int) -> str:
    """One line about the rank that started the failure: a user error, else a rank that died
    without a word (killed), else the first rank to report an exception."""
    said = {r: (errors / f"rank{r}.txt").read_text().split("\t", 1) for r in range(world)
            if (errors / f"rank{r}.txt").is_file()}
    for r in sorted(said):
        if said[r][0] == "user":
            return f"rank {r} of {world} failed: {said[r][1]}"
    for r, code in enumerate(codes):
        if r not in said and code not in (0, None, -signal.SIGTERM):
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            return f"rank {r} of {world} died ({how}); the run stopped (rerun the same command to resume)"
    if first in said:
        tb = errors / f"rank{first}.traceback"
        if tb.is_file():
            print(tb.read_text(), file=sys.stderr, end="")
        return f"rank {first} of {world} failed: {said[first][1]} (its traceback is above)"
    return f"rank {first} of {world} died (exit code {codes[first]}); the run stopped (rerun the same command to resume)"
