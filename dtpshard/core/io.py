"""Files in and out. Writes are atomic: nothing half-written, ever (a temporary sibling, then a
rename). Reads name the file in their one-line error.

A temporary is named `.NAME.tmp-PID...` next to NAME. A run killed outright (SIGKILL, power loss)
cannot remove its own, so the next write of NAME removes those whose process is gone; SIGTERM
during a write removes its own before the process exits (`exit_on_sigterm`). Every output gets
the mode a plain create gives (0666 minus the umask), whichever library wrote it.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

from dtpshard.core.errors import UserError, naming

_FULL_BYTES = 1 << 20  # a failed write with less than this free on its file system ran out of space


def _tmp_sibling(path: Path, suffix: str = "") -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}{suffix}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporaries of earlier writes of `path` whose process no longer exists."""
    parent = path.parent if str(path.parent) else Path(".")
    prefix = f".{path.name}.tmp-"
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        pid = p.name[len(prefix):].split("-")[0].split(".")[0] if p.name.startswith(prefix) else ""
        if not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue  # not ours, or its writer still runs
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """Inside this block SIGTERM raises SystemExit(143), so `finally` clauses (removing a
    temporary) run; Python's default for SIGTERM is to die on the spot."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:  # only the main thread may set handlers
        yield
        return

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
    parent = path.parent if str(path.parent) else Path(".")
    blocker = next((p for p in [parent, *parent.parents] if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise UserError(f"cannot write {path}: {blocker} is a file, not a directory")
    if not create and blocker is not None and blocker != parent:
        parent = blocker
    probe = parent / f".{path.name}.tmp-{os.getpid()}-probe"
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


def refuse_overwriting(out: Path, flag: str = "--out", **inputs: "Path | list[Path] | None") -> None:
    """An output must never replace what the command reads: refuse when `out` is one of the
    inputs (a file, or a model/teacher directory), naming which. `inputs` maps a description
    (underscores for spaces) to a path or a list of paths."""
    target = Path(out).resolve()
    for what, paths in inputs.items():
        for p in paths if isinstance(paths, list) else [paths]:
            if p is not None and Path(p).resolve() == target:
                raise UserError(f"{flag} {out} is {what.replace('_', ' ')} {p}, an input of this command "
                                "(write elsewhere)")


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


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """A write to `path` that fails for lack of space (whatever library did it) raises
    OSError(ENOSPC) naming `path`; other OS errors get `path` if they name no file."""
    path = Path(path)
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT) or (e.errno is not None and e.filename is None):
            raise OSError(e.errno, os.strerror(e.errno), str(path)) from e
        raise
    except Exception as e:  # noqa: BLE001 - torch and safetensors report a full disk as their own errors
        where = path if path.is_dir() else path.parent
        if _disk_full(e, where if str(where) else Path(".")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e
        raise


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file path next to `path`; rename it over `path` on success."""
    path = Path(path)
    check_writable_dir(path)
    remove_stale_temporaries(path)
    tmp = _tmp_sibling(path)
    with exit_on_sigterm():
        try:
            with writing(path):
                yield tmp
                share(tmp, 0o666)  # one mode for every output (safetensors would leave 0600)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def atomic_dir(path: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces `path` (refused if it exists unless force)."""
    path = Path(path)
    if path.exists() and not force:
        raise UserError(f"output {path} exists (use --force to replace it)")
    check_writable_dir(path)
    remove_stale_temporaries(path)
    parent = path.parent if str(path.parent) else Path(".")
    with exit_on_sigterm():
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=parent))
        try:
            with writing(path):
                share(tmp, 0o777)  # mkdtemp's 0700 would hide the output from other users
                yield tmp
                if path.exists():
                    old = _tmp_sibling(path, ".old")
                    os.replace(path, old)
                    os.replace(tmp, path)
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    os.replace(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, read in chunks (hashlib.file_digest)."""
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cache_dir() -> Path:
    """dtpshard's one cache folder (the parsed offline corpus, the dequantised demo model):
    $DTPSHARD_CACHE, else $XDG_CACHE_HOME/dtpshard, else ~/.cache/dtpshard."""
    if os.environ.get("DTPSHARD_CACHE"):
        return Path(os.environ["DTPSHARD_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dtpshard"


# -- reading ---------------------------------------------------------------------------------------
def read_text(path: str | Path, what: str = "file") -> str:
    """The UTF-8 text of `path`; a missing, unreadable or non-UTF-8 file is one line naming it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} not found: {path}" if not path.exists() else f"{what} {path} is not a file")
    with naming(path):
        return path.read_text(encoding="utf-8")


def read_json(path: str | Path, what: str = "file") -> Any:
    """The JSON value in `path`; errors as in `read_text`, malformed JSON named with its line."""
    text = read_text(path, what)
    with naming(path):
        return json.loads(text)


def read_json_object(path: str | Path, what: str = "file") -> dict[str, Any]:
    obj = read_json(path, what)
    if not isinstance(obj, dict):
        raise UserError(f"{path}: expected a JSON object ({what}), found {type(obj).__name__}")
    return obj
