"""Which output directories are dtpshard's, and the only files in them it ever removes.

A directory is dtpshard's only if dtpshard marked it when it made it: MARK names the command and
a random id, and the command's own record in the directory (a run's config.json, convert.json,
an experiment's config.json, a teacher cache's plan.json) holds the same id under ID. The mark is
bound to the directory it marks and to itself: it holds the identity of both (core/identity.py:
inode number, birth time, generation number), so a mark copied (with its record) into another
folder proves nothing there, even into a folder made anew with a deleted one's inode number; a
directory moved within its file system keeps both. Either file alone proves nothing either: a
copied-in config.json has no mark, and a forged mark no record that agrees with it.

A directory written whole and then published (a student, a run's adapters, a permuted
checkpoint) is *sealed* instead: its mark lists every file written into it, by relative path.

`--force` (and a resume) then touches only the names the command writes, and only inside a
directory that is its own, at every depth: a subdirectory is removed only when every entry
inside it, however deep, is one the command wrote there (`Inside`, one check per kind of
subdirectory). Anything else, a symbolic link anywhere, or a directory marked by another command,
is refused in one line naming the first such file, before anything is removed.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError
from dtpshard.core.identity import binds, identity, same
from dtpshard.core.io import atomic_dir, dumps, read_json_object, writing
from dtpshard.core.lock import is_lock
from dtpshard.core.temporary import temporary_name, temporary_of

MARK = "dtpshard-dir.json"  # {"made_by": "dtpshard", "command", "id", "dir", "self"[, "names"]}
ID = "dir_id"  # the key under which a command's record holds its directory's id
_KEYS = {"made_by", "command", "id", "dir", "self", "names", "ino", "born"}  # ino, born: older marks
MAX_NAMES = 1 << 16  # files a sealed directory lists (a student has tens)

# The first entry under a directory that the command did not write there (None: all of it is its
# own); given the directory, which exists and is no symbolic link.
Inside = Callable[[Path], "Path | None"]


def raw_mark(d: Path) -> dict[str, Any] | None:
    """d's mark as data (any command's, bound or not: a copy too), or None."""
    path = Path(d) / MARK
    if path.is_symlink() or not path.is_file():
        return None
    try:
        mark = read_json_object(path, "directory mark", keys=_KEYS, max_bytes=1 << 24)
    except (UserError, OSError):
        return None
    return mark if mark.get("made_by") == "dtpshard" else None


def _bound(mark: dict[str, Any], d: Path) -> bool:
    """Whether `mark` was written into d itself (not copied there from another directory): d and
    the mark file are the very inodes it names (core/identity.py: a folder made anew after d was
    deleted may get d's inode numbers at once, never its birth time or generation number). A mark
    on a file system that keeps neither binds nothing: its directory is not taken as dtpshard's."""
    return same(mark.get("dir"), Path(d)) and same(mark.get("self"), Path(d) / MARK)


def read_mark(d: Path, command: str) -> dict[str, Any] | None:
    """d's mark if `command` made d (a regular file that parses as one, bound to d), else None."""
    mark = raw_mark(d)
    ok = mark is not None and mark.get("command") == command and isinstance(mark.get("id"), str)
    return mark if ok and mark["id"] and _bound(mark, d) else None


def other_command(d: Path, command: str) -> str | None:
    """The command whose mark d carries when that is not `command` (a directory of another
    command is never taken, cleared or written into by this one), else None."""
    mark = raw_mark(d)
    other = mark.get("command") if mark is not None else None
    return other if isinstance(other, str) and other != command else None


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
    tmp = d / temporary_name(MARK)
    with writing(tmp):  # replaced whole, by rename: a stale mark is the command's own to replace
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # this process's own temporary (its name's check holds for this pid)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:  # the file's own inode goes inside it: a rename keeps it, a copy does not
            data = {"made_by": "dtpshard", "command": command, "id": new, "dir": identity(d),
                    "self": identity(fd)}
            if names is not None:
                data["names"] = sorted(names)
            os.write(fd, (dumps(data) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, d / MARK)
    return new


def files_under(d: Path) -> list[str]:
    """Every file under d, by path relative to d ('/'-separated), the mark left out."""
    out = []
    for root, _, files in os.walk(d):
        rel = Path(root).relative_to(d)
        out += [(rel / f).as_posix() for f in files if not (root == str(d) and f == MARK)]
    return sorted(out)


def seal(d: Path, command: str) -> None:
    """Mark a directory written whole with the list of what is in it (before it is published)."""
    mark(d, command, files_under(d))


def sealed(command: str) -> Inside:
    """The check of a directory `command` sealed: every file in it is one its mark lists."""
    def inside(d: Path) -> Path | None:
        mark = read_mark(d, command)
        names = mark.get("names") if mark is not None else None
        if not isinstance(names, list) or len(names) > MAX_NAMES:
            return d / MARK if os.path.lexists(d / MARK) else d
        return stray(d, {str(n) for n in names})
    return inside


def stray(d: Path, files: set[str]) -> Path | None:
    """The first entry under d (any depth, the mark aside) that is not one of `files` (relative
    paths of regular files) or a directory on the way to one; a symbolic link always is."""
    dirs = {p.as_posix() for f in files for p in Path(f).parents if p != Path(".")}
    for root, subdirs, names in os.walk(d):
        rel = Path(root).relative_to(d)
        for n in sorted(subdirs + names):
            p, key = Path(root) / n, (rel / n).as_posix()
            if root == str(d) and n == MARK and p.is_file() and not p.is_symlink():
                continue
            mode = os.lstat(p).st_mode
            if stat.S_ISDIR(mode) and key in dirs or stat.S_ISREG(mode) and key in files:
                continue
            return p
    return None


def is_leftover(name: str, names: Iterable[str]) -> bool:
    """A kill's leftover of an atomic write of one of `names`: a name core/temporary.py recognises."""
    found = temporary_of(name)
    return found is not None and found[0] in set(names)


def own_entries(command: str, record: str, names: Iterable[str],
                inside: dict[str, Inside] | None = None, extra: Iterable[str] = ()) -> Inside:
    """The check of a whole directory of `command` (recorded in `record`) as a subdirectory of
    another's (an experiment's runs, convert's run): every entry is one of `names` (a file, or a
    directory that `inside` checks), `extra` (the lock, when dtpshard made it) or a leftover; d is the
    command's own."""
    def check(p: Path) -> Path | None:
        if not is_ours(p, command, record):
            return p / MARK if os.path.lexists(p / MARK) else p
        allowed = set(names)
        for e in sorted(p.iterdir()):
            if e.name == MARK and not e.is_symlink() or e.name in extra and is_lock(e) or is_leftover(e.name, allowed):
                continue
            if e.name not in allowed:
                return e
            first = _first_not_own(e, (inside or {}).get(e.name))
            if first is not None:
                return first
        return None
    return check


def _first_not_own(p: Path, inside: Inside | None) -> Path | None:
    """p itself when it is not what the command writes at its name (a symbolic link, a directory
    where a file goes, anything but a regular file or a directory), else the first foreign entry
    under it."""
    mode = os.lstat(p).st_mode
    if stat.S_ISREG(mode) and inside is None:
        return None
    if not stat.S_ISDIR(mode) or inside is None:
        return p
    try:
        return inside(p)
    except (OSError, UserError):  # what cannot be read as the command's own output is not its own
        return p


def every(entry: Inside) -> Inside:
    """A directory each of whose entries `entry` checks."""
    def check(d: Path) -> Path | None:
        for p in sorted(d.iterdir()):
            first = entry(p) if not p.is_symlink() else p
            if first is not None:
                return first
        return None
    return check


def present(d: Path, names: Iterable[str]) -> list[str]:
    """The `names` that exist in d (a dangling link too), in their given order."""
    return [n for n in names if os.path.lexists(Path(d) / n)]


def refuse(path: Path, why: str, flag: str = "--out") -> UserError:
    kind = "directory" if path.is_dir() and not path.is_symlink() else "file"
    return UserError(f"{path}: is not a {kind} dtpshard made ({why}); nothing was removed (move it away, or "
                     f"choose another {flag})")


def refuse_link(p: Path, flag: str = "--out") -> UserError:
    return UserError(f"{p}: is a symbolic link (to {os.readlink(p)}), which dtpshard did not make and never "
                     f"follows or replaces; nothing was removed or written (remove or move it yourself, or choose "
                     f"another {flag})")


def refuse_linked(d: Path, names: Iterable[str], flag: str = "--out") -> None:
    """Before any work: none of the names a command writes, resumes or removes in d is a symbolic
    link (a resume would write through it, a start-over remove it)."""
    for n in present(d, names):
        if (Path(d) / n).is_symlink():
            raise refuse_link(Path(d) / n, flag)


def refuse_other(d: Path, command: str, flag: str = "--out") -> None:
    """A directory another dtpshard command marked is never this one's."""
    other = other_command(d, command)
    if other is not None:
        raise UserError(f"{flag} {d}: is a dtpshard {other} directory, not a dtpshard {command} directory; nothing "
                        f"was touched (choose another {flag})")


def check_removable(d: Path, names: Iterable[str], ours: bool, inside: dict[str, Inside] | None = None,
                    flag: str = "--out") -> list[str]:
    """The names of d that a start-over would remove, refused by name before anything is: a symbolic
    link (it points at someone else's files), any of them in a directory that is not the
    command's (`ours`), a file where the command writes a directory or the reverse, or anything
    under a subdirectory that its check in `inside` does not find the command's own."""
    names = present(d, names)
    for n in names:
        if (Path(d) / n).is_symlink():
            raise refuse_link(Path(d) / n, flag)
    if names and not ours:
        raise refuse(Path(d) / names[0], f"{Path(d)} carries no {MARK} that its record agrees with", flag)
    for n in names:
        first = _first_not_own(Path(d) / n, (inside or {}).get(n))
        if first is not None:
            raise refuse(first, "it is not what the command writes there", flag)
    return names


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
          inside: dict[str, Inside] | None = None, flag: str = "--out") -> str:
    """The id of d as `command`'s output directory, for its record. d holding none of `names`, or
    with force: its `names` removed (only where it is the command's own, `check_removable`) and
    d marked anew. Without force, d holding some of them is resumed only if it is the command's
    own; else refused naming the first. A directory another command marked, or one whose mark is
    not bound to it (copied in), is refused either way."""
    d = Path(d)
    if d.is_dir():
        refuse_other(d, command, flag)
    ours = d.is_dir() and is_ours(d, command, record)
    if d.is_dir() and not ours and os.path.lexists(d / MARK):
        held = raw_mark(d)
        why = ("its file system keeps neither birth times nor generation numbers, so nothing shows the folder is "
               "the one dtpshard made" if held is not None and not binds(held.get("dir")) else "copied from elsewhere?")
        raise refuse(d / MARK, f"it is not the mark dtpshard {command} wrote in {d} ({why})", flag)
    found = present(d, names) if d.is_dir() else []
    refuse_linked(d, found, flag)
    if found and not force:
        if ours:
            return read_mark(d, command)["id"]
        raise UserError(f"{d / found[0]}: was not written by dtpshard {command} ({d} carries no {MARK} that its "
                        f"record agrees with); nothing was touched (move it away, or choose another {flag})")
    remove(d, check_removable(d, names, ours, inside, flag))
    return mark(d, command)


@contextmanager
def replacing(path: Path, command: str, flag: str = "--out") -> Iterator[Path]:
    """A directory written whole (io.atomic_dir) and sealed for `command`; one already at `path`
    is replaced only when it is a directory `command` sealed and holds nothing else."""
    path = Path(path)
    if os.path.lexists(path):
        first = _first_not_own(path, sealed(command))
        if first is not None:
            raise refuse(first, f"it is not what dtpshard {command} wrote in {path}", flag)
    with atomic_dir(path, force=True) as tmp:
        yield tmp
        seal(tmp, command)
