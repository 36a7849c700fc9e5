"""An output never touches an input: the one check every command that writes makes, before any work.

The rule, for every output O (a file or directory the command creates or replaces) and every
input I (a file or directory it reads), each taken as it exists on disk:

    refused when O is I, O lies inside I, or O contains I

with or without --force. "Is", "inside" and "contains" are decided twice, and either refuses:
on the paths with every symlink followed (os.path.realpath), and on the file system's identity of
the paths and their existing ancestors ((st_dev, st_ino): a hard link, a bind mount or a second
name of the same directory is the same place). An input directory stands for itself and for
where the symlinks inside it lead (a hub snapshot's files are links into its blobs/); an existing
output directory also for where its symlinks lead (writing through one would write there).

What an output may replace is the command's own business (`check_replaceable`): --force, or a
file output's plain replacement, replaces only something the same command made.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from dtpshard.core.errors import UserError

Paths = str | os.PathLike | Sequence[str | os.PathLike | None] | None
_WALK_LIMIT = 20000  # entries looked at under one directory (a corpus directory may be large)


def _identity(p: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(p)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _chain(p: Path) -> set[tuple[int, int]]:
    """The identities of `p`'s existing ancestors (not `p` itself)."""
    return {i for a in Path(os.path.abspath(p)).parents if (i := _identity(a)) is not None}


def _links(root: Path) -> list[Path]:
    """Where the symlinks under directory `root` lead (not followed further)."""
    out, seen = [], 0
    for here, dirs, files in os.walk(root):
        for name in dirs + files:
            seen += 1
            p = Path(here, name)
            if p.is_symlink():
                out.append(Path(os.path.realpath(p)))
        if seen > _WALK_LIMIT:
            break
    return out


def _under(a: Path, b: Path) -> bool:
    """Path a lies strictly inside path b (both resolved)."""
    return a != b and a.is_relative_to(b)


def _places(p: Path) -> list[Path]:
    """p resolved, then where the symlinks inside it lead when it is a directory."""
    real = Path(os.path.realpath(p))
    return [real] + (_links(real) if real.is_dir() else [])


def _relation(out: Path, inp: Path) -> str | None:
    """How output `out` touches input `inp` ('is', 'is inside', 'contains', 'holds a symlink
    into'), or None."""
    oid, iid = _identity(out), _identity(inp)
    (real, *out_links), ins = _places(out), _places(inp)
    if oid is not None and oid == iid or real in ins:
        return "is"
    if iid is not None and iid in _chain(out) or any(_under(real, i) for i in ins):
        return "is inside"
    if oid is not None and oid in _chain(inp) or any(_under(i, real) for i in ins):
        return "contains"
    if any(t == i or _under(t, i) or _under(i, t) for t in out_links for i in ins):
        return "holds a symlink into"
    return None


def _paths(value: Paths) -> list[Path]:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [Path(value)]
    return [Path(v) for v in value if v is not None]


def check_outputs(outputs: Mapping[str, Paths], inputs: Mapping[str, Paths]) -> None:
    """Refuse, in one line naming both, any output that is, lies inside or contains an input.
    outputs: flag (`--out`, `--tensorboard`) -> path(s); inputs: what it is, in words (`the model
    directory`) -> path(s). None values are skipped."""
    for flag, out_value in outputs.items():
        for out in _paths(out_value):
            for what, in_value in inputs.items():
                for inp in _paths(in_value):
                    how = _relation(out, inp)
                    if how is None:
                        continue
                    real = os.path.realpath(out)
                    via = f" (it resolves to {real})" if real != os.path.abspath(out) else ""
                    raise UserError(f"{flag} {out}{via} {how} {what} {inp}, an input of this command "
                                    "(write elsewhere)")


def local_paths(values: Iterable[str | os.PathLike | None]) -> list[Path]:
    """The given names that are paths on this machine (a --dataset may be a hub name instead)."""
    return [Path(v) for v in values if v is not None and Path(v).exists()]


def check_replaceable(out: Path, own: Callable[[Path], bool], what: str, *, force: bool | None = None,
                      flag: str = "--out") -> bool:
    """Whether `out` exists and may be replaced: refused unless it is `what` (own(out): a file or
    directory this command made). force=None: a file output with no --force flag, replaced
    whenever it is the command's own; otherwise an existing `out` also needs force."""
    out = Path(out)
    if not os.path.lexists(out):
        return False
    if out.is_symlink():  # replacing it would replace the link, never what it points at: neither is ours
        raise UserError(f"{flag} {out}: is a symbolic link (to {os.readlink(out)}), which dtpshard never replaces; "
                        f"nothing was touched (give the real path, or choose another {flag})")
    if force is False:
        raise UserError(f"output {out} exists (use --force to replace it)")
    try:
        mine = own(out)
    except Exception:  # whatever cannot be read as the command's own output is not its own
        mine = False
    if not mine:
        who = "--force" if force else "this command"
        raise UserError(f"{flag} {out} exists and is not {what}, the only thing {who} replaces (remove it, "
                        f"or choose another {flag})")
    return True
