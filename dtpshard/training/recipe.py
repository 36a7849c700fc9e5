"""Distillation (docs/design.md §4): train the DTP student to match the frozen dense teacher.

The student starts from the teacher's weights permuted by the layout and runs as L devices with
delay δ; the teacher is the same checkpoint run dense. Loss per position: KL(teacher ‖ student)
+ ce_weight·CE(next token), in chunks (losses.py). Embedding and LM head are frozen (they are
shared with the teacher, not copied). One optimizer step sees micro_batch × grad_accum ×
processes blocks of seq_len + 1 tokens; the data order is a pure function of the seed, so a run
is resumable from (weights, optimizer, scheduler, RNG, step) alone.

This file: the models and data of a run and what config.json records; the recipe
(DistillConfig) and the roles of its fields are in settings.py. The loop is in loop.py, the run
directory in rundir.py, the process group in ddp.py, sharding (--fsdp) in fsdp.py, and `distill`
(one process, torchrun or --nproc) with the command in distill.py.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtpshard.core.devices import DTYPES
from dtpshard.core.errors import UserError
from dtpshard.core.io import dumps, short_sha256
from dtpshard.core.layout import Layout
from dtpshard.core.settings import resolve_dtp
from dtpshard.core.shape import shape_from_hf_config
from dtpshard.data.blocks import load_texts
from dtpshard.data.stream import BlockStream
from dtpshard.model.adapters import adapters_off
from dtpshard.model.checkpoint import (
    Checkpoint,
    check_token_ids,
    is_student,
    load_hf_config,
    read_shape,
    student_record,
)
from dtpshard.model.hf import resolve_dtype
from dtpshard.training.losses import eval_sums, kl_ce_sums, stream_distance, topk_kl_ce_sums

# the recipe and a run's settings, defined without torch (the CLI, a study file and the report read them)
from dtpshard.training.settings import (  # noqa: F401
    FORMAT,
    OPERATIONAL,
    Derived,
    DistillConfig,
    Recipe,
    check_config,
    compared_fields,
    compared_keys,
)

FROZEN = ("model.embed_tokens.weight", "lm_head.weight")


def lr_factor(i: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the base lr for optimizer step i + 1 (i = steps done): linear warm-up to 1,
    then cosine decay reaching min_ratio at the last step."""
    if i < warmup:
        return (i + 1) / warmup
    progress = min(1.0, (i + 1 - warmup) / max(1, steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


_sha = short_sha256


# -- setup ---------------------------------------------------------------------------------------
class Student(torch.nn.Module):
    """The student and the loss as one module, so DDP/FSDP/compile wrap all of it; FSDP needs the
    LM head used inside the root's forward, where its weight is gathered. The teacher's head is
    the same frozen tensor (FROZEN: shared, never trained), so it serves both."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, h_t: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                ce_weight: float = 0.0, top: tuple[torch.Tensor, ...] | None = None, evaluate: bool = False,
                teacher: bool = False, streams: list[torch.Tensor] | None = None, logits_weight: float = 1.0,
                streams_weight: float = 0.0) -> Any:
        """-> (loss, kl, ce, stream distance) sums; `top`: a teacher cache's (top_ids, top_logp,
        tail_logp) of these blocks instead of the teacher's h_t: the top-k KL + tail
        (losses.topk_kl_ce_sums). `streams`: the dense teacher's stream after each module, matched
        by every device's (losses.stream_distance); the loss is logits_weight·(KL + ce_weight·CE) +
        streams_weight·distance (training/recipes.py's Phase).
        evaluate: no gradient, [kl, ce, top-1 agreement] sums instead (losses.eval_sums).
        teacher: an adapter run's teacher, h [B, T, D] (with `streams`: and its streams, as
        Teacher's): these weights, adapters off, run dense."""
        if teacher:
            with adapters_off(self.model):
                return run_dense(self.model, ids, streams is not None)
        w = self.model.head_weight  # the LM head with its logit transform (core/family.py)
        if evaluate:
            return eval_sums(self.model.hidden(ids), w, h_t, None if h_t is None else w, targets)
        distance = torch.zeros((), dtype=torch.float32, device=ids.device)
        if streams is None:
            h = self.model.hidden(ids)
        else:
            parts: list[torch.Tensor] = []
            h = self.model.hidden(ids, after=lambda m, x: parts.append(stream_distance(x, streams[m])))
            distance = torch.stack(parts).mean()
        if top is not None:
            loss, kl, ce = topk_kl_ce_sums(h, w, *top, targets, ce_weight)
        else:
            loss, kl, ce = kl_ce_sums(h, w, h_t, None if h_t is None else w, targets, ce_weight)
        if (logits_weight, streams_weight) != (1.0, 0.0):  # the paper's loss stays bit for bit
            loss = logits_weight * loss + streams_weight * distance
        return loss, kl, ce, distance.detach()


def run_dense(model: Any, ids: torch.Tensor, streams: bool) -> Any:
    """The model's weights run dense: h [B, T, D], or with `streams` (h, [its stream [1, B, T, D]
    after each module]) for a recipe's stream matching."""
    if not streams:
        return model.hidden(ids, dense=True)
    kept: list[torch.Tensor] = []
    h = model.hidden(ids, dense=True, after=lambda m, x: kept.append(x))
    return h, kept


class FrozenBase:
    """The teacher of an adapter run: the student's frozen weights with the adapters off, run as
    the dense model. A layout permutes a dense model without changing its function, so that is
    the dense teacher, with no second copy of any weight; it goes through the student's own
    forward (`teacher=True`), where FSDP gathers the student's shards as for training."""

    def __init__(self, net: Student):
        self.net = net

    def __call__(self, ids: torch.Tensor, streams: bool = False) -> Any:
        return self.net(ids, teacher=True, streams=[] if streams else None)


class Teacher(torch.nn.Module):
    """The frozen dense teacher's LM-head input, h [B, T, D], as a module's forward (FSDP's root);
    with `streams`, (h, its streams after each module) as run_dense gives them."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, streams: bool = False) -> Any:
        return run_dense(self.model, ids, streams) if streams else self.model.hidden(ids)


def save_dtype(cfg: DistillConfig, ckpt: Any) -> torch.dtype:
    """The dtype the student is saved in: --save-dtype, or (auto) the teacher's, as transformers'
    dtype="auto" reads it (a bf16 teacher gives a bf16 student)."""
    if cfg.save_dtype != "auto":
        return DTYPES[cfg.save_dtype]
    return resolve_dtype("auto", ckpt.hf_config, ckpt.files.stored_dtype())


def train_blocks_for(cfg: DistillConfig, world: int, tokenizer: Any,
                     ckpt: Checkpoint | None = None) -> tuple[BlockStream, str]:
    """The run's training blocks in training order, steps × global blocks of seq_len + 1 tokens,
    made when a step asks for them (data/stream.py); `ckpt`: the teacher, when it is open already."""
    n = cfg.steps * cfg.micro_batch * cfg.grad_accum * world
    texts = load_texts(cfg.text, cfg.dataset, role="train", text_field=cfg.text_field)
    vocab = (read_shape(cfg.teacher) if ckpt is None else ckpt.shape).vocab
    stream = BlockStream(tokenizer, texts, cfg.seq_len + 1, n, cfg.seed,
                         check=lambda blocks: check_token_ids(blocks, vocab, cfg.tokenizer or cfg.teacher))
    return stream, texts.source


def resolve(cfg: DistillConfig, hf_config: Any = None, layout: Layout | None = None) -> DistillConfig:
    """Defaults that depend on inputs (L, δ and stage3 by core.settings.resolve_dtp: the flags,
    else a student teacher's record, else the layout's, else the defaults), absolute paths.
    `hf_config` and `layout`: the teacher's config and the layout when they are read already (else
    config.json alone, and the layout file)."""
    hf_config = load_hf_config(cfg.teacher) if hf_config is None else hf_config
    shape = shape_from_hf_config(hf_config)
    record = student_record(Path(cfg.teacher), hf_config) if is_student(hf_config) else None
    if layout is None and cfg.layout is not None:
        layout = Layout.load(cfg.layout)
    if layout is not None:
        layout.check_model(shape, where=f"layout {cfg.layout}")
    dtp = resolve_dtp(shape, devices=cfg.devices, delay=cfg.delay, stage3=cfg.stage3, delayed=cfg.delayed,
                      record=record, layout=layout, where=f"layout {cfg.layout}")
    if cfg.adapters is not None:
        from dtpshard.core.adapters import check_adapters

        if record is not None:  # the frozen weights run dense are the teacher: they must be a dense model's
            raise UserError(f"--adapters with {cfg.teacher}: a DTP student is not a dense teacher (its weights run "
                            "dense are not the function it was distilled to); give the dense checkpoint")
        check_adapters(cfg.adapter_settings, shape)

    def absolute(p: str | Path) -> str:
        return str(Path(p).absolute())

    return dataclasses.replace(
        cfg, teacher=Path(cfg.teacher).absolute(), out=Path(cfg.out).absolute(),
        layout=None if cfg.layout is None else Path(cfg.layout).absolute(), devices=dtp.devices, delay=dtp.delay,
        stage3=dtp.stage3, delayed=None if dtp.delayed is None else list(dtp.delayed),
        tokenizer=None if cfg.tokenizer is None else Path(cfg.tokenizer).absolute(),
        tensorboard=None if cfg.tensorboard is None else Path(cfg.tensorboard).absolute(),
        teacher_cache=None if cfg.teacher_cache is None else Path(cfg.teacher_cache).absolute(),
        text=None if cfg.text is None else [absolute(p) for p in cfg.text],
        eval_text=None if cfg.eval_text is None else [absolute(p) for p in cfg.eval_text])


def layout_as_run(layout: Any, cfg: DistillConfig) -> Any:
    """The layout with the delayed set `cfg` resolved (--delayed over the layout's own set): what the
    run records, so that its hash covers the set the student delays."""
    ran = None if cfg.delayed is None else tuple(cfg.delayed)
    return layout if layout is None or layout.delayed == ran else dataclasses.replace(layout, delayed=ran)


def run_config(cfg: DistillConfig, shape: Any, layout: Any, world: int, device: str,
               train: BlockStream, train_src: str, ev: torch.Tensor, eval_src: str,
               cache: Any = None) -> dict[str, Any]:
    """config.json: every DistillConfig field plus what was derived from the inputs (Derived)."""
    out = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()}
    G = cfg.micro_batch * cfg.grad_accum * world
    if layout is not None and layout.shared:  # the student's shape: the layout's shared neurons (docs/design.md §6)
        shape = dataclasses.replace(shape, shared=layout.shared)
    out.update(dataclasses.asdict(Derived(
        model=shape.to_dict(),
        layout_kind="contiguous (no layout file)" if layout is None else layout.kind,
        layout_sha256=None if layout is None else layout.content_sha256(),
        world_size=world, global_batch=G, tokens_per_step=G * cfg.seq_len,
        device_type=torch.device(device).type,
        train_data=train_src, train_blocks=len(train), train_data_sha256=train.fingerprint(),
        eval_data=eval_src, eval_data_sha256=_sha(ev.numpy().tobytes()),
        teacher_cache_id=None if cache is None else cache.identity(),
        torch=torch.__version__, threads=torch.get_num_threads())))
    return json.loads(dumps(out))  # compared with a config.json read back: same types (and nulls)


def rng_state() -> dict[str, Any]:
    """Every generator's state in types torch.load(weights_only=True) reads back (training/trust.py):
    numpy's Mersenne Twister key as an int64 tensor, not an ndarray."""
    kind, key, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": [kind, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    kind, key, pos, has_gauss, cached = s["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(s["python"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
