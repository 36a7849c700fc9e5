"""Where the dense model is meant (the model `permute` permutes, the one sensitivity is measured on),
a checkpoint whose weights are in a layout's order already is refused: whatever is measured on it,
or applied over it, is about another model."""
from __future__ import annotations

from dtpshard.core.errors import UserError
from dtpshard.model.checkpoint import Checkpoint, is_student


def dense_only(ckpt: Checkpoint, role: str) -> Checkpoint:
    """`ckpt` where the dense model is meant (`role`: what it is given as), else one line: a
    student's or a permuted checkpoint's weights are in a layout's order already, and whatever is
    measured on them, or applied over them, is about another model."""
    if is_student(ckpt.hf_config):
        raise UserError(f"{role} {ckpt.path}: is a DTP student (model_type dtp), not a dense model; give the dense "
                        "checkpoint it was distilled from")
    if ckpt.applied is not None:
        raise UserError(f"{role} {ckpt.path}: is a checkpoint dtpshard permute wrote (its {ckpt.applied.kind} layout "
                        "is in its weights already), not the dense model; give the checkpoint it was permuted from")
    return ckpt

