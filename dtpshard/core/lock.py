"""One process owns an output directory at a time: DIR/.lock, flock'ed by its owner.

The OS releases the lock when the process dies, however it dies; a second process is refused
in one line naming the holder, never left to write beside it (a run, a convert or experiment
directory, a teacher cache, the vLLM environment, the native kernels' cache).

A lock is a file the command made: created with O_CREAT | O_EXCL | O_NOFOLLOW, holding SIGNATURE
and the holder's pid. A lock left by a process that died (SIGKILL: no `finally` ran) is taken over
only when it is recognisably one: a regular file of this user with one link, holding exactly that
signature, that nobody holds. Anything else at the name (a user's file, a hard link to one, a FIFO,
a link) is refused in one line naming it, untouched: it is never truncated, written or removed.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import inspect
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from dtpshard.core.errors import UserError, naming
from dtpshard.core.io import check_writable_dir, output_root, writing

LOCK = ".lock"
SIGNATURE = "dtpshard-lock"  # a lock's whole content: "dtpshard-lock PID\n"
_CONTENT = re.compile(rb"dtpshard-lock ([0-9]{1,10})\n")
_MAX_BYTES = 64
T = TypeVar("T")


def _content() -> bytes:
    return f"{SIGNATURE} {os.getpid()}\n".encode()


def is_lock(path: Path) -> bool:
    """Whether `path` is recognisably a lock dtpshard made (held or stale): a regular file of this
    user, one link, its content exactly the signature. Only such a file is ever taken or removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return _recognised(fd)
    finally:
        os.close(fd)


def _recognised(fd: int) -> bool:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid() or st.st_size > _MAX_BYTES:
        return False
    return _CONTENT.fullmatch(os.pread(fd, _MAX_BYTES + 1, 0)) is not None


def not_a_lock(path: Path, shown: Path) -> UserError:
    try:
        st = os.lstat(path)
    except OSError:
        return UserError(f"{path}: cannot be used as {shown}'s lock; nothing was touched")
    if stat.S_ISLNK(st.st_mode):
        return UserError(f"{path}: is a symbolic link (to {os.readlink(path)}); dtpshard never locks through one "
                         f"(it would write someone else's files): remove the link, or choose another path")
    what = ("a file with more than one name (a hard link)" if stat.S_ISREG(st.st_mode) and st.st_nlink > 1
            else "not a regular file" if not stat.S_ISREG(st.st_mode)
            else "another user's file" if st.st_uid != os.geteuid() else "not a lock dtpshard made")
    return UserError(f"{path}: is {what}, where dtpshard keeps {shown}'s lock; nothing was touched (move it away, "
                     "or choose another path)")


def _holder(fd: int) -> str:
    found = _CONTENT.fullmatch(os.pread(fd, _MAX_BYTES + 1, 0))
    return found.group(1).decode() if found else "unknown"


def acquire(path: Path, shown: Path, wait: float = 0.0, named: Path | None = None) -> int:
    """The open, flock'ed descriptor of lock `path` (for `shown`), made by this call or taken over
    from a dead holder (see the module's docstring); else one line. A held lock is waited for up to
    `wait` seconds, then refused naming its holder. An OS error names `named` (default the lock)."""
    deadline = time.monotonic() + wait
    while True:
        fd, made = _open(path, shown, named or path)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() >= deadline:
                        raise UserError(f"{shown} is in use by process {_holder(fd)} (wait for it to finish, or "
                                        "stop it)") from None
                    time.sleep(0.05)
            try:
                same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # its holder removed it between our open and our lock: take the new one
                os.close(fd)
                continue
            if not made and not _recognised(fd):  # changed under us while we waited: someone else's now
                raise not_a_lock(path, shown)
            with writing(named or path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, _content(), 0)
            return fd
        except BaseException:
            if made:  # the lock this call made is not left behind (a full disk, a refusal)
                _remove(path, fd)
            os.close(fd)
            raise


def _open(path: Path, shown: Path, named: Path) -> tuple[int, bool]:
    """(descriptor, whether this call created the file)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    with naming(named), writing(named):
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            pass
        try:
            fd = os.open(path, flags | os.O_NONBLOCK)  # a FIFO is not waited on
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EACCES, errno.EPERM):
                raise not_a_lock(path, shown) from None
            if e.errno == errno.ENOENT:  # removed meanwhile: create it
                return _open(path, shown, named)
            raise
    if not _recognised(fd):
        os.close(fd)
        raise not_a_lock(path, shown)
    return fd, False


def _remove(path: Path, fd: int) -> None:
    """Remove lock `path` while still holding it (a waiting opener re-checks the inode), only while
    the name is still this descriptor's file."""
    with contextlib.suppress(OSError):
        if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)


def release(path: Path, fd: int) -> None:
    _remove(path, fd)
    os.close(fd)


@contextlib.contextmanager
def locked(run: Path, flag: str = "--out") -> Iterator[None]:
    """Hold RUN/.lock exclusively, or refuse: "RUN is in use by process PID". The OS releases it
    when the process dies, however it dies; a clean exit also removes the file. Also the check
    that RUN can be written, made before any expensive work, and that no link is on the way
    (RUN/.lock, RUN itself: core/io.py's refuse_links, which then guards every write under RUN).
    A RUN this call created that holds nothing afterwards (a refused start) is removed again."""
    run = Path(run).absolute()
    if run.exists() and not run.is_dir():
        raise UserError(f"{flag} {run}: exists and is not a directory")
    created = not run.exists()
    check_writable_dir(run / LOCK)
    path = run / LOCK
    fd = acquire(path, run)
    try:
        with output_root(run):  # every name written under RUN is checked for links (core/io.py)
            yield
    finally:
        release(path, fd)
        if created:
            with contextlib.suppress(OSError):
                run.rmdir()  # only if empty


@contextlib.contextmanager
def locked_output(out: Path) -> Iterator[None]:
    """One writer of a file or whole-directory output (affinity, layout, permute) at a time, decided
    before the work: .NAME.lock beside it, flock'ed and removed as `locked` does. Two commands given
    the same --out never both work and report "wrote"; the second is refused by name at once."""
    out = Path(out).absolute()
    path = out.with_name(f".{out.name}.lock")
    check_writable_dir(out)  # a full disk or a read-only folder is the output's, in the refusal too
    fd = acquire(path, out, named=out)
    try:
        yield
    finally:
        release(path, fd)


def one_writer(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` run holding `locked_output` of its `out` argument, for its whole call."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> T:
        with locked_output(signature.bind(*args, **kwargs).arguments["out"]):
            return fn(*args, **kwargs)
    return call
