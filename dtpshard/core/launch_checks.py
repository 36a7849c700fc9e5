"""What a launch takes as input, checked before any work: torchrun's environment, a timeout, and
how many processes and threads this machine can run. The CLI calls `check_launch` before any
command runs; the launcher and the process group call the same checks again, for callers that
do not come through the CLI. No torch here: these are cheap.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from dtpshard.core.cache import cache_dir
from dtpshard.core.errors import UserError
from dtpshard.core.memory import available_bytes as available_memory
from dtpshard.core.memory import size_text

# -- torchrun's environment ----------------------------------------------------------------------
# variable -> the least value it may take (MASTER_PORT also at most 65535)
ENV_INTS = {"WORLD_SIZE": 1, "RANK": 0, "LOCAL_WORLD_SIZE": 1, "LOCAL_RANK": 0, "MASTER_PORT": 1}
_WHAT = {"WORLD_SIZE": "the number of ranks", "RANK": "this rank's number", "LOCAL_WORLD_SIZE":
         "the ranks on this machine", "LOCAL_RANK": "this rank's number on this machine", "MASTER_PORT": "a TCP port"}


@dataclasses.dataclass(frozen=True)
class TorchrunEnv:
    """torchrun's variables as set (None: unset), each checked on its own and against the others."""

    rank: int | None
    world: int | None
    local_rank: int | None
    local_world: int | None
    addr: str | None
    port: int | None


def env_int(name: str) -> int | None:
    """An integer variable of ENV_INTS (None if unset), or one line naming it."""
    v = os.environ.get(name)
    if v is None:
        return None
    try:
        n = int(v)
    except ValueError:
        raise UserError(f"environment variable {name}={v!r} is not an integer ({_WHAT[name]})") from None
    if n < ENV_INTS[name] or (name == "MASTER_PORT" and n > 65535):
        want = "1 to 65535" if name == "MASTER_PORT" else f">= {ENV_INTS[name]}"
        raise UserError(f"environment variable {name}={v!r}: must be {want} ({_WHAT[name]})")
    return n


def torchrun_env() -> TorchrunEnv:
    """The one reading of RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT; anything torchrun would not set is refused with one line."""
    e = TorchrunEnv(env_int("RANK"), env_int("WORLD_SIZE"), env_int("LOCAL_RANK"), env_int("LOCAL_WORLD_SIZE"),
                    os.environ.get("MASTER_ADDR"), env_int("MASTER_PORT"))
    if (e.rank is None) != (e.world is None):  # every command takes RANK alone as "rank 0 or not"
        given, missing = ("RANK", "WORLD_SIZE") if e.world is None else ("WORLD_SIZE", "RANK")
        raise UserError(f"environment variable {given} is set but {missing} is not (torchrun sets both)")
    if e.rank is not None and e.world is not None and e.rank >= e.world:
        raise UserError(f"RANK={e.rank} is outside WORLD_SIZE={e.world} (ranks are 0 to {e.world - 1})")
    if e.local_world is not None and e.world is not None and e.local_world > e.world:
        raise UserError(f"LOCAL_WORLD_SIZE={e.local_world} is more than WORLD_SIZE={e.world}")
    if e.local_rank is not None and e.local_world is not None and e.local_rank >= e.local_world:
        raise UserError(f"LOCAL_RANK={e.local_rank} is outside LOCAL_WORLD_SIZE={e.local_world} "
                        f"(local ranks are 0 to {e.local_world - 1})")
    if e.addr is not None and not e.addr.strip():
        raise UserError("environment variable MASTER_ADDR is empty (the address of rank 0)")
    return e


def world_from_env() -> tuple[int, int]:
    """(rank, world) as torchrun sets them."""
    e = torchrun_env()
    if e.rank is None or e.world is None:
        raise UserError("not started by torchrun (no RANK/WORLD_SIZE): use `torchrun --nproc-per-node L -m "
                        "dtpshard run ...` or pass --nproc L")
    return e.rank, e.world


# -- a timeout -----------------------------------------------------------------------------------
MIN_TIMEOUT = 1.0  # seconds; below it gloo's rendezvous cannot complete even on a quiet machine


def check_timeout(seconds: float, flag: str = "--timeout") -> None:
    """Refuse a wait no process group can meet (the rendezvous alone takes tens of milliseconds,
    and c10d answers a shorter one with pages of C++ frames)."""
    if not seconds >= MIN_TIMEOUT:
        raise UserError(f"{flag} {seconds:g}: must be at least {MIN_TIMEOUT:g} s (each rank's wait for the others; "
                        "a process group cannot even start in less)")


# -- processes and threads for this machine ------------------------------------------------------
THREADS_PER_CORE = 4  # beyond this, OpenMP spends minutes creating and scheduling threads (100000 hung)
PROCS_PER_CORE = 4  # local ranks per core: beyond it every collective waits on ranks the cores cannot run
# a local rank's own memory before its model: forked from the launcher's forkserver, a rank of a tiny
# model held 20 MiB of its own (USS; 343 MiB resident, shared); the rest is its allocator's room
RANK_BYTES = 128 << 20


def cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_threads(threads: int) -> None:
    """Refuse a --threads this machine cannot run: more than THREADS_PER_CORE per core. Cheap, so a
    launcher can call it before it spawns anything."""
    if threads > THREADS_PER_CORE * cores():
        raise UserError(f"--threads {threads}: more than {THREADS_PER_CORE} per core ({cores()} cores here, so at "
                        f"most {THREADS_PER_CORE * cores()}); 0 picks a count for the cores")


def nproc_limits(per_rank: int = RANK_BYTES) -> tuple[int, int]:
    """(the most local ranks the cores run, the most whose memory fits): the rule `check_nproc`
    applies, for a plan to show."""
    return PROCS_PER_CORE * cores(), max(0, available_memory() // max(1, per_rank))


def check_nproc(nproc: int, per_rank: int = RANK_BYTES, flag: str = "--nproc") -> None:
    """Refuse more local ranks than this machine runs: more than PROCS_PER_CORE per core, or more
    than fit in the memory available now at `per_rank` bytes each (RANK_BYTES, plus what the
    caller knows a rank will hold: its shard of the weights). Before anything is spawned."""
    if nproc <= 1:
        return
    by_cores, by_memory = nproc_limits(per_rank)
    if nproc > by_cores:
        raise UserError(f"{flag} {nproc}: more than {PROCS_PER_CORE} processes per core ({cores()} cores here, so "
                        f"at most {by_cores})")
    if nproc > by_memory:
        raise UserError(f"{flag} {nproc}: {nproc} x {size_text(per_rank)} per process is more than the "
                        f"{size_text(available_memory())} of memory available (at most {by_memory} processes)")


# -- the command line ----------------------------------------------------------------------------
def _given(arguments: dict[str, Any], name: str) -> Any:
    """The value of option `name` among a command's bound arguments, or inside a dataclass one
    (distill's DistillConfig); None if not given."""
    for key, value in arguments.items():
        if key == name:
            return value
        if dataclasses.is_dataclass(value) and not isinstance(value, type) and hasattr(value, name):
            return getattr(value, name)
    return None


def check_launch(arguments: dict[str, Any], spawns: bool) -> None:
    """Everything about a launch a command line can get wrong, before the command does any work:
    torchrun's environment (for every command: any of them may run as a rank), its --timeout,
    dtpshard's cache setting, and, where --nproc starts processes (`spawns`), the process count."""
    torchrun_env()
    cache_dir()  # DTPSHARD_CACHE, read deep in a rank (the native kernels, the corpus): refused here, once
    timeout = _given(arguments, "timeout")
    if isinstance(timeout, int | float):
        check_timeout(timeout)
    nproc = _given(arguments, "nproc")
    if spawns and isinstance(nproc, int):
        check_nproc(nproc)
