"""Starting a multi-process run's ranks: torchrun's environment, the process group, a local launcher
(`--nproc L`), and failures that end a rank with one line instead of a hang.

torchrun (or `launch_local`) sets RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (core/launch_checks.py
checks them); `process_group` joins them with a timeout on the rendezvous and every collective and ends the group in
order (transfers taken, a barrier, the group destroyed); a torchrun rank then leaves without teardown (`leave`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtpshard.core.ending import die_with_parent, end_rank, exit_code, flush, rank_failed
from dtpshard.core.errors import UserError, explain, first_line
from dtpshard.core.forkserver import STOPS, forkserver_context
from dtpshard.core.launch_checks import check_nproc, check_threads, check_timeout, cores, env_int, world_from_env
from dtpshard.core.reading import read_text

__all__ = ["RankExit", "RankFailure", "at_shutdown", "cause", "check_threads", "cores", "end_group", "free_port",
           "join_group", "joined", "launch_local", "process_group", "root_cause", "set_threads", "world_from_env"]


class RankFailure(UserError):
    """A collective failed or timed out: another rank died, hung or never started."""


def cause(e: BaseException) -> str:
    """The useful part of a gloo/c10d message: no source location, no boilerplate advice."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", first_line(e, limit=1 << 16))
    return text.split(". This is typically")[0][:160]


# -- threads -------------------------------------------------------------------------------------
def set_threads(threads: int = 0) -> None:
    """Split the cores between this machine's ranks, leaving each rank two for its transfers unless
    told otherwise: gloo's worker and I/O threads progress the asynchronous sums, and behind
    spinning OpenMP threads they starve (docs/benchmarks.md, "Threads per rank")."""
    check_threads(threads)
    local = env_int("LOCAL_WORLD_SIZE") or 1
    torch.set_num_threads(threads or max(1, cores() // local - 2))


# -- a rank's process group (every Link and exchange of this process closes before it ends) ------
_closers: list[weakref.WeakMethod] = []  # close(wait) of each Link or shared ring (runtime/ranks.py)
_report: Path | None = None  # set in a rank of launch_local: where it tells the launcher it joined
_ended = False  # this process has ended a process group (`leave`)


def at_shutdown(close: Callable[[bool], bool]) -> None:
    """Register a bound method close(wait) -> nothing left in flight; process_group calls it before
    it ends the group: wait=True on a clean exit (take every posted transfer), False after an error
    (forget them). Held weakly: an object that is gone has nothing in flight."""
    _closers.append(weakref.WeakMethod(close))


def joined() -> None:
    """Tell this rank's launcher (if launch_local started it) that the rank is in its process group:
    once another rank fails, a rank that never joined would wait out the rendezvous, so the
    launcher stops it at once."""
    if _report is not None:
        _report.with_suffix(".joined").touch()


def _close_links(wait: bool) -> bool:
    closers, _closers[:] = [c() for c in _closers], []
    idle = [c(wait) for c in closers if c is not None]  # every Link forgets its transfers, none skipped
    return all(idle)


def end_group(clean: bool, timeout: float) -> None:
    """End this process's default group. Clean: every posted transfer taken, then a barrier (no rank
    closes its connections while a peer still has a transfer in flight with it), then destroyed,
    which joins gloo's threads. After an error: destroyed only when nothing is in flight; a
    transfer in flight keeps a gloo thread waiting on the peers, and destroying the group would
    wait for it (up to the timeout), so the caller must end the process (`_die`)."""
    if not dist.is_initialized():
        return
    if clean:
        _close_links(True)
        try:
            dist.barrier()
        except RuntimeError as e:
            raise RankFailure(f"rank {dist.get_rank()}: the barrier at the end failed ({cause(e)}); another rank "
                              f"died, hung or was stopped (waited up to {timeout:g} s)") from None
    elif not _close_links(False):
        raise _InFlight
    global _ended
    dist.destroy_process_group()
    _ended = True


def leave(code: int) -> None:
    """End a process that has ended a process group (a torchrun rank, at the very end of its
    command): its output flushed, then os._exit(code), without the interpreter's teardown, where
    torch's C++ static destructors can meet a thread still alive and abort (SIGABRT, "terminate
    called without an active exception") after the rank has printed its result. A process with
    no group returns: nothing of torch.distributed is left to tear down."""
    if not _ended:
        return
    flush()
    os._exit(code)


class _InFlight(Exception):
    """A transfer is still in flight: this process group cannot be ended from here."""


def _die(line: str | None, code: int) -> None:
    """End the process now, without the interpreter's teardown (which would wait on, or abort in,
    a process group that cannot be ended): its one line first."""
    if line:
        print(line, file=sys.stderr, flush=True)
    flush()
    os._exit(code)


def join_group(timeout: float, backend: str) -> tuple[int, int]:
    """Join torchrun's ranks (env://) -> (rank, world); one line when they do not all join in time."""
    check_timeout(timeout)
    rank, world = world_from_env()
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise RankFailure(f"rank {rank}: the {world} ranks did not all join at {where} within {timeout:g} s "
                          f"({cause(e)})") from None
    joined()
    return rank, world


@contextlib.contextmanager
def process_group(timeout: float, backend: str = "gloo", who: str = "dtpshard run") -> Iterator[tuple[int, int]]:
    """Join the ranks (env://) -> (rank, world), and end the group on the way out (`end_group`).
    A RankFailure inside, or any error while a transfer is in flight, ends this process at once
    with one line: its peers are lost or still waiting, and the group cannot be torn down."""
    if dist.is_initialized():  # someone else owns it
        joined()
        yield dist.get_rank(), dist.get_world_size()
        return
    if backend == "nccl":  # one GPU per rank on each machine
        torch.cuda.set_device(env_int("LOCAL_RANK") or 0)
    rank, world = join_group(timeout, backend)  # checks the timeout first
    try:
        yield rank, world
    except RankFailure as e:
        _die(f"{who}: error: {e}", 2)
    except BaseException as e:
        try:
            end_group(False, timeout)
        except _InFlight:
            _die(*_said(e, who))
        raise
    try:
        end_group(True, timeout)
    except RankFailure as e:
        _die(f"{who}: error: {e}", 2)


def _said(e: BaseException, who: str) -> tuple[str | None, int]:
    """(the line, the exit code) the CLI would give for `e` (which cannot reach it now)."""
    if isinstance(e, SystemExit):  # SIGTERM in signals.exit_on_sigterm: quiet, as SIGTERM is
        return None, exit_code(e)
    if isinstance(e, KeyboardInterrupt):
        return f"{who}: interrupted", 130
    line = explain(e) if isinstance(e, Exception) else None
    if line is None:
        return "".join(traceback.format_exception(e)).rstrip(), 1
    return f"{who}: error: {line}", 2


# -- the local launcher --------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STOP_GRACE = 3.0  # seconds a stopped rank has between SIGTERM (its temporaries removed) and SIGKILL
_LAUNCHER = "DTPSHARD_LAUNCHER_PID"  # a rank's environment: the process that started it
REPORT_BYTES = 1 << 20  # a rank's report to its launcher: one line, or a traceback


def _adopt_stdio(out: Any, err: Any) -> None:
    os.dup2(out.detach(), 1)
    os.dup2(err.detach(), 2)


class _Stdio:
    """Pickles as the launcher's current fds 1 and 2, so a rank writes where its launcher writes now
    (a forkserver's children would otherwise inherit the forkserver's, from whenever it started)."""

    def __reduce__(self) -> tuple:
        return _adopt_stdio, (reduction.DupFd(1), reduction.DupFd(2))


@dataclasses.dataclass
class RankExit:
    """How a local rank ended: its exit code, the one line of a UserError it raised, or the
    traceback of anything else (a bug, or a peer lost); stopped: the launcher ended it (a signal,
    another rank's failure, the grace or the deadline), so it is not a root cause."""

    rank: int
    code: int | None
    said: str | None = None
    traceback: str | None = None
    stopped: bool = False


def _child(stdio: Any, env: dict[str, str], target: Callable[..., Any], args: tuple, report: str) -> None:
    global _report
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops the ranks (if the forkserver did not)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's way to stop a rank
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # blocked in the forkserver (`forkserver_context`)
    die_with_parent(int(env[_LAUNCHER]))
    os.environ.clear()  # the launcher's environment now, not the forkserver's from when it started
    os.environ.update(env)
    said = _report = Path(report) / f"rank{env['RANK']}"
    try:
        code = target(*args)
    except BaseException as e:
        end_rank(rank_failed(e, said))  # here, while `e` still holds the failed run's frames (end_rank)
    end_rank(int(code or 0))


@contextlib.contextmanager
def _catching(signals: tuple[int, ...]) -> Iterator[list[int]]:
    """The signals received inside the block, instead of their default action (which would leave the
    ranks running, or the temporary directory behind). Only the main thread may set handlers; a
    signal this process ignores (nohup, a shell's background job) stays ignored."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in signals
                if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield caught
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _stop(procs: list[Any], ranks: list[int]) -> None:
    """SIGTERM (a rank removes the temporary it is writing), SIGKILL after STOP_GRACE seconds."""
    for r in ranks:
        procs[r].terminate()
    end = time.monotonic() + STOP_GRACE
    while time.monotonic() < end and any(procs[r].is_alive() for r in ranks):
        time.sleep(0.02)
    for r in ranks:
        if procs[r].is_alive():
            procs[r].kill()


def launch_local(nproc: int, target: Callable[..., Any], args: tuple = (), grace: float = 60,
                 deadline: float | None = None, who: str = "dtpshard") -> list[RankExit]:
    """Run target(*args) in `nproc` new processes set up as torchrun would (RANK, WORLD_SIZE,
    MASTER_ADDR=127.0.0.1, a free port) -> how each ended. The one local launcher, for the runtime
    (`run --nproc`) and data-parallel distillation (`distill --nproc`).

    target is the rank's body only, and must not re-enter the command that launched it: what the
    launcher holds for its ranks (a run's lock) stays in the launcher, and nothing about it needs
    to reach the ranks. A failure never hangs the launcher: once a rank fails, those that have not
    joined their process group (`joined`) are stopped at once (they would wait out the rendezvous),
    the rest get `grace` seconds to stop on their own; all are stopped `deadline` seconds after the
    start if given. SIGINT or SIGTERM at any moment stops every rank, removes the temporary
    directory, and then raises KeyboardInterrupt (the CLI: "interrupted", 130) or SystemExit(143)
    (the CLI: "terminated"). More ranks than this machine runs are refused before any starts."""
    check_nproc(nproc)
    with _catching((signal.SIGINT, signal.SIGTERM)) as caught, \
            tempfile.TemporaryDirectory(prefix="dtpshard-ranks-") as report:
        ctx = forkserver_context()
        sys.stdout.flush()
        sys.stderr.flush()
        base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), _LAUNCHER: str(os.getpid())}
        procs = [ctx.Process(target=_child, args=(_Stdio(), {**base, "RANK": str(r), "LOCAL_RANK": str(r)}, target,
                                                  args, report)) for r in range(nproc)]
        try:
            for p in procs:
                if not caught:
                    p.start()
        except BaseException:  # a target that cannot be pickled, say: no rank outlives its launcher
            _stop(procs, [r for r, p in enumerate(procs) if p.pid is not None])
            if not caught:  # else the signal's doing (a forkserver stopped with it): said below
                raise
        started = [r for r, p in enumerate(procs) if p.pid is not None]
        stopped: set[int] = set()
        try:
            _watch(procs, started, stopped, caught, report, grace, deadline, who)
        finally:  # whatever ends the wait (an error here, a test's timeout), no rank outlives it
            _stop(procs, [r for r in started if procs[r].is_alive()])
        for r in started:
            procs[r].join()

        def said(r: int, ext: str) -> str | None:
            f = Path(report) / f"rank{r}{ext}"
            return read_text(f, REPORT_BYTES, "rank report") if f.is_file() else None

        exits = [RankExit(r, p.exitcode, said(r, ".user"), said(r, ".error"), r in stopped or p.pid is None)
                 for r, p in enumerate(procs)]
    if caught and caught[0] == signal.SIGINT:
        raise KeyboardInterrupt
    if caught:  # the CLI says "terminated"
        raise SystemExit(128 + caught[0])
    return exits


def _watch(procs: list[Any], started: list[int], stopped: set[int], caught: list[int], report: str, grace: float,
           deadline: float | None, who: str) -> None:
    """Wait for the started ranks, stopping them as `launch_local` says (`stopped`: those it stopped)."""
    start, failed_at = time.monotonic(), None
    while any(procs[r].is_alive() for r in started):
        now, alive = time.monotonic(), [r for r in started if procs[r].is_alive() and r not in stopped]
        why, quiet = None, False
        if caught:
            why, quiet = "interrupted", True
        elif failed_at is None and any(procs[r].exitcode not in (None, 0) for r in started):
            failed_at = now
            alive = [r for r in alive if not (Path(report) / f"rank{r}.joined").exists()]
            why, quiet = "never joined", True
        elif failed_at is not None and now - failed_at > grace:
            why = f"still running {grace:g} s after another rank failed"
        elif deadline is not None and now - start > deadline:
            why = f"still running after the {deadline:g} s deadline"
        if why and alive:
            for r in alive if not quiet else ():
                print(f"{who}: error: rank {r} {why}; killed", file=sys.stderr, flush=True)
            _stop(procs, alive)
            stopped.update(alive)
        time.sleep(0.02)


def root_cause(exits: list[RankExit]) -> str | None:
    """One line about the rank that started a failure (None if every rank succeeded): a user error,
    else a rank that died without a word (not stopped by its launcher), else the first rank that
    raised, whose traceback is printed above the line."""
    world = len(exits)
    for e in exits:
        if e.said is not None:
            return f"rank {e.rank} of {world} failed: {e.said}"
    for e in exits:
        if e.traceback is None and not e.stopped and e.code not in (0, None, -signal.SIGTERM, -signal.SIGKILL):
            how = f"killed by signal {-e.code}" if e.code < 0 else f"exit code {e.code}"
            return f"rank {e.rank} of {world} died ({how})"
    for e in exits:
        if e.traceback is not None:
            print(e.traceback, file=sys.stderr, end="")
            last = e.traceback.strip().splitlines()[-1]
            return f"rank {e.rank} of {world} failed: {last} (its traceback is above)"
    bad = sorted((e for e in exits if e.code), key=lambda e: e.stopped)
    return None if not bad else f"rank {bad[0].rank} of {world} died (exit code {bad[0].code})"
