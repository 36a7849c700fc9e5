"""The domain's words and the values a flag or config key may take, defined once.

The CLI (dtpshard/cli.py) and the experiment file (studies/config.py) are validated against the
signatures and dataclasses that use these types, so a bad value is refused when it is read, before
any work, with one line naming the flag or key. `REFUSAL` says what each constrained type wants.
"""
from __future__ import annotations

import math
from typing import Literal, get_args

from jsonargparse.typing import ClosedUnitInterval, NonNegativeInt, restricted_number_type, restricted_string_type

# -- words ------------------------------------------------------------------------------------
LayoutKind = Literal["optimised", "contiguous", "random", "anti", "heads-only", "neurons-only"]
LAYOUT_KINDS: tuple[str, ...] = get_args(LayoutKind)
OPTIMISING_KINDS = ("optimised", "anti", "heads-only", "neurons-only")  # kinds that maximise/minimise J
FIXED_KINDS = ("contiguous", "random")  # kinds made without an affinity file
# the affinity score an experiment computes J under (docs/design.md §2): the paper's first-order
# fo/add score, a KV group scored as one unit, the exact RMSNorm Jacobian, leave-one-out ablation
Proxy = Literal["first-order", "group-unit", "exact-jacobian", "ablation"]
PROXIES: tuple[str, ...] = get_args(Proxy)
Stage3 = Literal["sqrt", "one"]  # own-partial scale of the last δ modules (docs/design.md §1)
STAGE3: tuple[str, ...] = get_args(Stage3)
KvSearch = Literal["assignment", "exhaustive"]  # the optimiser's KV-group block update (docs/design.md §3)
KV_SEARCHES: tuple[str, ...] = get_args(KvSearch)
DType = Literal["float32", "bfloat16"]
LoadDType = Literal["auto", "float32", "bfloat16"]  # auto: the checkpoint's own, as transformers
AffinityDType = Literal["float32", "float64"]
CompileMode = Literal["auto", "on", "off"]  # distill --compile: auto compiles where it pays (model/compiled.py)
PermuteCheck = Literal["construction", "logits", "none"]  # what `permute` reads back

# -- constrained numbers and strings (parse-time checks) ---------------------------------------
_INF = math.inf
NonNegativeInt = NonNegativeInt  # jsonargparse's (>= 0), named here with the others
Count = restricted_number_type("Count", int, (">=", 1))  # a positive count: steps, blocks, tokens
# NonNegativeInt (jsonargparse's): 0 often means "automatic"
Seed = restricted_number_type("Seed", int, [(">=", 0), ("<", 2 ** 63)])
PositiveNumber = restricted_number_type("PositiveNumber", float, [(">", 0), ("<", _INF)])  # finite, > 0
NonNegativeNumber = restricted_number_type("NonNegativeNumber", float, [(">=", 0), ("<", _INF)])
Fraction = ClosedUnitInterval
Beta = restricted_number_type("Beta", float, [(">=", 0), ("<", 1)])
TopP = restricted_number_type("TopP", float, [(">", 0), ("<=", 1)])  # nucleus mass
Delay = NonNegativeNumber  # δ in modules; fractional allowed, 0 is tensor parallelism
# a wait in seconds: finite, > 0, and at most ~11.6 days (threading.TIMEOUT_MAX-safe on every platform)
Seconds = restricted_number_type("Seconds", float, [(">", 0), ("<=", 1e6)])
Device = restricted_string_type("Device", r"^(auto|cpu|cuda|cuda:[0-9]+)$")

REFUSAL = {
    "Count": "must be an integer >= 1", "NonNegativeInt": "must be an integer >= 0",
    "Seed": "must be an integer >= 0", "PositiveNumber": "must be a finite number > 0",
    "NonNegativeNumber": "must be a finite number >= 0", "Seconds": "must be a finite number > 0 (seconds, at most 1e6)", "ClosedUnitInterval": "must be a number in [0, 1]",
    "Beta": "must be a number in [0, 1)", "TopP": "must be a number in (0, 1]", "Device": "must be auto, cpu, cuda or cuda:N",
    "int": "must be an integer", "float": "must be a number", "str": "must be a string",
    "bool": "must be true or false", "Path": "must be a path",
}


def parse_refusal(message: str) -> tuple[str | None, str]:
    """(key, what it must be) from one of jsonargparse's multi-line errors, for a one-line refusal;
    key is None when the message names no single key (an unknown option, a missing one)."""
    import re

    keys = re.findall(r'Parser key "([^"]+)"', message)
    key = ".".join(keys) if keys else None
    wanted = re.findall(r"Not of type (\w+)", message)
    literal = re.search(r"Expected a typing\.Literal\[(.*?)\]", message)
    if wanted and wanted[0] in REFUSAL:
        return key, REFUSAL[wanted[0]]
    if literal:
        return key, "must be one of " + ", ".join(c.strip().strip("'\"") for c in literal.group(1).split(","))
    if re.search(r"Expected a <class '(dict|jsonargparse.*Namespace)'>|Expected a dict|class_path", message):
        return key, "must be a table"
    m = re.search(r"Expected a <class '(\w+)'>", message)
    if m and m.group(1) in REFUSAL:
        return key, REFUSAL[m.group(1)]
    if "Expected a List" in message or "Expected a <class 'list'>" in message or "list" in message.lower():
        return key, "must be a list"
    return key, " ".join(message.split())[:200]
