"""Atomic writes: nothing half-written, ever. Write to a temporary sibling, then rename."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from dtpshard.core.errors import UserError


def _tmp_sibling(path: Path, suffix: str = "") -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}{suffix}")


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
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent if str(path.parent) else "."))
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
