"""Memory a step needs, checked before it is taken: one line instead of the OOM killer.

Linux overcommits, so a 500 GB numpy array can "succeed" and the process is killed while
filling it; comparing the known size with what the OS says is available avoids that.
"""
from __future__ import annotations

from dtpshard.core.errors import UserError

GIB = 2 ** 30


def available_bytes() -> int:
    """Memory the OS can give this process now without swapping (psutil: MemAvailable on Linux)."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_fits(nbytes: int, what: str, hint: str = "") -> None:
    """Raise a one-line UserError if `what` (nbytes) exceeds the available memory."""
    free = available_bytes()
    if nbytes > free:
        raise UserError(f"{what} needs {nbytes / GIB:.1f} GiB of memory, more than the {free / GIB:.1f} GiB "
                        f"available{'; ' + hint if hint else ''}")
