"""Publishing a finished temporary under its final name without ever replacing another writer's.

`os.replace` overwrites whatever is at the destination, and an "exists?" check before it leaves a
window in which a second process can publish first and be silently replaced. Linux's
renameat2(2) closes the window in the kernel: RENAME_NOREPLACE fails with EEXIST when the name is
taken, RENAME_EXCHANGE swaps two names atomically (an output replaced with --force is never
absent). glibc >= 2.28 exports renameat2; older ones are reached through syscall(2). On a file
system without it (EINVAL), a file is published by link(2), which also fails when the name
exists, and a directory by rename(2), which refuses a non-empty destination (only an empty
directory that appeared meanwhile could be replaced).
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import shutil
from pathlib import Path

from dtpshard.core.errors import UserError
from dtpshard.core.temporary import temporary_name

_AT_FDCWD = -100
_NOREPLACE, _EXCHANGE = 1, 2
_SYSCALL = {"x86_64": 316, "aarch64": 276, "arm64": 276, "ppc64le": 357, "s390x": 347, "riscv64": 276}
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP)


class Occupied(UserError):
    """The output's name was taken by another writer while this one was writing it."""


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """True when done, False when this kernel or file system has no renameat2; other errors raise."""
    libc = _libc()
    args = (_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags)
    if libc is not None and hasattr(libc, "renameat2"):
        rc = libc.renameat2(*args)
    elif libc is not None and platform.machine() in _SYSCALL:
        rc = libc.syscall(_SYSCALL[platform.machine()], *args)
    else:
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _taken(dst: Path) -> Occupied:
    return Occupied(f"{dst} was written by another process while this one was writing it; it was left as "
                    "it is and this result was discarded (run one writer per output)")


def publish_new(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`, which must not exist: Occupied (nothing changed) if it does."""
    try:
        if _renameat2(src, dst, _NOREPLACE):
            return
    except FileExistsError:
        raise _taken(dst) from None
    try:
        if src.is_dir():
            os.rename(src, dst)  # fails on a non-empty directory or a file at dst
        else:
            os.link(src, dst)  # fails if dst exists
            os.unlink(src)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise _taken(dst) from None
        raise


def publish_over(src: Path, dst: Path) -> None:
    """Put directory `src` where `dst` is, atomically (the old one is removed afterwards); a `dst`
    that disappeared meanwhile is simply created."""
    try:
        done = _renameat2(src, dst, _EXCHANGE)
    except FileNotFoundError:
        publish_new(src, dst)
        return
    if not done:
        old = dst.with_name(temporary_name(dst.name, ".old"))
        os.replace(dst, old)
        os.replace(src, dst)
        src = old
    _remove(src)  # the old output


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
