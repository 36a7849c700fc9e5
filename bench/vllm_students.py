"""The models bench/bench_vllm.py serves, made from one set of random weights: the student and its
dense twin (and the same weights as a student of δ = 0, "TP over the ring"), shared students and
partial students, with the arm names their rows are read by."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

# Weights dominate a decode step: hidden 1024, 8 layers, fp32 (≈ 0.37 GB, ≈ 0.19 GB a rank at TP 2)
SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, vocab_size=8192, max_position_embeddings=1024)


def make_pair(root: Path, devices: int, delay: float = 1, family: str = "llama", dtype: str = "float32",
              shape: dict | None = None) -> tuple[Path, Path]:
    """(student, dense) directories of the same random weights; also ROOT/tp-ring-L, the same weights
    as a student of δ = 0 (make_tp_ring)."""
    from dtpshard.model.checkpoint import open_checkpoint
    from dtpshard.model.dtp import DTPModel
    from tiny import save_tiny

    teacher = save_tiny(root / "teacher", family, **(shape or SHAPE))
    student, dense = root / f"student-{devices}", root / f"dense-{devices}"
    DTPModel.from_pretrained(teacher, devices, delay).save_pretrained(student, source=teacher,
                                                                      dtype=getattr(torch, dtype))
    dense.mkdir()
    for f in student.iterdir():
        if f.suffix in (".safetensors", ".json") and f.name != "config.json":
            shutil.copy(f, dense / f.name)
    base = open_checkpoint(student).hf_config.base_config()  # the family's config of the same fields
    base.architectures = [type(base).__name__.replace("Config", "ForCausalLM")]
    base.save_pretrained(dense)
    DTPModel.from_pretrained(teacher, devices, 0).save_pretrained(root / f"tp-ring-{devices}", source=teacher,
                                                                   dtype=getattr(torch, dtype))
    return student, dense


def shared_arm(fraction: float) -> str:
    """The arm of a shared student: dtp_shared10 for 10% (the name a study's report reads it by)."""
    from dtpshard.studies.shared import bench_arm

    return bench_arm(fraction)


def make_shared(root: Path, devices: int, fraction: float, delay: float = 1, dtype: str = "float32") -> Path:
    """A shared student of make_pair's teacher (it must be made first): `fraction` of every layer's
    neurons drawn at random (seed 0) and replicated, the other units contiguous."""
    from dtpshard.core.layout import Layout
    from dtpshard.layouts.make import shared_sets
    from dtpshard.model.checkpoint import open_checkpoint
    from dtpshard.model.dtp import DTPModel

    teacher, out = root / "teacher", root / f"{shared_arm(fraction)}-{devices}"
    shape = open_checkpoint(teacher).shape
    sets = shared_sets(shape, devices, fraction, "random")
    if sets is None:
        raise SystemExit(f"--shared {fraction:g}: no neuron shared")
    layout = Layout.contiguous_shared(shape, devices, delay, sets, "random")
    DTPModel.from_pretrained(teacher, devices, delay, layout=layout).save_pretrained(out, source=teacher,
                                                                                     dtype=getattr(torch, dtype))
    return out


def delayed_arm(share: float) -> str:
    """The arm of a partial student: dtp_delayed50 for half the modules (the name a study's report reads)."""
    return f"dtp_delayed{100 * share:.4g}".replace(".", "_")


def make_delayed(root: Path, devices: int, share: float, delay: float = 1, dtype: str = "float32") -> Path:
    """A partial student of make_pair's teacher (it must be made first): `share` of its modules,
    drawn at random (seed 0), delayed; the same contiguous layout."""
    from dtpshard.core.delayed import choose_delayed
    from dtpshard.model.checkpoint import open_checkpoint
    from dtpshard.model.dtp import DTPModel

    teacher, out = root / "teacher", root / f"{delayed_arm(share)}-{devices}"
    chosen = choose_delayed(share, "random", open_checkpoint(teacher).shape.modules, seed=0)
    DTPModel.from_pretrained(teacher, devices, delay, delayed=chosen).save_pretrained(out, source=teacher,
                                                                                      dtype=getattr(torch, dtype))
    return out


def plain_arm_name(kind: str, arm: str) -> str:
    """A partial student's arm with its blocking sums forced to `kind`: dtp_plainring_delayed50."""
    return f"dtp_plain{kind}_{arm.removeprefix('dtp_')}"


def rank_weights(model: Path, devices: int) -> int:
    """Weights a rank holds: its share of the layers (its shared neurons whole) and the embedding and head."""
    from dtpshard.model.checkpoint import open_checkpoint

    return open_checkpoint(model).shape.shard(devices).params()
