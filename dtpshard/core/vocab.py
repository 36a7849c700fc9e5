"""The domain's words and the values a flag or config key may take, defined once.

The CLI (dtpshard/cli.py), a --config file and the experiment file (studies/config.py) are checked
against the signatures and dataclasses that use these types, by one mechanism
(dtpshard.core.typed), so a bad value is refused when it is read, before any work, with one line
naming the flag or key. A constrained type is `Annotated[base, Constraint(test, words, wants)]`:
plain Python typing, no CLI library; `words` is what --help says it takes and `wants` what a
refusal says a value must be.
"""
from __future__ import annotations

import math
import re
from typing import Annotated, Literal, get_args

from dtpshard.core.typed import Constraint

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
# which neurons a layout shares (docs/design.md §6): the top by first-order affinity mass (the up
# edge's column mass), by the down edge's row mass, or chosen at random
SharedBy = Literal["fo", "dn", "random"]
SHARED_BY: tuple[str, ...] = get_args(SharedBy)
# which modules a partial student delays (core/delayed.py): those of least measured sensitivity
# (affinity/sensitivity.py), the upper ones (Ladder Residual's choice), or drawn at random
DelayedBy = Literal["sensitivity", "upper", "random"]
DELAYED_BY: tuple[str, ...] = get_args(DelayedBy)

# -- constrained numbers and strings (parse-time checks) ---------------------------------------
# NaN fails every comparison, so each test refuses it; `< math.inf` refuses infinity too.
Count = Annotated[int, Constraint(lambda n: n >= 1, "int >= 1", "an integer >= 1")]  # steps, blocks, tokens
# a run's optimizer steps and micro-batches per step: bounded before anything is made per step or block
MAX_STEPS, MAX_GRAD_ACCUM = 1 << 31, 1 << 16
Steps = Annotated[int, Constraint(lambda n: 1 <= n <= MAX_STEPS, "int in [1, 2^31]", "an integer from 1 to 2^31")]
GradAccum = Annotated[int, Constraint(lambda n: 1 <= n <= MAX_GRAD_ACCUM, "int in [1, 65536]",
                                      "an integer from 1 to 65536")]
NonNegativeInt = Annotated[int, Constraint(lambda n: n >= 0, "int >= 0", "an integer >= 0")]  # 0: often "automatic"
Seed = Annotated[int, Constraint(lambda n: 0 <= n < 2 ** 63, "int >= 0", "an integer >= 0")]
PositiveNumber = Annotated[float, Constraint(lambda x: 0 < x < math.inf, "number > 0", "a finite number > 0")]
# AdamW moves a weight by about lr a step: above 1, by more than any weight's size (and 1e300 overflows)
LearningRate = Annotated[float, Constraint(lambda x: 0 < x <= 1, "number in (0, 1]", "a number > 0 and at most 1")]
NonNegativeNumber = Annotated[float, Constraint(lambda x: 0 <= x < math.inf, "number >= 0", "a finite number >= 0")]
Fraction = Annotated[float, Constraint(lambda x: 0 <= x <= 1, "number in [0, 1]", "a number in [0, 1]")]
SharedFraction = Annotated[float, Constraint(lambda x: 0 <= x < 1, "number in [0, 1)", "a number in [0, 1)")]
DelayedShare = Annotated[float, Constraint(lambda x: 0 < x <= 1, "number in (0, 1]", "a number in (0, 1]")]
Beta = Annotated[float, Constraint(lambda x: 0 <= x < 1, "number in [0, 1)", "a number in [0, 1)")]
TopP = Annotated[float, Constraint(lambda x: 0 < x <= 1, "number in (0, 1]", "a number in (0, 1]")]  # nucleus mass
Delay = NonNegativeNumber  # δ in modules; fractional allowed, 0 is tensor parallelism
# a wait in seconds: finite, > 0, and at most ~11.6 days (threading.TIMEOUT_MAX-safe on every platform)
Seconds = Annotated[float, Constraint(lambda x: 0 < x <= 1e6, "seconds > 0, at most 1e6",
                                      "a finite number > 0 (seconds, at most 1e6)")]
_DEVICE = re.compile(r"auto|cpu|cuda|cuda:[0-9]+")
Device = Annotated[str, Constraint(lambda s: _DEVICE.fullmatch(s) is not None, "auto, cpu, cuda or cuda:N",
                                   "auto, cpu, cuda or cuda:N")]
