"""Imported by the ranks' forkserver (core/launch.py preloads it there): the forkserver ends with
the launcher that started it.

Every rank a forkserver forks holds the pipe through which the forkserver would notice that its
launcher is gone (multiprocessing's "alive" pipe), so the forkserver of a launcher killed outright
would serve on, and its ranks, which ask the kernel to kill them with their parent
(core/ending.die_with_parent), would live on with it. Asked here too, the kernel kills the
forkserver with its launcher, and with it every rank. Anywhere else (a process importing every
module) the import does nothing: the launcher names itself in STARTED_BY only while it starts one.
"""
import os

from dtpshard.core.ending import die_with_parent

STARTED_BY = "DTPSHARD_FORKSERVER_OF"  # the launcher's pid, in the forkserver's environment

if os.environ.get(STARTED_BY) == str(os.getppid()):
    die_with_parent(os.getppid())
