"""Greedy or sampled decoding with the DTP model's KV cache, and `dtpshard generate`."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from dtpshard.core.devices import pick_device
from dtpshard.core.errors import UserError


def _logits(out) -> torch.Tensor:
    return getattr(out, "logits", out)  # DTPModel returns an output object, the runtime's ranks a tensor


def _sample_filter(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' top-k then top-p (nucleus) warpers: the rest of the vocabulary gets -inf."""
    if top_k > 0:
        kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1)  # ascending, as transformers' TopPLogitsWarper
        drop = sorted_scores.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False  # keep at least the most likely token
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return scores


@torch.no_grad()
def generate_ids(model: torch.nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, seed: int | None = 0, eos_id: int | list[int] | None = None, *, top_p: float = 1.0,
                 attention_mask: torch.Tensor | None = None, pad_id: int | None = None) -> torch.Tensor:
    """prompt_ids [B, T] -> [B, T + new]. Prefill once, then one token at a time from the cache.

    Greedy at temperature 0, else sampled (top-k, then top-p) with a generator seeded by `seed`
    (None: torch's global RNG). A row that emitted an EOS token gets `pad_id` (default the first
    EOS id) after it; decoding stops when every row has. `attention_mask` [B, T]: left padding."""
    if not 0 < top_p <= 1:
        raise UserError(f"top_p={top_p}: must be in (0, 1]")
    g = None if seed is None or temperature <= 0 else torch.Generator(device=prompt_ids.device).manual_seed(seed)
    eos = torch.tensor([] if eos_id is None else [eos_id] if isinstance(eos_id, int) else list(eos_id),
                       dtype=torch.long, device=prompt_ids.device)
    pad = pad_id if pad_id is not None else (int(eos[0]) if len(eos) else 0)
    done = torch.zeros(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
    cache = model.new_cache()
    mask = None if attention_mask is None else attention_mask.to(prompt_ids.device).long()
    kw = {} if mask is None else {"attention_mask": mask}
    ids = prompt_ids
    logits = _logits(model(prompt_ids, cache=cache, logits_to_keep=1, **kw))[:, -1]
    for _ in range(max_new_tokens):
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            scores = _sample_filter(logits.float() / temperature, top_k, top_p)
            nxt = torch.multinomial(scores.softmax(-1), 1, generator=g)
        nxt = torch.where(done[:, None], torch.full_like(nxt, pad), nxt)
        ids = torch.cat([ids, nxt], dim=1)
        done |= torch.isin(nxt[:, 0], eos)
        if bool(done.all()):
            break
        if mask is not None:
            kw["attention_mask"] = mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        logits = _logits(model(nxt, cache=cache, logits_to_keep=1, **kw))[:, -1]
    return ids


def generate_cmd(model: Path, *, prompt: str, devices: int | None = None, delay: float | None = None,
                 layout: Path | None = None, max_new_tokens: int = 40, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stage3: Literal["sqrt", "one"] | None = None,
                 dtype: Literal["auto", "float32", "bfloat16"] = "auto", device: str = "auto",
                 tokenizer: Path | None = None, compile: bool = False, json: bool = False) -> int:
    """Print a continuation of PROMPT from the DTP form of MODEL (greedy unless --temperature > 0).
    The same tokens as `DTPModel.from_pretrained(MODEL).generate(ids, max_new_tokens, do_sample=
    temperature > 0, temperature=..., top_k=..., top_p=..., seed=...)`.

    Args:
        model: Hugging Face checkpoint directory (or a distilled student's directory)
        prompt: the text to continue
        devices: L, the number of (simulated) devices; default from the student's recorded settings, else 4
        delay: δ, in modules (fractional allowed); 0 is tensor parallelism; default the student's, else 1
        layout: a layout JSON to apply before sharding
        max_new_tokens: how many tokens to generate
        temperature: 0 for greedy decoding, else the sampling temperature
        top_k: sample only among the k most likely tokens (0: all)
        top_p: sample only from the smallest set of tokens whose probability reaches p (1: all)
        seed: sampling seed
        stage3: own-partial scale for the last δ modules: sqrt (√L, the spec) or one
        dtype: weights and activations; auto keeps the checkpoint's (as transformers)
        device: cpu, cuda, or auto
        tokenizer: tokenizer directory, where MODEL has no tokenizer files
        compile: torch.compile the model's forward (pays a compile, then decodes faster on long runs)
        json: print one JSON object {text, completion, new_token_ids, ...} instead of the text
    """
    import json as _json

    from dtpshard.model.checkpoint import load_tokenizer
    from dtpshard.model.dtp import DTPModel

    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens}: must be at least 1")
    if temperature < 0:
        raise UserError(f"temperature={temperature}: must be >= 0")
    dev = pick_device(device)
    net = DTPModel.from_pretrained(model, devices, delay, dtype=dtype, layout=layout, stage3=stage3,
                                   device=dev).eval()
    tok = load_tokenizer(tokenizer or model)
    if compile:
        net.compile()
    ids = tok(prompt, return_tensors="pt").input_ids.to(dev)
    if ids.shape[1] == 0:
        raise UserError("the prompt encodes to no tokens")
    eos = net.config.eos_token_id if net.config.eos_token_id is not None else tok.eos_token_id
    out = net.generate(ids, max_new_tokens, do_sample=temperature > 0, temperature=temperature, top_k=top_k,
                       top_p=top_p, seed=seed, eos_token_id=eos)
    new = out[0, ids.shape[1]:]
    completion = tok.decode(new, skip_special_tokens=True)
    if json:
        print(_json.dumps({"model": str(model), **net.dtp_settings(), "dtype": str(net.dtype).removeprefix("torch."),
                           "prompt": prompt, "completion": completion, "text": prompt + completion,
                           "prompt_ids": ids[0].tolist(), "new_token_ids": new.tolist()}))
    else:
        print(prompt + completion)
    return 0
