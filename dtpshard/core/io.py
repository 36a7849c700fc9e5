"""Atomic writes: nothing half-written, ever. Write to a temporary sibling, then rename.

Temporaries are named `.NAME.tmp-PID...`: a run killed outright (SIGKILL, power loss) cannot remove
its own, so the next write of NAME removes those whose process is gone. `exit_on_sigterm` lets a
terminated run remove its temporary itself."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Iterator

from dtpshard.core.errors import UserError


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
    import threading

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
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


def check_writable_dir(path: Path) -> None:
    """The parent of `path` exists (created if missing) and can be written; else one line."""
    parent = path.parent if str(path.parent) else Path(".")
    blocker = next((p for p in [parent, *parent.parents] if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise UserError(f"cannot write {path}: {blocker} is a file, not a directory")
    if not parent.exists():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create directory {parent}: {e.strerror}") from None
    if not os.access(parent, os.W_OK):
        raise UserError(f"output directory {parent} is not writable")


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file path next to `path`; rename it over `path` on success."""
    path = Path(path)
    check_writable_dir(path)
    remove_stale_temporaries(path)
    tmp = _tmp_sibling(path)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def atomic_dir(path: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces `path` (refused if it exists unless force)."""
    path = Path(path)
    if path.exists() and not force:
        raise UserError(f"output {path} exists (use --force to replace it)")
    check_writable_dir(path)
    remove_stale_temporaries(path)
    parent = path.parent if str(path.parent) else Path(".")
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=parent))
    share(tmp, 0o777)  # mkdtemp's 0700 would hide the output from other users
    try:
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


def cache_dir() -> Path:
    """dtpshard's one cache folder (the parsed offline corpus, the dequantised demo model):
    $DTPSHARD_CACHE, else $XDG_CACHE_HOME/dtpshard, else ~/.cache/dtpshard."""
    if os.environ.get("DTPSHARD_CACHE"):
        return Path(os.environ["DTPSHARD_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dtpshard"
