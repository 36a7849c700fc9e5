"""Which modules are delayed (docs/design.md §1, "Per-module delay"): the set, as data, defined once.

A DTP model may delay only some of its M modules: module m then has delay δ (the run's) when m is
in the set and 0 (plain tensor parallelism: its sum lands at once) when it is not. The set is a
sorted tuple of module indices; `None` means every module is delayed (today's uniform schedule,
recorded by leaving the key out), so a full set is always stored as None and there is one way to
say "all".

A user names a set by a spec: a share of the modules, "0.5" (how many: `share_count`; which: the
caller's choice, by sensitivity, upper or random, layouts/delayed.py), or explicit indices,
"10-59" or "0,2,10-19". `parse_spec` reads it; `check_delayed` is the one check of a set against
a model, wherever a set comes from (a flag, a layout file, a student's record).
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from dtpshard.core.errors import UserError, quote
from dtpshard.core.vocab import DELAYED_BY

DELAYED_KEY = "delayed"  # the key of the set in a layout file, a run's config.json and a student's dtp block
_RANGE = re.compile(r"\s*(\d{1,9})\s*(?:-\s*(\d{1,9})\s*)?")
MAX_SPEC = 100_000  # characters: a list of every module of a 405B model's 252 fits many times over


def parse_spec(spec: Any, flag: str = "--delayed") -> float | tuple[int, ...]:
    """A share in (0, 1] (a number, or a string holding one with a '.'), or explicit module indices
    ("10-59", "0,2,10-19": unsorted, duplicates refused by check_delayed). One line on anything else."""
    if isinstance(spec, bool):
        raise UserError(f"{flag} {quote(spec)}: a share of the modules in (0, 1] or module indices such as 10-59")
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return _share(float(spec), flag)
    if isinstance(spec, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in spec):
            raise UserError(f"{flag}: module indices must be integers, got {quote(spec)}")
        return tuple(spec)
    if not isinstance(spec, str) or len(spec) > MAX_SPEC or not spec.strip():
        raise UserError(f"{flag} {quote(spec)}: a share of the modules in (0, 1] or module indices such as 10-59")
    text = spec.strip()
    if "." in text or "e" in text.lower():
        try:
            return _share(float(text), flag)
        except ValueError:
            raise UserError(f"{flag} {quote(spec)}: not a number in (0, 1] nor module indices such as 10-59") from None
    out: list[int] = []
    for part in text.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise UserError(f"{flag} {quote(spec)}: {quote(part.strip())} is not a module index or a range a-b")
        lo = int(match.group(1))
        hi = lo if match.group(2) is None else int(match.group(2))
        if hi < lo:
            raise UserError(f"{flag} {quote(spec)}: the range {lo}-{hi} is empty")
        if hi - lo > MAX_SPEC:
            raise UserError(f"{flag} {quote(spec)}: the range {lo}-{hi} is larger than any model's modules")
        out.extend(range(lo, hi + 1))
        if len(out) > MAX_SPEC:
            raise UserError(f"{flag} {quote(spec)}: more indices than any model has modules")
    return tuple(out)


def _share(x: float, flag: str) -> float:
    if not math.isfinite(x) or not 0 < x <= 1:
        raise UserError(f"{flag} {x:g}: a share of the modules must be in (0, 1]")
    return x


def share_count(share: float, modules: int, flag: str = "--delayed") -> int:
    """How many of `modules` a share delays: round(share·M), at least 1 (a share in (0, 1] always
    delays something, so the student always removes a sync)."""
    _share(share, flag)
    return max(1, min(modules, round(share * modules)))


def check_delayed(delayed: Iterable[Any] | None, modules: int | None,
                  where: str = "--delayed") -> tuple[int, ...] | None:
    """The set as stored: sorted module indices, or None for every module. Refused in one line: a
    non-integer, a duplicate, an index outside 0..M-1 (when M is known), an empty set."""
    if delayed is None:
        return None
    if isinstance(delayed, (str, bytes)) or not isinstance(delayed, Iterable):
        raise UserError(f"{where}: the delayed modules must be a list of module indices, not {quote(delayed)}")
    items = list(delayed)
    if not items:
        raise UserError(f"{where}: an empty set of delayed modules (leave it out to delay every module, or run "
                        "the dense model with delay 0)")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise UserError(f"{where}: the delayed modules must be integers, got {quote(items)}")
    seen: set[int] = set()
    for i in items:
        if i in seen:
            raise UserError(f"{where}: module {i} is listed twice among the delayed modules")
        seen.add(i)
    bad = [i for i in items if i < 0 or (modules is not None and i >= modules)]
    if bad:
        top = "" if modules is None else f" 0..{modules - 1}"
        raise UserError(f"{where}: delayed module {bad[0]} is outside the model's modules{top}")
    out = tuple(sorted(items))
    return None if modules is not None and len(out) == modules else out


def is_delayed(m: int, delayed: tuple[int, ...] | None) -> bool:
    return delayed is None or m in delayed


def delayed_count(delayed: tuple[int, ...] | None, modules: int) -> int:
    """How many modules are delayed: the syncs a DTP forward removes."""
    return modules if delayed is None else len(delayed)


def compact(delayed: tuple[int, ...] | None, modules: int) -> str:
    """The set in the spec's own form ("0-9,12"): what a message or a card says."""
    if delayed is None:
        return f"0-{modules - 1}" if modules > 1 else "0"
    runs: list[str] = []
    start = prev = delayed[0]
    for i in (*delayed[1:], None):
        if i is not None and i == prev + 1:
            prev = i
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(runs)


def describe(delayed: tuple[int, ...] | None, modules: int) -> str:
    """'every module' or 'k of M modules (0-9,12)'."""
    if delayed is None:
        return "every module"
    return f"{len(delayed)} of {modules} modules ({compact(delayed, modules)})"


def resolve_delayed_by(delayed: Any, by: str | None) -> str | None:
    """The rule that chooses a share's modules: `by`, by sensitivity when not given; None where
    nothing is chosen (every module delayed, or the modules listed). A rule given there would
    change nothing, so it is refused rather than ignored."""
    if by is not None and by not in DELAYED_BY:
        raise UserError(f"--delayed-by {quote(by)}: one of {', '.join(DELAYED_BY)}")
    if delayed is None or isinstance(parse_spec(delayed), tuple):
        if by is not None:
            said = "--delayed is not given (every module is delayed)" if delayed is None else \
                f"--delayed {quote(delayed)} lists the modules"
            raise UserError(f"--delayed-by {by}: it chooses a share's modules, and {said}")
        return None
    return by or "sensitivity"


def choose_delayed(spec: float | tuple[int, ...], by: str, modules: int, sensitivity: Any = None,
                   seed: int = 0, flag: str = "--delayed") -> tuple[int, ...] | None:
    """The set a spec names: explicit indices as they are; a share's `share_count` modules, those
    of least `sensitivity` (per module, ties to the lower index), the upper ones, or drawn with
    `seed`."""
    if isinstance(spec, tuple):
        return check_delayed(spec, modules, flag)
    if by not in DELAYED_BY:
        raise UserError(f"--delayed-by {quote(by)}: one of {', '.join(DELAYED_BY)}")
    k = share_count(spec, modules, flag)
    if by == "upper":
        chosen = range(modules - k, modules)
    elif by == "random":
        import numpy as np

        chosen = np.random.default_rng([seed, k, modules]).choice(modules, k, replace=False).tolist()
    else:
        if sensitivity is None or len(sensitivity) != modules:
            raise UserError("--delayed-by sensitivity needs each module's measured sensitivity (give --model)")
        chosen = sorted(range(modules), key=lambda m: (float(sensitivity[m]), m))[:k]
    return check_delayed([int(m) for m in chosen], modules, flag)
