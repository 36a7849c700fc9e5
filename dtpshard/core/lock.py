"""One process owns an output directory at a time: DIR/.lock, flock'ed by its owner.

The OS releases the lock when the process dies, however it dies; a second process is refused
in one line naming the holder, never left to write beside it (a run, a convert or experiment
directory, a teacher cache, the vLLM environment, the native kernels' cache).

A lock is a file the command made, holding SIGNATURE and the holder's pid: written and flock'ed
before it gets its name (linked there from a nameless file, or renamed there without replacing),
so no process ever finds it empty or free between its birth and its holder's lock. A lock left by
a process that died (SIGKILL: no `finally` ran) is removed and made anew only when it is
recognisably one: a regular file of this user with one link, holding exactly that signature, that
nobody holds. Anything else at the name (a user's file, a hard link to one, a FIFO,
a link) is refused in one line naming it, untouched: it is never truncated, written or removed.
"""
from __future__ import annotations

import contextlib
import ctypes
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
from dtpshard.core.temporary import temporary_name

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
            else "another user's file" if st.st_uid != os.geteuid()
            else f"a file this user may not write (mode {stat.S_IMODE(st.st_mode):o})"
            if not os.access(path, os.W_OK, follow_symlinks=False) else "not a lock dtpshard made")
    return UserError(f"{path}: is {what}, where dtpshard keeps {shown}'s lock; nothing was touched (move it away, "
                     "or choose another path)")


def _holder(fd: int) -> str:
    found = _CONTENT.fullmatch(os.pread(fd, _MAX_BYTES + 1, 0))
    return found.group(1).decode() if found else "unknown"


def acquire(path: Path, shown: Path, wait: float = 0.0, named: Path | None = None) -> int:
    """The open, flock'ed descriptor of lock `path` (for `shown`), made by this call, or made anew
    after a dead holder's (see the module's docstring); else one line. A held lock is waited for up
    to `wait` seconds, then refused naming its holder. An OS error names `named` (default the lock)."""
    deadline = time.monotonic() + wait
    while True:
        fd = _create(path, named or path)
        if fd is not None:  # born signed and held: nobody ever sees it otherwise
            return fd
        fd = _open(path, shown, named or path)
        if fd is None:  # gone meanwhile: make it
            continue
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
            # a dead holder's (or one released as we waited): removed while held, then made anew
            # signed, so a waiting opener re-checks the inode and a reader never finds it unsigned
            if _recognised(fd):
                _remove(path, fd)
            elif _same(path, fd):  # changed under us while we waited: someone else's now
                raise not_a_lock(path, shown)
        finally:
            os.close(fd)


def _same(path: Path, fd: int) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
    except FileNotFoundError:
        return False


_RENAME_NOREPLACE, _AT_SYMLINK_FOLLOW = 1, 0x400


def _create(path: Path, named: Path) -> int | None:
    """A new lock at `path`, written and flock'ed before it gets its name -> its descriptor, or None
    if the name exists. The file is made nameless (O_TMPFILE) and linked to the name, or, where the
    file system cannot, made as a temporary and renamed to the name without replacing (renameat2):
    either way the name appears only on a signed, held lock."""
    flags = os.O_RDWR | os.O_CLOEXEC
    parent = Path(path).parent
    with naming(named), writing(named):
        try:
            fd, tmp = os.open(parent, flags | os.O_TMPFILE, 0o644), None
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            tmp = parent / temporary_name(path.name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # this process's own (its name's check holds for this pid)
            fd = os.open(tmp, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, _content())
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else has it yet: never blocks
            if tmp is None:
                _call("linkat", -100, f"/proc/self/fd/{fd}", -100, path, _AT_SYMLINK_FOLLOW)
            else:
                _call("renameat2", -100, tmp, -100, path, _RENAME_NOREPLACE)
            return fd
        except FileExistsError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        finally:
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)


def _call(name: str, at: int, src: str | Path, at2: int, dst: Path, flags: int) -> None:
    """linkat or renameat2 from the C library (os.link cannot follow /proc's link; os has no renameat2)."""
    if getattr(ctypes.CDLL(None, use_errno=True), name)(at, os.fsencode(src), at2, os.fsencode(dst), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(dst))


def _open(path: Path, shown: Path, named: Path) -> int | None:
    """The descriptor of the existing lock at `path`, or None if it is gone; else one line. What
    is at the name is always a signed lock or someone else's file: nothing is waited for to sign."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO is not waited on
    with naming(named), writing(named):
        try:
            fd = os.open(path, flags)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return None
            if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EACCES, errno.EPERM):
                raise not_a_lock(path, shown) from None
            raise
    if not _recognised(fd):
        gone = not _same(path, fd)  # released (unlinked) between our open and our look: not a stranger
        os.close(fd)
        if gone:
            return None
        raise not_a_lock(path, shown)
    return fd


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
def locked(run: Path, flag: str = "--out", wait: float = 0.0) -> Iterator[None]:
    """Hold RUN/.lock exclusively (a holder waited for up to `wait` seconds), or refuse: "RUN is in
    use by process PID". The OS releases it
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
    fd = acquire(path, run, wait)
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
