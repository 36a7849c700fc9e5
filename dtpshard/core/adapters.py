"""An adapter run's settings (`distill --adapters RANK`), defined without torch: the rank, α and
the projections adapted, checked against a model's shape, and what they train. The adapters
themselves are model/adapters.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from dtpshard.core.errors import UserError
from dtpshard.core.family import PROJECTIONS

TARGETS = PROJECTIONS  # target name -> (the layer's submodule, its projection); o and down are read by columns
AdapterTarget = Literal["q", "k", "v", "o", "gate", "up", "down"]  # a flag's choices: TARGETS' keys
DEFAULT_TARGETS: tuple[str, ...] = get_args(AdapterTarget)
DEFAULT_ALPHA = 32.0  # fixed α, so that α/r makes the best learning rate nearly independent of r
SCALES = (1e-4, 1e4)  # the α/r a run may use: peft's defaults give 1/8 to 32


@dataclass(frozen=True)
class AdapterSettings:
    rank: int
    alpha: float = DEFAULT_ALPHA
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}


def check_adapters(settings: AdapterSettings, shape: Any) -> None:
    """One line for a rank or target that cannot be: the rank must be at most min(rows, columns)
    of some projection it adapts."""
    unknown = [t for t in settings.targets if t not in TARGETS]
    if unknown:
        raise UserError(f"--adapter-targets {unknown[0]!r}: not a projection (choose from {', '.join(TARGETS)})")
    if not settings.targets:
        raise UserError("--adapter-targets: give at least one projection")
    if settings.rank < 1:
        raise UserError(f"--adapters {settings.rank}: the rank must be at least 1")
    # a rank above a projection's min(rows, columns) gives it a full-rank update (peft allows it);
    # above every adapted projection's, nothing is low rank any more
    sizes = {t: projection_shape(shape, t) for t in settings.targets}
    target, (out, inp) = max(sizes.items(), key=lambda kv: min(kv[1]))
    if settings.rank > min(out, inp):
        raise UserError(f"--adapters {settings.rank}: above min(rows, columns) of every adapted projection (at most "
                        f"{min(out, inp)}, the {target} projection's: {out} x {inp})")
    if not math.isfinite(settings.alpha) or settings.alpha <= 0:
        raise UserError(f"--adapter-alpha {settings.alpha}: must be a positive number")
    if not SCALES[0] <= settings.scale <= SCALES[1]:  # B·A's update scaled to nothing, or to overflow
        raise UserError(f"--adapter-alpha {settings.alpha:g}: α/r = {settings.scale:g} at rank {settings.rank}, "
                        f"outside [{SCALES[0]:g}, {SCALES[1]:g}] (below, the adapters train nothing; above, their "
                        "term overflows)")


def projection_shape(s: Any, target: str) -> tuple[int, int]:
    """[out, in] of a target's dense weight for a ModelShape."""
    q, kv = s.heads * s.head_dim, s.kv_groups * s.head_dim
    return {"q": (q, s.hidden), "k": (kv, s.hidden), "v": (kv, s.hidden), "o": (s.hidden, q),
            "gate": (s.neurons, s.hidden), "up": (s.neurons, s.hidden), "down": (s.hidden, s.neurons)}[target]


def trainable_count(shape: Any, settings: AdapterSettings) -> int:
    """Parameters the adapters train: r·(out + in) per adapted projection and layer."""
    return shape.layers * sum(settings.rank * sum(projection_shape(shape, t)) for t in settings.targets)


