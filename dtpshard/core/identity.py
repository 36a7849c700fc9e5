"""A file's identity that a copy does not keep: what binds a directory's mark (core/owned.py) and
a native library's record (transport/native.py) to the very inode dtpshard wrote.

An inode number alone is not enough: ext4 gives a deleted file's number to the next file made at
once. Two values never repeat for a new inode: its birth time (statx's btime, to the ns) and its
generation number (FS_IOC_GETVERSION: ext4 draws a new one for every inode it hands out, also on a
file system made with 128-byte inodes, which keeps no birth time). A record holds both where the
file system gives them; it binds only when at least one of them was given (`binds`), so a file
system that gives neither cannot vouch for a reused inode, and nothing is trusted there.
"""
from __future__ import annotations

import array
import contextlib
import ctypes
import fcntl
import os
import struct
from pathlib import Path
from typing import Any

_STATX_BTIME, _AT_SYMLINK_NOFOLLOW, _AT_EMPTY_PATH = 0x800, 0x100, 0x1000
_FS_IOC_GETVERSION = 0x80087601  # _IOR('v', 1, long)


def birth_ns(path: Path | int) -> int | None:
    """When the inode at `path` (or open descriptor) was made, in ns (statx's btime; Python's stat
    has none on Linux), or None where the file system or the C library does not say."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        statx = libc.statx
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(256)
    if isinstance(path, int):
        done = statx(path, b"", _AT_EMPTY_PATH, _STATX_BTIME, buf)
    else:
        done = statx(-100, os.fsencode(os.path.abspath(path)), _AT_SYMLINK_NOFOLLOW, _STATX_BTIME, buf)
    mask, = struct.unpack_from("I", buf, 0)
    if done != 0 or not mask & _STATX_BTIME:
        return None
    sec, nsec = struct.unpack_from("qI", buf, 80)  # stx_btime: after mask .. attributes_mask, atime
    return sec * 1_000_000_000 + nsec or None  # 0: the file system keeps none (files of an image)


def generation(path: Path | int) -> int | None:
    """The inode's generation number, or None where the file system keeps none (or keeps 0)."""
    fd = path if isinstance(path, int) else None
    with contextlib.ExitStack() as stack:
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                return None
            stack.callback(os.close, fd)
        buf = array.array("l", [0])
        try:
            fcntl.ioctl(fd, _FS_IOC_GETVERSION, buf)
        except OSError:
            return None
        return buf[0] or None


def identity(path: Path | int) -> dict[str, Any]:
    """{"ino", "born", "gen"} of the inode at `path` (not followed) or open descriptor."""
    st = os.fstat(path) if isinstance(path, int) else os.lstat(path)
    return {"ino": st.st_ino, "born": birth_ns(path), "gen": generation(path)}


def binds(recorded: Any) -> bool:
    """Whether a recorded identity can tell its inode from a later one of the same number."""
    return isinstance(recorded, dict) and (recorded.get("born") is not None or recorded.get("gen") is not None)


def same(recorded: Any, path: Path | int) -> bool:
    """Whether `path` is the very inode `recorded` was taken of (see `binds`)."""
    if not binds(recorded):
        return False
    try:
        now = identity(path)
    except OSError:
        return False
    return all(recorded.get(k) == now[k] for k in ("ino", "born", "gen"))
