"""The ranks' forkserver: how a launcher starts it (`forkserver_context`), and, imported inside it
(the first module it preloads), its end with the launcher that started it.

Every rank a forkserver forks holds the pipe through which the forkserver would notice that its
launcher is gone (multiprocessing's "alive" pipe), so the forkserver of a launcher killed outright
would serve on, and its ranks, which ask the kernel to kill them with their parent
(core/ending.die_with_parent), would live on with it. Asked at import too, the kernel kills the
forkserver with its launcher, and with it every rank. Anywhere else (a process importing every
module) the import does nothing: the launcher names itself in STARTED_BY only while it starts one.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import threading
from multiprocessing import forkserver, resource_tracker
from typing import Any

from dtpshard.core.ending import die_with_parent

STARTED_BY = "DTPSHARD_FORKSERVER_OF"  # the launcher's pid, in the forkserver's environment
STOPS = {signal.SIGINT, signal.SIGTERM}  # blocked in the forkserver and so in every rank it forks

if os.environ.get(STARTED_BY) == str(os.getppid()):
    die_with_parent(os.getppid())


def _preload() -> list[str]:
    from dtpshard.core.shape import FAMILY

    return [__name__, "dtpshard.runtime.run", "dtpshard.training.loop", "dtpshard.model.generate",
            *(f.modeling for f in FAMILY.values()), "transformers.tokenization_utils_fast"]


def forkserver_context() -> Any:
    """A forkserver that imports torch and transformers once, so a rank starts in a fraction of a
    second instead of re-importing them (spawn); plain fork is unsafe once OpenMP threads exist.
    Started with SIGINT and SIGTERM blocked, which it and every rank it forks inherit (the rank
    unblocks them): a Ctrl-C or a SIGTERM sent to the whole process group is the launcher's to
    handle; a forkserver killed while it imports would fail the launcher's next start (EOFError).
    Blocked, not ignored: one that reaches the launcher meanwhile is held, not lost."""
    from dtpshard.core.errors import UserError

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_preload())
    if threading.current_thread() is threading.main_thread():
        resource_tracker.ensure_running()  # the forkserver's first step, which unblocks both signals
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
        os.environ[STARTED_BY] = str(os.getpid())  # it dies with this process (above)
        try:
            forkserver.ensure_running()  # a no-op once it runs
        except OSError as e:  # its unix socket goes under TMPDIR: a path of at most 107 bytes
            raise UserError(f"the ranks' forkserver: {e} ({tempfile.gettempdir()}): set TMPDIR shorter") from None
        finally:
            del os.environ[STARTED_BY]
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return ctx
