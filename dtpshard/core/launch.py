"""Starting the ranks of a multi-process run: torchrun's environment, the process group, a local
launcher (`--nproc L`), and failures that end a rank with one line instead of a hang.

torchrun (or `launch_local`) sets RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT;
`process_group` joins them with a timeout on both the rendezvous and every collective.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing as mp
import os
import re
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from dtpshard.core.errors import UserError, explain


class RankFailure(UserError):
    """A collective failed or timed out: another rank died, hung or never started."""


def cause(e: BaseException) -> str:
    """The useful part of a gloo/c10d message: no source location, no boilerplate advice."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". This is typically")[0][:160]


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    try:
        return None if v is None else int(v)
    except ValueError:
        raise UserError(f"environment variable {name}={v!r} is not an integer") from None


def world_from_env() -> tuple[int, int]:
    """(rank, world) as torchrun sets them."""
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is None or world is None:
        raise UserError("not started by torchrun (no RANK/WORLD_SIZE): use `torchrun --nproc-per-node L -m "
                        "dtpshard run ...` or pass --nproc L")
    if not 0 <= rank < world:
        raise UserError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return rank, world


@contextlib.contextmanager
def process_group(timeout: float, backend: str = "gloo") -> Iterator[tuple[int, int]]:
    """Join the ranks (env://) -> (rank, world). A RankFailure inside ends this process at once:
    a process group with a failed collective cannot be torn down (gloo aborts in its destructor)."""
    rank, world = world_from_env()
    if dist.is_initialized():  # someone else owns it
        yield dist.get_rank(), dist.get_world_size()
        return
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if backend == "nccl":  # one GPU per rank on each machine
        torch.cuda.set_device(_env_int("LOCAL_RANK") or 0)
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise RankFailure(f"rank {rank}: the {world} ranks did not all join at {where} within {timeout:g} s "
                          f"({cause(e)})") from None
    try:
        yield rank, world
    except RankFailure as e:
        print(f"dtpshard run: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = ("dtpshard.runtime.ranks", "dtpshard.model.generate", "transformers.models.llama.modeling_llama",
            "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3",
            "transformers.models.mistral.modeling_mistral", "transformers.tokenization_utils_fast")


def _context() -> Any:
    """A forkserver that imports torch and transformers once, so a rank starts in a fraction of a
    second instead of re-importing them (spawn); plain fork is unsafe once OpenMP threads exist."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _adopt_stdio(out: Any, err: Any) -> None:
    os.dup2(out.detach(), 1)
    os.dup2(err.detach(), 2)


class _Stdio:
    """Pickles as the launcher's current fds 1 and 2, so a rank writes where its launcher writes now
    (a forkserver's children would otherwise inherit the forkserver's, from whenever it started)."""

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return _adopt_stdio, (reduction.DupFd(1), reduction.DupFd(2))


@dataclasses.dataclass
class RankExit:
    """How a local rank ended: its exit code, the one line of a UserError it raised, or the
    traceback of anything else (a bug, or a peer lost)."""

    rank: int
    code: int | None
    said: str | None = None
    traceback: str | None = None


def _child(stdio: Any, env: dict[str, str], target: Callable[..., Any], args: tuple, report: str) -> None:
    os.environ.clear()  # the launcher's environment now, not the forkserver's from when it started
    os.environ.update(env)
    said = Path(report) / f"rank{env['RANK']}"
    try:
        code = target(*args)
    except Exception as e:  # noqa: BLE001 -- a user's error (per explain: a full disk too): said once, by the launcher
        line = explain(e)
        if line is None:
            said.with_suffix(".error").write_text(traceback.format_exc())
            code = 1
        else:
            said.with_suffix(".user").write_text(line)
            code = 2
    except BaseException:  # noqa: BLE001 -- the launcher shows the root cause's traceback
        said.with_suffix(".error").write_text(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.exit(int(code or 0))


def launch_local(nproc: int, target: Callable[..., Any], args: tuple = (), grace: float = 60,
                 deadline: float | None = None, who: str = "dtpshard") -> list[RankExit]:
    """Run target(*args) in `nproc` new processes set up as torchrun would (RANK, WORLD_SIZE,
    MASTER_ADDR=127.0.0.1, a free port) -> how each ended. Once one fails, the rest get `grace`
    seconds to stop on their own before they are killed, so a failure never hangs the launcher;
    all are killed `deadline` seconds after the start if given. The one local launcher, for the
    runtime (`run --nproc`) and data-parallel distillation (`distill --nproc`)."""
    ctx = _context()
    sys.stdout.flush()
    sys.stderr.flush()
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc)}
    with tempfile.TemporaryDirectory(prefix="dtpshard-ranks-") as report:
        procs = [ctx.Process(target=_child, args=(_Stdio(), {**base, "RANK": str(r), "LOCAL_RANK": str(r)}, target,
                                                  args, report)) for r in range(nproc)]
        for p in procs:
            p.start()
        start, failed_at, killed = time.monotonic(), None, set()
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            why = None
            if failed_at is not None and now - failed_at > grace:
                why = f"still running {grace:g} s after another rank failed"
            elif deadline is not None and now - start > deadline:
                why = f"still running after the {deadline:g} s deadline"
            for r, p in enumerate(procs):
                if why and p.is_alive() and r not in killed:
                    print(f"{who}: error: rank {r} {why}; killed", file=sys.stderr, flush=True)
                    p.kill()
                    killed.add(r)
            time.sleep(0.05)
        for p in procs:
            p.join()
        def said(r: int, ext: str) -> str | None:
            f = Path(report) / f"rank{r}{ext}"
            return f.read_text() if f.is_file() else None

        return [RankExit(r, p.exitcode, said(r, ".user"), said(r, ".error")) for r, p in enumerate(procs)]


def root_cause(exits: list[RankExit]) -> str | None:
    """One line about the rank that started a failure (None if every rank succeeded): a user error,
    else a rank that died without a word (killed), else the first rank that raised, whose
    traceback is printed above the line."""
    world = len(exits)
    for e in exits:
        if e.said is not None:
            return f"rank {e.rank} of {world} failed: {e.said}"
    for e in exits:
        if e.traceback is None and e.code not in (0, None, -signal.SIGTERM, -signal.SIGKILL):
            how = f"killed by signal {-e.code}" if e.code < 0 else f"exit code {e.code}"
            return f"rank {e.rank} of {world} died ({how})"
    for e in exits:
        if e.traceback is not None:
            print(e.traceback, file=sys.stderr, end="")
            last = e.traceback.strip().splitlines()[-1]
            return f"rank {e.rank} of {world} failed: {last} (its traceback is above)"
    bad = [e for e in exits if e.code]
    return None if not bad else f"rank {bad[0].rank} of {world} died (exit code {bad[0].code})"


def set_threads(threads: int = 0) -> None:
    """Split the cores between this machine's ranks, leaving each rank two for its transfers unless
    told otherwise: gloo's worker and I/O threads progress the asynchronous sums, and behind
    spinning OpenMP threads they starve (measured: 3 ranks x 4 threads on 16 cores hid no transfer
    at all, 3 x 3 hid most of them)."""
    local = _env_int("LOCAL_WORLD_SIZE") or 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(threads or max(1, cores // local - 2))


