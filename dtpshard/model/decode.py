"""Decoding with the KV cache: prefill once, then one token at a time (greedy, or sampled with
transformers' top-k then top-p filtering). Used by DTPModel.generate, `dtpshard generate` and
the runtime's ranks; knows nothing of how the model is built."""
from __future__ import annotations

from typing import Any

import torch

from dtpshard.core.errors import UserError
from dtpshard.model.finite import check_logits


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


def _tempered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampling scores: logits / temperature (transformers' order of operations), filtered.
    At a temperature so small that the quotient overflows (inf, then NaN in the softmax) they are
    its T -> 0 limit instead: 0 for each row's most likely tokens, -inf for the rest, which is
    greedy decoding (a tie shared at random)."""
    scores = logits.float() / temperature
    if not bool(torch.isfinite(scores).all()):
        top = logits.float().amax(-1, keepdim=True)
        scores = torch.zeros_like(scores).masked_fill(logits.float() < top, float("-inf"))
    return _sample_filter(scores, top_k, top_p)


@torch.no_grad()
def generate_ids(model: torch.nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, seed: int | None = 0, eos_id: int | list[int] | None = None, *, top_p: float = 1.0,
                 attention_mask: torch.Tensor | None = None, pad_id: int | None = None,
                 config: Any = None) -> torch.Tensor:
    """prompt_ids [B, T] -> [B, T + new]. Prefill once, then one token at a time from the cache.

    Greedy at temperature 0, else sampled (top-k, then top-p) with a generator seeded by `seed`
    (None: torch's global RNG). A row that emitted an EOS token gets `pad_id` (default the first
    EOS id) after it; decoding stops when every row has. `attention_mask` [B, T]: left padding.
    Every step's logits must be finite (model/finite.py names `config`'s likeliest culprit;
    default the model's own config)."""
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
    config = config if config is not None else getattr(model, "hf_config", None)
    logits = _logits(model(prompt_ids, cache=cache, logits_to_keep=1, **kw))[:, -1]
    for _ in range(max_new_tokens):
        check_logits(logits, config)  # a NaN's argmax is token 0: never reported as tokens
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(_tempered(logits, temperature, top_k, top_p).softmax(-1), 1, generator=g)
        nxt = torch.where(done[:, None], torch.full_like(nxt, pad), nxt)
        ids = torch.cat([ids, nxt], dim=1)
        done |= torch.isin(nxt[:, 0], eos)
        if bool(done.all()):
            break
        if mask is not None:
            kw["attention_mask"] = mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        logits = _logits(model(nxt, cache=cache, logits_to_keep=1, **kw))[:, -1]
    return ids
