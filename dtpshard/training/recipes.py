"""Distillation recipes (docs/design.md §4): what each optimizer step trains the student towards, as
a pure function of the step, so that a run resumes bit-identically from its step alone.

A recipe is a name, a `phase(step, steps, delay)` and `starts(steps)`, the steps where its phase
changes (so a question about every step is asked of a few). The loop asks it once per step and does
what the Phase says; it never asks which recipe runs. A Phase holds three numbers:

- `delay`: the δ of this step's training forward (the run's own δ at evaluation, always);
- `logits`: the weight of the paper's loss, KL(teacher ‖ student) + ce_weight·CE, on the LM head;
- `streams`: the weight of stream matching, the distance between every device's residual stream
  after every module and the dense teacher's stream at the same point (`stream_distance`).

`paper` is the paper's recipe exactly: every step is (δ, 1, 0). The others use what is specific
to a DTP student: it is the teacher's own weights, and each device's stream differs from the
teacher's only by the partials of the other devices' last δ modules, which have not landed.
Names are fixed: a run records its recipe, and a resume with another is refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Phase:
    """What one optimizer step trains on (module docstring)."""

    delay: float
    logits: float = 1.0
    streams: float = 0.0


@dataclass(frozen=True)
class Paper:
    """The paper's recipe: KL + ce_weight·CE on the logits at the run's δ, from the first step.
    Every module learns only from the gradient that flows back to it from the LM head."""

    name: str = "paper"

    def phase(self, step: int, steps: int, delay: float) -> Phase:
        return Phase(delay)

    def starts(self, steps: int) -> list[int]:
        """The steps after 0 where the phase changes (none)."""
        return []


@dataclass(frozen=True)
class StreamsFirst:
    """Stream matching first: for the first `split` of the steps each module is pulled towards the
    teacher directly, by the distance between each device's stream after it and the dense stream
    at the same point, then the paper's loss for the rest. The logits are a function of the last
    stream alone, so a gradient through 2n modules is a weak signal for the first ones; a local
    target gives every module its own, and the streams the student must rebuild are exactly the
    teacher's (the missing partials are the only difference). `split`: a fifth of the run, chosen
    before any run and not tuned: the streams are a means, the KL is the goal, so most of the
    steps stay on it (as a stage of attention transfer precedes fine-tuning in LoLCATs)."""

    name: str = "streams"
    split: float = 0.2

    def phase(self, step: int, steps: int, delay: float) -> Phase:
        if step < round(self.split * steps):
            return Phase(delay, logits=0.0, streams=1.0)
        return Phase(delay)

    def starts(self, steps: int) -> list[int]:
        return [round(self.split * steps)]


@dataclass(frozen=True)
class Curriculum:
    """A delay curriculum: the late partials' landing weight ramps from δ = 0 (the teacher's own
    function: the student starts where it has nothing to learn) to the run's δ over the first
    `ramp` of the steps, in `levels` equal steps of δ (the fractional-δ schedule computes every
    point between; few distinct values keep a compiled student to few graphs), then the run's δ."""

    name: str = "curriculum"
    ramp: float = 0.3
    levels: int = 4

    def phase(self, step: int, steps: int, delay: float) -> Phase:
        end = max(1, round(self.ramp * steps))
        if step >= end:
            return Phase(delay)
        return Phase(delay * math.floor(self.levels * step / end) / self.levels)

    def starts(self, steps: int) -> list[int]:
        end = max(1, round(self.ramp * steps))
        return [-(-k * end // self.levels) for k in range(1, self.levels)] + [end]


@dataclass(frozen=True)
class Layerwise:
    """Layer-wise distillation with the logits (as TinyBERT's and MiniLM's intermediate-layer
    losses beside the prediction layer's): the paper's loss and stream matching together at every
    step, the streams weighted by `weight`."""

    name: str = "layerwise"
    weight: float = 1.0

    def phase(self, step: int, steps: int, delay: float) -> Phase:
        return Phase(delay, logits=1.0, streams=self.weight)

    def starts(self, steps: int) -> list[int]:
        return []


RECIPES = {r.name: r for r in (Paper(), StreamsFirst(), Curriculum(), Layerwise())}
RecipeName = Literal["paper", "streams", "curriculum", "layerwise"]  # RECIPES' keys (tests/test_recipes.py)
DEFAULT_RECIPE: RecipeName = "paper"


def recipe_for(name: str) -> Paper | StreamsFirst | Curriculum | Layerwise:
    return RECIPES[name]


def uses_streams(name: str, steps: int) -> bool:
    """Whether any step of this recipe matches streams (it needs the dense teacher's streams): asked
    of the first step of each phase (`starts`), never of every step, whatever --steps says."""
    r = RECIPES[name]
    return any(r.phase(s, steps, 1.0).streams > 0 for s in {0, *r.starts(steps)} if 0 <= s < steps)
