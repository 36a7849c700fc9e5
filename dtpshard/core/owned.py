"""Which output directories are dtpshard's, and the only files in them it ever removes.

A directory is dtpshard's only if dtpshard marked it when it made it: MARK names the command and
a random id, and the command's own record in the directory (a run's config.json, convert.json,
an experiment's config.json, a teacher cache's plan.json) holds the same id under ID. Either
file alone proves nothing: a copied-in config.json has no mark, and a forged mark no record that
agrees with it. (`permute`, whose output is swapped in whole, has no record beside its weights:
its mark lists the names it wrote instead.)

`--force` (and a resume) then touches only the names the command writes, and only inside a
directory that is its own; anywhere else it is refused in one line naming the first file it
would have removed, before anything is. Files the command does not write are never touched.
"""
from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError
from dtpshard.core.io import dumps, read_json_object, writing

MARK = "dtpshard-dir.json"  # {"made_by": "dtpshard", "command", "id"[, "names"]}
ID = "dir_id"  # the key under which a command's record holds its directory's id
_KEYS = {"made_by", "command", "id", "names"}


def read_mark(d: Path, command: str) -> dict[str, Any] | None:
    """d's mark if `command` made it (a regular file that parses as one), else None."""
    path = Path(d) / MARK
    if path.is_symlink() or not path.is_file():
        return None
    try:
        mark = read_json_object(path, "directory mark", keys=_KEYS)
    except (UserError, OSError):
        return None
    ok = mark.get("made_by") == "dtpshard" and mark.get("command") == command and isinstance(mark.get("id"), str)
    return mark if ok and mark["id"] else None


def record_id(record: Path) -> str | None:
    """The directory id a command's record holds (None: no record, not ours, or unreadable)."""
    try:
        data = read_json_object(record, "record", max_bytes=1 << 26) if Path(record).is_file() else {}
    except (UserError, OSError):
        return None
    value = data.get(ID)
    return value if isinstance(value, str) and value else None


def is_ours(d: Path, command: str, record: str) -> bool:
    """Whether `command` marked d when it made it and d/record agrees (the same id)."""
    mark = read_mark(d, command)
    return mark is not None and record_id(Path(d) / record) == mark["id"]


def mark(d: Path, command: str, names: Iterable[str] | None = None) -> str:
    """Mark directory d (created if missing) as `command`'s with a new id, returned for its record."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    new = uuid.uuid4().hex
    data = {"made_by": "dtpshard", "command": command, "id": new}
    if names is not None:
        data["names"] = sorted(names)
    tmp = d / f".{MARK}.tmp-{os.getpid()}"
    with writing(tmp):  # replaced whole, by rename: a stale mark is the command's own to replace
        tmp.write_text(dumps(data) + "\n", encoding="utf-8")
        os.replace(tmp, d / MARK)
    return new


def present(d: Path, names: Iterable[str]) -> list[str]:
    """The `names` that exist in d (a dangling link too), in their given order."""
    return [n for n in names if os.path.lexists(Path(d) / n)]


def refuse(path: Path, why: str, flag: str = "--out") -> UserError:
    kind = "directory" if path.is_dir() and not path.is_symlink() else "file"
    return UserError(f"{path}: is not a {kind} dtpshard made ({why}); nothing was removed (move it away, or "
                     f"choose another {flag})")


def check_removable(d: Path, names: Iterable[str], ours: bool,
                    marks: dict[str, Callable[[Path], bool]] | None = None, flag: str = "--out") -> list[str]:
    """The names of d that a start-over would remove, refused by name before anything is: a symbolic
    link (it points at someone else's files), any of them in a directory that is not the
    command's (`ours`), or a subdirectory without what `marks[name]` looks for."""
    names = present(d, names)
    for n in names:
        p = Path(d) / n
        if p.is_symlink():
            raise UserError(f"{p}: is a symbolic link (to {os.readlink(p)}), which dtpshard did not make; nothing "
                            f"was removed (remove or move it yourself, or choose another {flag})")
    if names and not ours:
        raise refuse(Path(d) / names[0], f"{Path(d)} carries no {MARK} that its record agrees with", flag)
    for n in names:
        p = Path(d) / n
        check = (marks or {}).get(n)
        if p.is_dir() and check is not None and not _holds(check, p):
            raise refuse(p, "its contents are not what the command writes there", flag)
    return names


def _holds(check: Callable[[Path], bool], p: Path) -> bool:
    try:
        return bool(check(p))
    except Exception:  # what cannot be read as the command's own output is not its own
        return False


def remove(d: Path, names: Iterable[str]) -> None:
    """Remove d's `names` (checked by `check_removable` first)."""
    for n in names:
        p = Path(d) / n
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif os.path.lexists(p):
            p.unlink()


def foreign(d: Path, names: Iterable[str]) -> list[str]:
    """d's entries that are not among `names` (nor the mark), sorted."""
    allowed = set(names) | {MARK}
    return sorted(p.name for p in Path(d).iterdir() if p.name not in allowed)


def claim(d: Path, command: str, names: tuple[str, ...], record: str, force: bool,
          marks: dict[str, Callable[[Path], bool]] | None = None, flag: str = "--out") -> str:
    """The id of d as `command`'s output directory, for its record. d holding none of `names`, or
    with force: its `names` removed (only where it is the command's own, `check_removable`) and
    d marked anew. Without force, d holding some of them is resumed only if it is the command's
    own; else refused naming the first."""
    d = Path(d)
    ours = d.is_dir() and is_ours(d, command, record)
    found = present(d, names) if d.is_dir() else []
    if found and not force:
        if ours:
            return read_mark(d, command)["id"]
        raise UserError(f"{d / found[0]}: was not written by dtpshard {command} ({d} carries no {MARK} that its "
                        f"record agrees with); nothing was touched (move it away, or choose another {flag})")
    remove(d, check_removable(d, names, ours, marks, flag))
    return mark(d, command)
