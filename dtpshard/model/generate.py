"""Generating from the DTP model, given a prompt: the prompt's ids checked once for every generator
(`generate` here, `run` across processes), and a continuation (decoding is in decode.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dtpshard.core.errors import UserError
from dtpshard.core.settings import NO_FLAGS, DTPFlags
from dtpshard.core.shape import check_context
from dtpshard.model.checkpoint import Checkpoint, check_token_ids
from dtpshard.model.dtp import DTPModel


def prompt_ids(ckpt: Checkpoint, prompt: str, tokenizer: Path | None, max_new_tokens: int) -> tuple[Any, torch.Tensor]:
    """(tokenizer, ids [1, T]) of a prompt for the model of `ckpt`: refused when it encodes to
    nothing, to ids the model has no embedding for, or past the model's context."""
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens}: must be at least 1")
    tok = ckpt.tokenizer(tokenizer)
    ids = tok(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise UserError("the prompt encodes to no tokens")
    check_token_ids(ids, ckpt.shape.vocab, tokenizer or ckpt.path)
    check_context(ckpt.hf_config, ids.shape[1], max_new_tokens)
    return tok, ids


def generate_text(model: Path, prompt: str, dtp: DTPFlags = NO_FLAGS, *, layout: Path | None = None,
                  max_new_tokens: int = 40, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int = 0, dtype: str = "auto", device: str = "cpu", tokenizer: Path | None = None,
                  compile: bool = False) -> dict[str, Any]:
    """A continuation of `prompt` from the DTP form of `model`: {prompt, completion, text,
    prompt_ids, new_token_ids, devices, delay, stage3, dtype, ...}. Greedy unless temperature > 0;
    the tokens of DTPModel.generate with the same arguments."""
    if temperature < 0:
        raise UserError(f"temperature={temperature}: must be >= 0")
    net = DTPModel.from_pretrained(model, dtp.devices, dtp.delay, dtype=dtype, layout=layout, stage3=dtp.stage3,
                                   device=device).eval()
    tok, ids = prompt_ids(net.checkpoint, prompt, tokenizer, max_new_tokens)
    ids = ids.to(device)
    if compile:
        net.compile()
    eos = net.config.eos_token_id if net.config.eos_token_id is not None else tok.eos_token_id
    out = net.generate(ids, max_new_tokens, do_sample=temperature > 0, temperature=temperature, top_k=top_k,
                       top_p=top_p, seed=seed, eos_token_id=eos)
    new = out[0, ids.shape[1]:]
    completion = tok.decode(new, skip_special_tokens=True)
    return {"model": str(model), **net.dtp_settings(), "dtype": str(net.dtype).removeprefix("torch."),
            "prompt": prompt, "completion": completion, "text": prompt + completion,
            "prompt_ids": ids[0].tolist(), "new_token_ids": new.tolist()}
