"""A run's DTP settings (L devices, delay δ, the stage-3 scale), resolved and checked in one place.

Every command and loader that runs a DTP model asks `resolve_dtp`, in one order of precedence:
what the user said (flags, arguments), then what a distilled student recorded about itself, then
the layout (made for some L and δ), then the defaults (L = 4, δ = 1, stage3 = sqrt: the paper's).
`read_record` is the one reader of a student's record, wherever it is stored, and
`warn_if_other_settings` the one rule for a student run with settings other than its record.
A resolved `DTPSettings` is what travels: the model, the runtime, the schedule and the layouts
take it whole, and no default is written anywhere but here.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from dtpshard.core.delayed import DELAYED_KEY, check_delayed, describe
from dtpshard.core.errors import UserError
from dtpshard.core.shape import FAMILIES, MAX_UNITS, UnitShape, check_delay, check_devices
from dtpshard.core.vocab import STAGE3, Count, Delay, Stage3

log = logging.getLogger("dtpshard")


@dataclass(frozen=True)
class DTPSettings:
    """L, δ and the stage-3 scale of a DTP run. Made by `resolve_dtp` (which checks them against
    the model); built by hand, `check` is the same check."""

    devices: int  # L
    delay: float  # δ, in modules (an int when whole)
    stage3: str  # own-partial scale of the last δ modules: "sqrt" (√L, the paper's) or "one"
    # the modules delayed by δ, sorted (core/delayed.py); the others are plain tensor parallel.
    # None: every module (the uniform schedule), the only way "all" is stored
    delayed: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        """What a record holds: `delayed` only when some modules are plain (absent: all delayed)."""
        out: dict[str, Any] = {"devices": self.devices, "delay": self.delay, "stage3": self.stage3}
        if self.delayed is not None:
            out[DELAYED_KEY] = list(self.delayed)
        return out

    def check(self, shape: UnitShape | None, shared: int | None = None) -> DTPSettings:
        """Refuse settings that `shape` cannot run (L divides G and the sharded neurons, 0 <= δ <= M, a
        known stage3, delayed modules that exist); `shared`: the neurons a layout replicates (None:
        the shape's own)."""
        check_stage3(self.stage3)
        if shape is not None:
            check_devices(shape, self.devices, shared=shared)
        check_delay(shape, self.delay)
        if self.delayed is not None:
            modules = None if shape is None else shape.modules
            stored = check_delayed(self.delayed, modules, "the delayed modules")
            if stored != self.delayed:  # every module listed: stored as None, one way to say "all"
                return DTPSettings(self.devices, self.delay, self.stage3, stored)
        return self

    @property
    def dense(self) -> bool:
        """Whether these settings compute the dense function (one device, or nothing delayed)."""
        return self.devices == 1 or self.delay == 0

    def describe(self, modules: int | None = None) -> str:
        text = f"devices={self.devices}, delay={self.delay}, stage3={self.stage3}"
        if self.delayed is not None:
            text += f", delayed={describe(self.delayed, modules) if modules else list(self.delayed)}"
        return text


DEFAULT = DTPSettings(devices=4, delay=1, stage3="sqrt")
DENSE = DTPSettings(devices=1, delay=0, stage3=DEFAULT.stage3)  # the dense model (stage 3 is empty at δ = 0)


@dataclass(frozen=True, kw_only=True)
class DTPFlags:
    devices: Count | None = None
    delay: Delay | None = None
    stage3: Stage3 | None = None


NO_FLAGS = DTPFlags()  # none given: every setting resolve_dtp's


# the commands' help of the three flags, from DEFAULT and resolve_dtp's order (cyclopts reads it)
DTP_HELP = {
    "devices": f"L, the number of devices; default a student's recorded L, else the layout's, else {DEFAULT.devices}",
    "delay": "δ in modules (fractional allowed; 0 is tensor parallelism); default a student's recorded δ, else the "
             f"layout's, else {DEFAULT.delay}",
    "stage3": "own-partial scale of the last δ modules: sqrt (√L, the paper's) or one; default a student's recorded "
              f"one, else {DEFAULT.stage3}",
}


def args_doc(summary: str, helps: dict[str, str]) -> str:
    """A settings dataclass's docstring with an Args: section (what cyclopts reads a flag's help from)."""
    return summary + "\n\nArgs:\n" + "".join(f"    {k}: {v}\n" for k, v in helps.items())


DTPFlags.__doc__ = args_doc("L, δ and the stage-3 scale as a command's flags: each one not given is resolve_dtp's "
                            "(a student's record, else the layout's, else the default).", DTP_HELP)


def check_stage3(stage3: Any, where: str = "stage3") -> str:
    if stage3 not in STAGE3:
        raise UserError(f"{where}={stage3!r}: must be one of {', '.join(STAGE3)}")
    return stage3


def plain_delay(delay: float) -> float:
    """δ as recorded: 2 rather than 2.0 when whole, so files and messages say what was typed."""
    return int(delay) if float(delay).is_integer() else float(delay)


def resolve_dtp(shape: UnitShape | None = None, *, devices: int | None = None, delay: float | None = None,
                stage3: str | None = None, delayed: Any = None, record: dict[str, Any] | None = None,
                layout: Any = None, where: str = "layout") -> DTPSettings:
    """Each setting from the first that gives it: the arguments, the student's `record`
    (read_record), the `layout` (a core.layout.Layout: its devices, delay and delayed modules),
    DEFAULT. Checked against `shape` (L divides G and N, δ <= M, the delayed modules exist); a
    layout made for another L is refused, naming `where` (its file). `delayed`: module indices
    (None: not given; every module unless the record or the layout says otherwise)."""
    record = record or {}

    def pick(name: str, given: Any) -> Any:
        for value in (given, record.get(name), None if layout is None else getattr(layout, name, None)):
            if value is not None:
                return value
        return getattr(DEFAULT, name)

    shared = getattr(layout, "shared", 0) or None  # a shared layout's count, else the shape's (docs/design.md §6)
    chosen = pick(DELAYED_KEY, delayed)
    chosen = check_delayed(chosen, None if shape is None else shape.modules, "the delayed modules")
    out = DTPSettings(int(pick("devices", devices)), plain_delay(pick("delay", delay)),
                      check_stage3(pick("stage3", stage3)), chosen).check(shape, shared)
    if layout is not None and layout.devices != out.devices:
        raise UserError(f"{where} was made for devices={layout.devices}, the model runs devices={out.devices}")
    return out


def read_record(saved: Any, where: str) -> dict[str, Any] | None:
    """A student's recorded settings (devices, delay, stage3, layout_sha256, ...), each checked so
    that a hand-edited file names itself; None when there is no record."""
    if saved is None:
        return None
    if not isinstance(saved, dict):
        raise UserError(f"{where}: the DTP settings must be a JSON object")
    checks = {"devices": lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_UNITS,
              "delay": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
              and 0 <= v < 1e9,
              "stage3": lambda v: v in STAGE3,
              "layout_sha256": lambda v: v is None or isinstance(v, str) and len(v) <= 64,
              "shared": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_UNITS,
              "family": lambda v: v in FAMILIES,  # the base family of a model_type "dtp" student
              DELAYED_KEY: lambda v: isinstance(v, list) and 0 < len(v) <= MAX_UNITS
              and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_UNITS for i in v)
              and v == sorted(set(v))}  # the sorted delayed modules (absent: every module)
    unknown = sorted(str(k) for k in saved if k not in checks)  # a typo ("delays") must not pass silently
    if unknown:
        raise UserError(f"{where}: unknown DTP setting {unknown[0]!r} (known: {', '.join(checks)})")
    for key, ok in checks.items():
        if key in saved and not ok(saved[key]):
            raise UserError(f"{where}: {key} = {json.dumps(saved[key])} is not a valid DTP setting")
    return dict(saved)


def warn_if_other_settings(where: Any, record: dict[str, Any] | None, settings: DTPSettings,
                           modules: int | None = None) -> None:
    """One line when a DTP student is about to run with settings other than those it recorded:
    a distilled student computes its own (L, δ, stage3) function, and differs from any other by
    O(1) logits (run dense, it is not the function it was distilled for)."""
    if record is None:
        return
    delayed = check_delayed(record.get(DELAYED_KEY), modules, f"{where}: delayed")  # every module listed: None
    trained = DTPSettings(record.get("devices", DEFAULT.devices), record.get("delay", DEFAULT.delay),
                          record.get("stage3", DEFAULT.stage3), None if delayed is None else tuple(delayed))
    if trained == settings or trained.dense and settings.dense:
        return
    dense = " (a dense model)" if settings.dense else ""
    log.warning(f"warning: {where} is a DTP student distilled for {trained.describe()}; running it with "
                f"{settings.describe()}{dense} computes another function than the one it was distilled for")
