"""Files in and out. Writes are atomic: nothing half-written, ever (a temporary sibling, then a
rename). Reads name the file in their one-line error.

A temporary is named `.NAME.tmp-PID-CHECK...` next to NAME (core/temporary.py). A run killed
outright (SIGKILL, power loss) cannot remove its own, so the next write of NAME removes those whose
process is gone (only names whose check holds: a user's look-alike is left alone); SIGTERM during a
write removes its own before the process exits (core/signals.py). Every output gets
the mode a plain create gives (0666 minus the umask), whichever library wrote it.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError
from dtpshard.core.reading import (  # noqa: F401 (reading lives there; callers import it from here too)
    ANY_SIZE,
    INT_LIMIT,
    MAX_DEPTH,
    SMALL_JSON,
    STUDY_BYTES,
    check_keys,
    check_regular,
    check_tree,
    load_yaml,
    loads,
    open_regular,
    open_safetensors,
    read_bytes,
    read_json,
    read_json_object,
    read_options,
    read_text,
)
from dtpshard.core.rename import publish_new, publish_over
from dtpshard.core.signals import exit_on_sigterm
from dtpshard.core.temporary import temporary_name, temporary_of

_FULL_BYTES = 1 << 20  # a failed write with less than this free on its file system ran out of space


def _tmp_sibling(path: Path, suffix: str = "") -> Path:
    return path.with_name(temporary_name(path.name, suffix))


PID_MAX = 1 << 22  # Linux's largest pid_max: a larger number in a file name is no process's


def pid_alive(pid: int) -> bool:
    """Whether process `pid` may be running (a zombie is not). A number no process can have (a
    name planted by hand) counts as running: what it names is left alone, never removed."""
    if not 0 < pid <= PID_MAX:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:  # a dead child its parent has not reaped yet still answers kill(0)
        stat = read_text(f"/proc/{pid}/stat", 4096, "a process's status")
    except (OSError, UserError):
        return True
    return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"])


_ROOTS: list[Path] = []  # the output directories this process writes (core/lock.py registers them)


@contextlib.contextmanager
def output_root(d: Path) -> Iterator[None]:
    """While inside: every name written under `d` is checked for symbolic links from `d` down."""
    d = Path(os.path.abspath(d))
    _ROOTS.append(d)
    try:
        yield
    finally:
        _ROOTS.remove(d)


def refuse_links(path: str | Path) -> None:
    """A name a command writes, locks or appends to is never reached through a symbolic link: not
    the name itself, nor a directory on the way to it inside the output directory (a registered
    `output_root`, itself included; elsewhere the name's own directory). One line naming it."""
    path = Path(os.path.abspath(path))
    inside = [r for r in _ROOTS if r == path or r in path.parents]
    stop = max(inside, key=lambda r: len(r.parts)) if inside else path.parent
    for p in (path, *path.parents):
        if p.is_symlink():
            raise UserError(f"{p}: is a symbolic link (to {os.readlink(p)}); dtpshard never writes through one "
                            f"(it would write someone else's files): give the real path, or remove the link")
        if p == stop:
            return


def append_bytes(path: str | Path, data: bytes) -> None:
    """Append `data` to `path` (created if missing), fsync'ed: the one write through a name, so never
    through a symbolic link (`refuse_links`, O_NOFOLLOW), a hard link (the other name's file would be
    written too) or anything but a regular file; one line naming it."""
    path = Path(path)
    refuse_links(path)
    with writing(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o666)
        try:
            st, what = os.fstat(fd), "a file with more than one name (a hard link)"
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                what = what if stat.S_ISREG(st.st_mode) else "not a regular file"
                raise UserError(f"{path}: is {what}; dtpshard never writes through one (it would write the "
                                "other name's file too): move it away, or choose another --out")
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporaries of earlier writes of `path` whose process no longer exists: only
    names core/temporary.py recognises as dtpshard's (their check holds), owned by this user."""
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        found = temporary_of(p.name)
        if found is None or found[0] != path.name or found[1] == os.getpid() or pid_alive(found[1]):
            continue  # not ours, or its writer still runs
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if st.st_uid != os.geteuid():
            continue
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


def share(path: Path, mode: int) -> None:
    """Give `path` the permissions a plain create would (mode minus the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def check_writable_dir(path: Path, create: bool = True) -> None:
    """The parent of `path` exists (created if missing; with create=False the nearest existing
    ancestor is checked instead, and nothing is left behind) and a file can be created in it;
    else one line. Call it before an expensive pass whose result goes to `path`."""
    path = Path(path)
    refuse_links(path)
    parent = path.parent if str(path.parent) else Path(".")
    blocker = next((p for p in [parent, *parent.parents] if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise UserError(f"cannot write {path}: {blocker} is a file, not a directory")
    if not create and blocker is not None and blocker != parent:
        parent = blocker
    probe = parent / temporary_name(path.name, "-probe")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(e.errno, os.strerror(e.errno), str(path)) from None
        raise UserError(f"cannot create directory {parent} for {path.name}: {(e.strerror or str(e)).lower()}") from None
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        probe.unlink()
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(e.errno, os.strerror(e.errno), str(path)) from None
        raise UserError(f"cannot write {path}: directory {parent} is not writable "
                        f"({(e.strerror or str(e)).lower()})") from None


def check_output_file(path: Path, flag: str = "--out") -> None:
    """`path` can be written as a file: not an existing directory, its directory writable."""
    if Path(path).is_dir():
        raise UserError(f"{flag} {path} is a directory; give the path of the file to write")
    check_writable_dir(Path(path), create=False)


def _disk_full(exc: BaseException, where: Path) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    if "No space left" in text or "os error 28" in text:  # safetensors, torch: the OS error in words
        return True
    try:
        st = os.statvfs(where)
    except OSError:
        return False
    return isinstance(exc, (OSError, RuntimeError)) and st.f_bavail * st.f_frsize < _FULL_BYTES


def _size_limited(exc: BaseException) -> bool:
    """A library's failed write (torch's "file write failed" or "iostream error", no errno) under a finite
    `ulimit -f`: the limit is what stopped it."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    words = ("write failed", "iostream error", "inline_container")  # torch's zip writer, by version and place
    return isinstance(exc, RuntimeError) and any(w in str(exc) for w in words) and limit != resource.RLIM_INFINITY


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """A write to `path` that fails for lack of space (whatever library did it) raises
    OSError(ENOSPC) naming `path`; other OS errors get `path` if they name no file."""
    path = Path(path)
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or (e.errno is not None and e.filename is None):
            raise OSError(e.errno, os.strerror(e.errno), str(path)) from e
        raise
    except Exception as e:  # torch and safetensors report a full disk as their own errors
        where = path if path.is_dir() else path.parent
        if _disk_full(e, where if str(where) else Path(".")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e
        if "File too large" in str(e) or "os error 27" in str(e) or _size_limited(e):  # EFBIG: past `ulimit -f`
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG), str(path)) from e
        raise


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file path next to `path`; rename it over `path` on success. A `path`
    that did not exist when the write began is published only if it still does not (another
    writer's result is never replaced: rename.Occupied); one that existed is replaced."""
    path = Path(path)
    check_writable_dir(path)
    remove_stale_temporaries(path)
    tmp = _tmp_sibling(path)
    existed = os.path.lexists(path)
    with exit_on_sigterm():
        try:
            with writing(path):
                yield tmp
                share(tmp, 0o666)  # one mode for every output (safetensors would leave 0600)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, path) if existed else publish_new(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def atomic_dir(path: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory; on success it becomes `path`. An existing `path` is refused
    unless force, and then swapped out atomically; a `path` another writer created meanwhile is
    never replaced (rename.Occupied, this result discarded)."""
    path = Path(path)
    existed = os.path.lexists(path)
    if existed and not force:
        raise UserError(f"output {path} exists (use --force to replace it)")
    check_writable_dir(path)
    remove_stale_temporaries(path)
    parent = path.parent if str(path.parent) else Path(".")
    with exit_on_sigterm():
        tmp = Path(tempfile.mkdtemp(prefix=temporary_name(path.name, "-"), dir=parent))
        try:
            with writing(path):
                share(tmp, 0o777)  # mkdtemp's 0700 would hide the output from other users
                yield tmp
                publish_over(tmp, path) if existed else publish_new(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def copy_regular(src: str | Path, dst: str | Path, cap: int = ANY_SIZE, what: str = "file",
                 where: str | None = None) -> None:
    """Copy regular file `src` (at most `cap` bytes, read as `open_regular` reads) to a new `dst`,
    with its permission bits and times, as shutil.copy2 would (which would wait on a FIFO)."""
    with open_regular(src, cap, what, where) as fin, writing(dst), open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 24)
    shutil.copystat(src, dst)


SHORT_HASH = 16  # hex digits of a content id (a layout's, a data set's, a teacher cache's inputs)


def short_sha256(data: bytes | Any) -> str:
    """A content id: the first SHORT_HASH hex digits of SHA-256 of `data` (or of a hashlib object)."""
    return (hashlib.sha256(data) if isinstance(data, bytes) else data).hexdigest()[:SHORT_HASH]


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a regular file's bytes, read in chunks (hashlib.file_digest)."""
    with open_regular(path, ANY_SIZE) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_hashes(paths: list[Path]) -> dict[str, str]:
    """The weight-hash helper: {file name: SHA-256} of each file (a model card's, a study's provenance)."""
    return {Path(p).name: file_sha256(p) for p in paths}


def files_id(paths: list[Path]) -> str:
    """One content id of several files: their names and bytes, in name order (a teacher cache's
    record of the teacher and tokenizer it was made from)."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode() + b"\0")
        with open_regular(p, ANY_SIZE) as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return short_sha256(h)


# -- writing JSON: strict, every non-number a null ------------------------------------------------
def finite(obj: Any) -> Any:
    """`obj` with every NaN or infinity (float or numpy scalar) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if hasattr(obj, "item") and hasattr(obj, "dtype") and getattr(obj, "ndim", 1) == 0:  # numpy/torch scalar
        return finite(obj.item())
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """The one JSON encoder of every file and --json line we write: strict JSON (RFC 8259), a
    value that is not a finite number written as null (json.dumps would write bare NaN)."""
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except (ValueError, TypeError):  # a NaN, an infinity or a numpy scalar somewhere: the slow path
        return json.dumps(finite(obj), allow_nan=False, **kw)
