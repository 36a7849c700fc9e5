"""How a command meets SIGTERM and SIGINT: one line and its cleanup, at any moment.

Python dies on the spot at SIGTERM, so inside `exit_on_sigterm` it raises SystemExit(143) and
`finally` clauses run (a write removes its temporary). A handler that raises is safe only where
Python, not C++, is unwinding: torch's import runs Python inside C++ (autograd's init imports
modules), and an exception raised there aborts the process (std::terminate, a core dump and a page
of frames). `signals_deferred` holds both signals while such a block runs; they are raised as ever
when it ends.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # where Python runs every handler


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """Inside this block SIGTERM raises SystemExit(143)."""
    if not _main_thread() or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM wait, pending, until this block ends."""
    if not _main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
