"""Distillation (docs/design.md §4): train the DTP student to match the frozen dense teacher.

The student starts from the teacher's weights permuted by the layout and runs as L devices with
delay δ; the teacher is the same checkpoint run dense. Loss per position: KL(teacher ‖ student)
+ ce_weight·CE(next token), in chunks (losses.py). Embedding and LM head are frozen (they are
shared with the teacher, not copied). One optimizer step sees micro_batch × grad_accum ×
processes blocks of seq_len + 1 tokens; the data order is a pure function of the seed, so a run
is resumable from (weights, optimizer, scheduler, RNG, step) alone.

This file: the recipe (DistillConfig), the models and data of a run and what config.json
records. The loop is in loop.py, the run directory in rundir.py, the process group in ddp.py,
sharding (--fsdp) in fsdp.py, and `distill` (one process, torchrun or --nproc) with the command
in distill.py.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from dtpshard.core.errors import UserError
from dtpshard.core.vocab import (Beta, CompileMode, Count, Delay, Device, Fraction, NonNegativeInt, NonNegativeNumber,
                                 PositiveNumber, Seconds, Seed, Stage3)
from dtpshard.training.precision import Precision

SaveDType = Literal["auto", "float32", "bfloat16", "float16"]

FORMAT = "dtpshard.distill/1"
FROZEN = ("model.embed_tokens.weight", "lm_head.weight")
# Settings that do not change what is computed: a resumed run may change them.
OPERATIONAL = ("out", "force", "progress", "checkpoint_every", "checkpoint_minutes", "nproc", "timeout",
               "eval_micro_batch", "grad_checkpointing", "compile", "device", "text", "eval_text", "layout",
               "text_field", "tokenizer", "tensorboard", "teacher_cache", "max_shard_size", "save_dtype", "plan",
               "plan_world", "plan_memory")  # data changes show in the data hashes
DERIVED_COMPARED = ("model", "layout_sha256", "world_size", "device_type", "train_data_sha256", "eval_data_sha256",
                    "teacher_cache_id")  # a cached teacher is recorded by what it holds, not where


@dataclass
class DistillConfig:
    """The distillation recipe, the paper's by default (docs/design.md §4)

    Each field is a flag of `dtpshard distill` and a key of an experiment's [training] table.

    Args:
        teacher: the dense Hugging Face checkpoint directory
        out: the run directory (created; an existing one is resumed if its settings match)
        layout: layout JSON (dtpshard.layout/1) to permute the student by; none: contiguous
        devices: L; default the layout's, else 4
        delay: δ in modules; default the layout's, else 1
        stage3: own-partial scale of the last δ modules: sqrt (√L, the paper's) or one
        steps: optimizer steps
        seq_len: tokens per sequence (blocks hold seq_len + 1 tokens)
        micro_batch: sequences per forward pass (per process)
        grad_accum: micro-batches accumulated per optimizer step
        lr: peak learning rate (AdamW)
        warmup: linear warm-up steps
        min_lr_ratio: the cosine decay ends at this fraction of --lr
        weight_decay: AdamW weight decay (matrices only; norms are never decayed)
        adam_beta1: AdamW β1
        adam_beta2: AdamW β2
        clip: gradient-norm clip (0: none)
        ce_weight: weight of the next-token cross-entropy added to the KL
        eval_every: evaluate every this many steps (and at step 0 and at the end)
        eval_blocks: held-out evaluation blocks of seq_len + 1 tokens
        eval_micro_batch: blocks per evaluation forward pass (default: --micro-batch)
        text: local .txt/.jsonl/.json/.parquet training files (their held-out share is never trained on)
        dataset: training dataset: a save_to_disk directory, a parquet file or directory, or a hub name (fineweb-edu, ...); default the offline corpus
        eval_text: local evaluation files (their held-out share is used)
        eval_dataset: evaluation dataset, as --dataset (wikitext-2 is the paper's); default the offline corpus
        text_field: the column or JSON field that holds the text
        tokenizer: tokenizer directory, where TEACHER has no tokenizer files
        seed: data-order seed
        grad_checkpointing: recompute each module's activations in backward (less memory)
        compile: torch.compile the student: on, off, or auto (on CUDA, and on CPU for runs of 200+ steps; never with --fsdp)
        teacher_cache: a `dtpshard teacher-cache` directory: train on its top-k KL + tail instead of running the teacher
        precision: fp32, or bf16-mixed (bf16 forward and backward, fp32 master weights and gradient reduction); auto: bf16-mixed on CUDA, fp32 on the CPU
        device: auto (cuda if available, else cpu), cpu, cuda or cuda:N
        checkpoint_every: write a checkpoint every this many steps
        checkpoint_minutes: and whenever this many minutes passed since the last one
        nproc: data-parallel processes to spawn on this machine (gloo on CPU, NCCL on GPUs); 1: this one
        fsdp: shard the student (weights, gradients, optimizer state) and the teacher across the processes (FSDP2)
        timeout: seconds a process waits for the others before the run fails
        progress: show a progress bar with ETA
        tensorboard: also write the metrics as TensorBoard events to this directory (metrics.jsonl stays the record)
        force: start the run directory over (its checkpoint, metrics and student are deleted)
        max_shard_size: the student's safetensors files are at most this large (5GB, 500MB, 2GiB, or bytes), as transformers' save_pretrained
        save_dtype: the student's saved weights: auto (the teacher's dtype), float32, bfloat16 or float16
        plan: print the memory plan per process (from config.json alone) and exit; refused in one line if the run cannot fit
        plan_world: --plan for this many processes (default: --nproc, or torchrun's WORLD_SIZE)
        plan_memory: --plan against this much memory per process (e.g. 80GB; default: this machine's GPU memory or RAM share)
    """

    teacher: Path
    out: Path
    layout: Path | None = None
    devices: Count | None = None  # None: the layout's, else 4
    delay: Delay | None = None  # None: the layout's, else 1
    stage3: Stage3 = "sqrt"
    steps: Count = 1000
    seq_len: Count = 1024
    micro_batch: Count = 4
    grad_accum: Count = 4
    lr: PositiveNumber = 5e-5
    warmup: NonNegativeInt = 100
    min_lr_ratio: Fraction = 0.1
    weight_decay: NonNegativeNumber = 0.0
    adam_beta1: Beta = 0.9
    adam_beta2: Beta = 0.95
    clip: NonNegativeNumber = 1.0
    ce_weight: NonNegativeNumber = 0.1
    eval_every: Count = 100
    eval_blocks: Count = 16
    eval_micro_batch: Count | None = None
    text: list[str] | None = None
    dataset: str | None = None
    eval_text: list[str] | None = None
    eval_dataset: str | None = None
    text_field: str = "text"
    tokenizer: Path | None = None  # None: the teacher's
    seed: Seed = 0
    grad_checkpointing: bool = False
    compile: CompileMode = "auto"  # model/compiled.py: auto compiles where it pays
    teacher_cache: Path | None = None  # train on a teacher cache's top k (teacher_cache.py), not the teacher
    precision: Precision = "auto"
    device: Device = "auto"
    checkpoint_every: Count = 100
    checkpoint_minutes: PositiveNumber = 30.0
    nproc: Count = 1
    fsdp: bool = False
    timeout: Seconds = 600.0
    progress: bool = True
    tensorboard: Path | None = None
    force: bool = False
    max_shard_size: str = "5GB"
    save_dtype: SaveDType = "auto"
    plan: bool = False
    plan_world: Count | None = None
    plan_memory: str | None = None


def check_config(cfg: DistillConfig) -> None:
    positive = ("steps", "seq_len", "micro_batch", "grad_accum", "eval_every", "eval_blocks", "checkpoint_every",
                "nproc")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be at least 1")
    for name in ("warmup", "weight_decay", "clip", "ce_weight"):
        if not getattr(cfg, name) >= 0:
            raise UserError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= 0")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise UserError(f"--lr {cfg.lr}: must be a positive number")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise UserError(f"--min-lr-ratio {cfg.min_lr_ratio}: must be in [0, 1]")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be in [0, 1)")
    if cfg.eval_micro_batch is not None and cfg.eval_micro_batch < 1:
        raise UserError(f"--eval-micro-batch {cfg.eval_micro_batch}: must be at least 1")
    if cfg.compile not in ("auto", "on", "off", True, False):  # bools: the Python API's older flag
        raise UserError(f"--compile {cfg.compile!r}: must be auto, on or off")
    if cfg.fsdp and cfg.compile in ("on", True):  # auto stays eager under --fsdp
        raise UserError("--compile on with --fsdp: not supported (torch.compile over FSDP2 modules is untested); "
                        "drop one")
    if cfg.fsdp and cfg.teacher_cache is not None:
        raise UserError("--teacher-cache with --fsdp: not supported yet (the cached path is untested sharded); drop one")


def lr_factor(i: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the base lr for optimizer step i + 1 (i = steps done): linear warm-up to 1,
    then cosine decay reaching min_ratio at the last step."""
    if i < warmup:
        return (i + 1) / warmup
    progress = min(1.0, (i + 1 - warmup) / max(1, steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


# -- setup ---------------------------------------------------------------------------------------
class Student(torch.nn.Module):
    """The student and the loss as one module, so DDP/FSDP/compile wrap all of it; FSDP needs the
    LM head used inside the root's forward, where its weight is gathered. The teacher's head is
    the same frozen tensor (FROZEN: shared, never trained), so it serves both."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, h_t: torch.Tensor | None, targets: torch.Tensor, ce_weight: float,
                top: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (loss, kl, ce) sums; `top`: a teacher cache's (top_ids, top_logp, tail_logp) of these
        blocks instead of the teacher's h_t: the top-k KL + tail (losses.topk_kl_ce_sums)."""
        from dtpshard.training.losses import kl_ce_sums, topk_kl_ce_sums

        w = self.model.lm_head_weight
        if top is not None:
            return topk_kl_ce_sums(self.model.hidden(ids), w, *top, targets, ce_weight)
        return kl_ce_sums(self.model.hidden(ids), w, h_t, None if h_t is None else w, targets, ce_weight)


class Teacher(torch.nn.Module):
    """The frozen dense teacher's LM-head input, h [B, T, D], as a module's forward (FSDP's root)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.hidden(ids)


def save_dtype(cfg: DistillConfig, ckpt: Any) -> torch.dtype:
    """The dtype the student is saved in: --save-dtype, or (auto) the teacher's, as transformers'
    dtype="auto" reads it (a bf16 teacher gives a bf16 student)."""
    from dtpshard.model.hf import DTYPE_NAMES, resolve_dtype

    if cfg.save_dtype != "auto":
        return DTYPE_NAMES[cfg.save_dtype]
    return resolve_dtype("auto", ckpt.hf_config, ckpt.files.stored_dtype())


def train_blocks_for(cfg: DistillConfig, world: int, tokenizer: Any) -> tuple[torch.Tensor, str]:
    """All training blocks of the run, in training order: [steps × global batch, seq_len + 1]."""
    n = cfg.steps * cfg.micro_batch * cfg.grad_accum * world
    from dtpshard.training.evaluate import source_blocks

    from dtpshard.model.checkpoint import check_token_ids, read_shape

    blocks, source = source_blocks(tokenizer, cfg.text, cfg.dataset, "train", cfg.seq_len, n, cfg.text_field,
                                   seed=cfg.seed, shuffle=True, repeat=True)
    check_token_ids(blocks, read_shape(cfg.teacher).vocab, cfg.tokenizer or cfg.teacher)
    return blocks, source


def resolve(cfg: DistillConfig) -> DistillConfig:
    """Defaults that depend on inputs (L, δ and stage3 by core.settings.resolve_dtp: the flags,
    else the layout's, else the defaults), absolute paths."""
    from dtpshard.core.layout import Layout
    from dtpshard.core.settings import resolve_dtp
    from dtpshard.model.checkpoint import read_shape

    shape = read_shape(cfg.teacher)  # config.json alone
    layout = Layout.load(cfg.layout) if cfg.layout is not None else None
    if layout is not None:
        layout.check_model(shape, where=f"layout {cfg.layout}")
    dtp = resolve_dtp(shape, devices=cfg.devices, delay=cfg.delay, stage3=cfg.stage3, layout=layout,
                      where=f"layout {cfg.layout}")
    absolute = lambda p: None if p is None else str(Path(p).absolute())  # noqa: E731
    return dataclasses.replace(
        cfg, teacher=Path(cfg.teacher).absolute(), out=Path(cfg.out).absolute(),
        layout=None if cfg.layout is None else Path(cfg.layout).absolute(), devices=dtp.devices, delay=dtp.delay,
        stage3=dtp.stage3,
        tokenizer=None if cfg.tokenizer is None else Path(cfg.tokenizer).absolute(),
        tensorboard=None if cfg.tensorboard is None else Path(cfg.tensorboard).absolute(),
        teacher_cache=None if cfg.teacher_cache is None else Path(cfg.teacher_cache).absolute(),
        text=None if cfg.text is None else [absolute(p) for p in cfg.text],
        eval_text=None if cfg.eval_text is None else [absolute(p) for p in cfg.eval_text])


def run_config(cfg: DistillConfig, shape: Any, layout: Any, world: int, device: str,
               train: torch.Tensor, train_src: str, ev: torch.Tensor, eval_src: str,
               cache: Any = None) -> dict[str, Any]:
    """config.json: every DistillConfig field plus what was derived from the inputs."""
    out = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()}
    G = cfg.micro_batch * cfg.grad_accum * world
    out.update({
        "format": FORMAT, "model": shape.to_dict(),
        "layout_kind": "contiguous (no layout file)" if layout is None else layout.kind,
        "layout_sha256": None if layout is None else layout.content_sha256(),
        "world_size": world, "global_batch": G, "tokens_per_step": G * cfg.seq_len,
        "device_type": torch.device(device).type,
        "train_data": train_src, "train_blocks": int(train.shape[0]), "train_data_sha256": _sha(train.numpy().tobytes()),
        "eval_data": eval_src, "eval_data_sha256": _sha(ev.numpy().tobytes()),
        "teacher_cache_id": None if cache is None else cache.identity(),
        "torch": torch.__version__,
    })
    return json.loads(json.dumps(out))  # compared with a config.json read back: same types


def compared_keys() -> list[str]:
    fields = [f.name for f in dataclasses.fields(DistillConfig) if f.name not in OPERATIONAL]
    return fields + list(DERIVED_COMPARED)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
