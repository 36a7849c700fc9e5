"""How a rank that `launch_local` started ends: never through the interpreter's teardown, and
never after its launcher.

A failed run's objects are still alive when its exception reaches the rank's top (a DDP reducer
and the gloo group it holds, a thread of a transfer). Destroying one joins a gloo thread that
may wait for the interpreter lock held by the thread tearing it down, and multiprocessing's own
exit joins every thread: either can keep the rank alive forever, and with it whoever waits for
it (its launcher, a test run's interpreter at exit). So a rank writes its report and leaves
with os._exit while its exception still holds those objects (`end_rank`), and asks the kernel
to kill it when its parent dies (`die_with_parent`): a launcher killed outright leaves no rank.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from pathlib import Path

from dtpshard.core.errors import explain

_PR_SET_PDEATHSIG = 1  # prctl(2)


def flush() -> None:
    """stdout and stderr flushed, whatever state they are in (os._exit flushes nothing)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def exit_code(e: SystemExit) -> int:
    return 0 if e.code is None else e.code if isinstance(e.code, int) else 1


def die_with_parent(launcher: int) -> None:
    """SIGKILL this process when its parent dies (the forkserver, which exits when the launcher
    does; or the launcher itself under spawn); `launcher`: its pid, already gone means now."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launcher's grace and deadline still end a rank
        return
    try:
        os.kill(launcher, 0)  # gone before prctl took effect: no one is left to end this rank
    except ProcessLookupError:
        os._exit(128 + signal.SIGKILL)
    except PermissionError:  # alive, another user's pid now: it was not gone
        pass


def rank_failed(e: BaseException, report: Path) -> int:
    """The exit code of a rank that raised `e`, its report (`report`.user: the one line of a
    user's error; .error: a traceback) written for its launcher."""
    if isinstance(e, SystemExit):  # SIGTERM in signals.exit_on_sigterm, after its cleanup: quiet, as SIGTERM is
        return exit_code(e)
    line = explain(e) if isinstance(e, Exception) else None  # a full disk is a user's error too
    if line is not None:
        report.with_suffix(".user").write_text(line)
        return 2
    report.with_suffix(".error").write_text("".join(traceback.format_exception(e)))
    return 1


def end_rank(code: int) -> None:
    """os._exit(code) once the output is flushed: nothing of the rank is torn down."""
    flush()
    os._exit(code)
