"""One process owns an output directory at a time: DIR/.lock, flock'ed by its owner.

The OS releases the lock when the process dies, however it dies; a second process is refused
in one line naming the holder, never left to write beside it (a run, a convert or experiment
directory, a teacher cache, the vLLM environment).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from dtpshard.core.errors import UserError, naming
from dtpshard.core.io import check_writable_dir, output_root, writing

LOCK = ".lock"
T = TypeVar("T")


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
    fd = _lock(path, run)
    try:
        with output_root(run):  # every name written under RUN is checked for links (core/io.py)
            yield
    finally:
        path.unlink(missing_ok=True)  # while still holding it: a waiting opener re-checks the inode
        os.close(fd)
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
    fd = _lock(path, out, shown=out)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def one_writer(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` run holding `locked_output` of its `out` argument, for its whole call."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> T:
        with locked_output(signature.bind(*args, **kwargs).arguments["out"]):
            return fn(*args, **kwargs)
    return call


def _lock(path: Path, run: Path, shown: Path | None = None) -> int:
    while True:
        with naming(shown or path), writing(shown or path):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # a planted link: ELOOP
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise UserError(f"{run} is in use by process {holder} (wait for it to finish, or stop it)") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # its holder removed it between our open and our lock: take the new one
            os.close(fd)
            continue
        try:
            with writing(shown or path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:  # a full disk: the lock this call made is not left behind
            path.unlink(missing_ok=True)
            os.close(fd)
            raise
        return fd
