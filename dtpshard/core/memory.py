"""Memory a step needs, checked before it is taken: one line instead of the OOM killer.

Linux overcommits, so a 500 GB numpy array can "succeed" and the process is killed while
filling it; comparing the known size with what the OS says is available avoids that.
"""
from __future__ import annotations

import ctypes
import ctypes.util

from dtpshard.core.errors import UserError

GIB = 2 ** 30
MIB = 2 ** 20


def size_text(n: float) -> str:
    """A number of bytes as every message and plan says it: GiB from one, else MiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def available_bytes() -> int:
    """Memory the OS can give this process now without swapping (psutil: MemAvailable on Linux)."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_fits(nbytes: int, what: str, hint: str = "") -> None:
    """Raise a one-line UserError if `what` (nbytes) exceeds the available memory."""
    free = available_bytes()
    if nbytes > free:
        raise UserError(f"{what} needs {size_text(nbytes)} of memory, more than the {size_text(free)} "
                        f"available{'; ' + hint if hint else ''}")


MMAP_THRESHOLD = 4 << 20  # bytes: blocks this large or larger come from mmap and go back when freed


def return_freed_memory() -> bool:
    """Make glibc give freed large blocks back to the OS (mallopt M_MMAP_THRESHOLD, fixed): otherwise
    it raises the threshold to the largest block freed so far and keeps such blocks in its heap, and
    a training process's resident set grows by freed activations and all-gathered weights that no
    tensor holds. 4 MiB gives most of a smaller threshold's saving in resident memory at the speed
    of glibc's default (docs/benchmarks.md, "glibc's mmap threshold"). Linux/glibc only; False
    elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, MMAP_THRESHOLD))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
