"""Held-out evaluation (docs/design.md §4): perplexity, and KL(teacher ‖ student) in nats per token.

A block holds seq_len + 1 tokens: the models read the first seq_len and every position is
scored against the next token, so a block gives seq_len positions. Logits are never
materialised for a whole batch (see losses.py).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from dtpshard.core.devices import pick_device
from dtpshard.core.errors import UserError, check_result
from dtpshard.core.family import head_weight
from dtpshard.core.settings import NO_FLAGS, DTPFlags
from dtpshard.core.shape import shape_from_hf_config
from dtpshard.data.blocks import load_texts, make_blocks
from dtpshard.model.checkpoint import Checkpoint, check_token_ids, load_tokenizer, read_shape
from dtpshard.model.dtp import DTPModel
from dtpshard.training import losses
from dtpshard.training.precision import autocast_for


def hidden_and_head(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [B, T, D], the LM head's matrix [V, D] with its logit transform: core/family.py
    head_weight) of a DTPModel or of a transformers causal LM."""
    if hasattr(model, "head_weight"):
        return model.hidden(ids), model.head_weight
    scaling = shape_from_hf_config(model.config).logits_scaling
    return model.model(ids).last_hidden_state, head_weight(model.get_output_embeddings().weight, scaling)


@torch.no_grad()
def eval_sums(student: torch.nn.Module, teacher: torch.nn.Module | None, blocks: torch.Tensor,
              micro_batch: int, precision: str = "auto") -> torch.Tensor:
    """[kl_sum, ce_sum, top1_sum, positions] in float64 over blocks [n, seq_len + 1] (summable across ranks)."""
    dev = next(student.parameters()).device
    sums = torch.zeros(4, dtype=torch.float64)
    was = student.training
    student.eval()
    try:
        for a in range(0, blocks.shape[0], micro_batch):
            b = blocks[a:a + micro_batch].to(dev)
            ids, tgt = b[:, :-1], b[:, 1:]
            with autocast_for(dev, precision):
                h_s, w_s = hidden_and_head(student, ids)
                h_t, w_t = hidden_and_head(teacher, ids) if teacher is not None else (None, None)
                scores = losses.eval_sums(h_s, w_s, h_t, w_t, tgt)
            sums += torch.cat([scores.cpu(), torch.tensor([tgt.numel()], dtype=torch.float64)])
    finally:
        student.train(was)
    return sums


def summarise(sums: torch.Tensor, with_teacher: bool) -> dict[str, Any]:
    """{"kl": nats/token, "ppl", "top1": the share of positions where the student's argmax is the
    teacher's, "tokens"} of eval_sums' sums (kl and top1 None without a teacher)."""
    kl, ce, top1, n = (float(v) for v in sums)
    if n == 0:
        raise UserError("no evaluation positions (empty evaluation set)")
    return {"kl": kl / n if with_teacher else None, "ppl": math.exp(ce / n),
            "top1": top1 / n if with_teacher else None, "tokens": int(n)}


def evaluate(student: torch.nn.Module, teacher: torch.nn.Module | None, blocks: torch.Tensor,
             micro_batch: int = 4, precision: str = "auto") -> dict[str, Any]:
    """{"kl": nats/token, "ppl": exp(mean CE), "top1": agreement with the teacher's argmax (kl and
    top1 None without a teacher), "tokens": positions}."""
    if blocks.ndim != 2 or blocks.shape[1] < 2:
        raise UserError(f"evaluation blocks must be [n, seq_len + 1] with seq_len >= 1, got {list(blocks.shape)}")
    if micro_batch < 1:
        raise UserError(f"micro_batch={micro_batch}: must be at least 1")
    return summarise(eval_sums(student, teacher, blocks, micro_batch, precision), teacher is not None)


def source_blocks(tok: Any, text: list[str] | None, dataset: str | None, role: str, seq_len: int, n: int,
                  text_field: str = "text", **kw: Any) -> tuple[torch.Tensor, str]:
    """n blocks of seq_len + 1 tokens of --text or --dataset, by default the offline corpus (no hub
    attempt: with `datasets` installed and no network that is half a minute of retries)."""
    texts = load_texts(text, dataset, role=role, text_field=text_field)
    return make_blocks(tok, texts, seq_len + 1, n, **kw), texts.source


def eval_blocks_for(model: Path | Checkpoint, text: list[str] | None = None, dataset: str | None = None,
                    blocks: int = 16, seq_len: int = 1024, tokenizer: Any = None,
                    text_field: str = "text", named: str | Path | None = None) -> tuple[torch.Tensor, str]:
    """The first `blocks` held-out blocks [blocks, seq_len + 1] (role "eval": disjoint from every
    calibration and training block); default the offline corpus. `model`: its directory, or the
    checkpoint already open; `named`: the directory `tokenizer` came from (default the model's)."""
    tok = tokenizer if tokenizer is not None else load_tokenizer(model)
    ev, source = source_blocks(tok, text, dataset, "eval", seq_len, blocks, text_field, shuffle=False)
    shape = model.shape if isinstance(model, Checkpoint) else read_shape(model)
    where = named or (model.path if isinstance(model, Checkpoint) else model)
    check_token_ids(ev, shape.vocab, where)
    return ev, source


# -- `dtpshard eval`'s work (the command: dtpshard/commands/training.py) ---------------------------
def evaluate_model(model: Path, dtp: DTPFlags = NO_FLAGS, *, layout: Path | None = None, teacher: Path | None = None,
                   text: list[str] | None = None, dataset: str | None = None, text_field: str = "text",
                   tokenizer: Path | None = None, blocks: int = 16, seq_len: int = 1024, micro_batch: int = 4,
                   device: str = "auto", precision: str = "auto", compile: bool = False) -> dict[str, Any]:
    """Perplexity of MODEL as L devices with delay δ and, with a teacher, KL(teacher ‖ model) and
    top-1 agreement, on held-out blocks -> {ppl, kl, top1, tokens, devices, delay, stage3, ...}."""
    if blocks < 1 or seq_len < 1 or micro_batch < 1:
        raise UserError(f"--blocks {blocks}, --seq-len {seq_len}, --micro-batch {micro_batch}: each must be >= 1")
    if layout is not None and (Path(model) / "distill.json").is_file():
        raise UserError(f"{model} is a distilled student whose weights are already permuted: drop --layout")
    dev = pick_device(device)
    # fp32 weights whatever the checkpoint's dtype: bf16-mixed runs under autocast
    student = DTPModel.from_pretrained(model, dtp.devices, dtp.delay, dtype=torch.float32, layout=layout,
                                       stage3=dtp.stage3, device=dev)
    dense = None
    if teacher is not None:
        dense = DTPModel.from_pretrained(teacher, devices=1, delay=0, dtype=torch.float32, device=dev)
        if dense.shape != student.shape:
            raise UserError(f"teacher {teacher} has another shape than {model}: "
                            f"{'; '.join(dense.shape.differences(student.shape))}")
    ev, source = eval_blocks_for(student.checkpoint, text=text, dataset=dataset, blocks=blocks, seq_len=seq_len,
                                 tokenizer=student.checkpoint.tokenizer(tokenizer), text_field=text_field,
                                 named=tokenizer)
    if compile:
        for net in (student, dense):
            if net is not None:  # evaluation reads h, the LM head's input, so compile that
                net.hidden = torch.compile(net.hidden)
    result = evaluate(student, dense, ev, micro_batch, precision)
    check_result({k: result[k] for k in ("ppl", "kl", "top1")}, str(model))
    result.update({"model": str(model), **student.dtp_settings(), "layout": None if layout is None else str(layout),
                   "teacher": None if teacher is None else str(teacher), "blocks": int(ev.shape[0]),
                   "seq_len": int(ev.shape[1] - 1), "data": source})
    return result
