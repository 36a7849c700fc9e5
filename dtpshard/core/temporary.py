"""The one definition of a temporary: how dtpshard names the half-written sibling of an output,
and how it recognises one of its own that a kill left behind.

A temporary of NAME written by process PID is `.NAME.tmp-PID-CHECK[TAIL]`, CHECK being ten hex
digits of a SHA-256 of NAME and PID. Only a name whose check holds is a temporary: a user's file
that merely looks like one (`.config.json.tmp-4000000`, a copy of a pattern) is the user's, never
removed. No other module spells the pattern (core/io.py removes stale ones, core/owned.py counts
them among a directory's own names, core/rename.py and transport/native.py name theirs with it).
"""
from __future__ import annotations

import hashlib
import os
import re

_PATTERN = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>[0-9]{1,10})-(?P<check>[0-9a-f]{10})"
                      r"(?P<tail>(\.old|-[A-Za-z0-9_]+)?)")


def _check(name: str, pid: int) -> str:
    return hashlib.sha256(f"dtpshard temporary\0{name}\0{pid}".encode()).hexdigest()[:10]


def temporary_name(name: str, tail: str = "", pid: int | None = None) -> str:
    """The name of this process's temporary of `name` (`tail`: "-probe", ".old", or "-" before
    mkdtemp's random letters)."""
    pid = os.getpid() if pid is None else pid
    return f".{name}.tmp-{pid}-{_check(name, pid)}{tail}"


def temporary_of(entry: str) -> tuple[str, int] | None:
    """(NAME, PID) when `entry` is a name dtpshard gave a temporary of NAME, else None."""
    found = _PATTERN.fullmatch(entry)
    if found is None or found["check"] != _check(found["name"], int(found["pid"])):
        return None
    return found["name"], int(found["pid"])
