"""A dtpshard model as lm-eval's language model: the student's own forward (its L, δ and delayed
set), scored as lm-eval's Hugging Face model (HFLM) scores any causal LM.

The request handling is lm-eval's (TemplateLM: the context/continuation split, the empty-context
prefix token); what is written here is only what HFLM does in its own methods, kept equal so that
a choice made here is the choice lm-eval's command line makes on the same model loaded with
`trust_remote_code` (tests/test_downstream.py): tokens encoded as HFLM encodes them, the input
truncated on the left to the model's length, the continuation's log-probabilities summed, and
`is_greedy` when every continuation token is the argmax. Only multiple-choice scoring
(loglikelihood) is offered: every task here is one.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm


def language_model(model: Any, tokenizer: Any, max_length: int, tokens_per_batch: int = 1024,
                   autocast: Callable[[], Any] = contextlib.nullcontext) -> Any:
    """lm-eval's LM over a DTPModel `model` and its transformers `tokenizer`; its forwards run
    under `autocast()` (training/precision.py's, for bf16-mixed)."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix

    class DTPLM(TemplateLM):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.tokenizer = model, tokenizer
            self.max_length = max_length
            self.tokens_per_batch = tokens_per_batch

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_token_id

        @property
        def prefix_token_id(self) -> int:  # HFLM's: BOS where the tokenizer has one, else EOS
            bos = self.tokenizer.bos_token_id
            return bos if bos is not None else self.tokenizer.eos_token_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw: Any) -> list[int]:
            special = _add_special_kwargs(add_special_tokens, None)
            if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
                special["add_special_tokens"] = False
            return self.tokenizer.encode(string, **special)

        def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kw: Any) -> list:
            with autocast():
                return continuation_scores(self.model, [(c, x) for _, c, x in requests], self.max_length,
                                           self.tokens_per_batch, disable_tqdm)

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list:
            raise NotImplementedError("dtpshard evaluates multiple-choice tasks only")

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list:
            raise NotImplementedError("dtpshard evaluates multiple-choice tasks only")

    return DTPLM()


def shared_contexts(pairs: list[tuple[list[int], list[int]]], max_length: int
                    ) -> tuple[dict[tuple[int, ...], list[int]], list[tuple[list[int], list[int]]]]:
    """HFLM's input of each pair cut at the continuation: ({context run once: the pairs' indices that
    share it}, per pair (its input after the context, its continuation tokens))."""
    groups: dict[tuple[int, ...], list[int]] = {}
    rows = []
    for i, (context, continuation) in enumerate(pairs):
        inp = (context + continuation)[-(max_length + 1):][:-1]
        cont = continuation[-len(inp):]
        first = len(inp) - len(cont)  # the position that predicts the continuation's first token
        rows.append((inp[first:], cont))
        groups.setdefault(tuple(inp[:first]), []).append(i)
    return groups, rows


@torch.no_grad()
def continuation_scores(model: Any, pairs: list[tuple[list[int], list[int]]], max_length: int,
                        tokens_per_batch: int = 1024, quiet: bool = False) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), whether every continuation token is the argmax) of
    each (context tokens, continuation tokens), in order. The input is HFLM's: the last
    max_length + 1 tokens less the final one. The choices of one item share their context: it is
    run once into a KV cache (left-padded beside other items' contexts, padding masked), and the
    choices' own tokens after it, right-padded in one batch (a causal model's scores of real
    positions do not see the padding after them). A forward of a few tokens costs as much as
    reading every weight, so many items go through each forward."""
    groups, rows = shared_contexts(pairs, max_length)
    order = sorted(groups, key=lambda p: (-len(p), p))  # similar lengths together: little padding
    out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
    dev = next(model.parameters()).device
    was = model.training
    model.eval()
    try:
        with tqdm(total=len(rows), desc="scoring choices", unit="choice", disable=quiet, leave=False) as bar:
            start = 0
            while start < len(order):
                batch, width = [], 0
                for prefix in order[start:]:
                    w = max(width, len(prefix))
                    if batch and ((len(batch) + 1) * w > tokens_per_batch or bool(prefix) != bool(batch[0])):
                        break
                    batch.append(prefix)
                    width = w
                members = [(g, i) for g, p in enumerate(batch) for i in groups[p]]
                _score(model, batch, [(g, rows[i]) for g, i in members], dev, out, [i for _, i in members],
                       tokens_per_batch)
                bar.update(len(members))
                start += len(batch)
    finally:
        model.train(was)
    return out


def _score(model: Any, prefixes: list[tuple[int, ...]], rows: list, dev: Any, out: list, where: list[int],
           tokens_per_batch: int) -> None:
    """Score `rows` [(its prefix's index, (input, continuation))] after `prefixes` (all empty, or
    none): the contexts in one forward, then the choices in forwards of similar length."""
    cache, mask = None, None
    if prefixes[0]:
        width = max(len(p) for p in prefixes)
        ids = torch.zeros(len(prefixes), width, dtype=torch.long)
        mask = torch.zeros(len(prefixes), width, dtype=torch.long)
        for g, p in enumerate(prefixes):  # left-padded: every context ends where its choices begin
            ids[g, width - len(p):] = torch.tensor(p)
            mask[g, width - len(p):] = 1
        cache = model.new_cache()
        model.hidden(ids.to(dev), cache, attention_mask=mask.to(dev))
    chunk: list[int] = []
    for b in sorted(range(len(rows)), key=lambda b: len(rows[b][1][0])):  # ascending: the last is the widest
        if chunk and (len(chunk) + 1) * len(rows[b][1][0]) > tokens_per_batch:
            _choices(model, cache, mask, [rows[c] for c in chunk], [where[c] for c in chunk], dev, out)
            chunk = []
        chunk.append(b)
    _choices(model, cache, mask, [rows[c] for c in chunk], [where[c] for c in chunk], dev, out)


def _choices(model: Any, context: Any, mask: torch.Tensor | None, rows: list, where: list[int], dev: Any,
             out: list) -> None:
    """One forward of choices after their contexts' cache (None: no context)."""
    cache = None
    if context is not None:
        pick = torch.tensor([g for g, _ in rows], device=dev)
        cache = model.new_cache()
        for slot, full in zip(cache.slots, context.slots):  # [L*G, ...] device-major -> [L*R, ...]
            slot.kv = tuple(t.unflatten(0, (-1, mask.shape[0])).index_select(1, pick).flatten(0, 1) for t in full.kv)
        mask = mask.index_select(0, pick.cpu())
    width = max(len(r[0]) for _, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for b, (_, (inp, _)) in enumerate(rows):
        ids[b, :len(inp)] = torch.tensor(inp)
    if mask is not None:
        mask = torch.cat([mask, torch.ones(len(rows), width, dtype=torch.long)], dim=1).to(dev)
    h = model.hidden(ids.to(dev), cache, attention_mask=mask)
    # One LM head over every row's real positions: a head of a few rows at a time runs far below the
    # matmul's rate (the vocabulary's weight is read again for each row).
    lengths = [len(inp) for _, (inp, _) in rows]
    real = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    logp = torch.log_softmax(model.logits(h[real.to(dev)]).float(), dim=-1)
    target = torch.tensor([t for _, (_, cont) in rows for t in cont], device=dev)
    picked = logp.gather(1, target[:, None])[:, 0]
    greedy = picked >= logp.amax(-1)  # a pass of amax, and argmax (first index of a tie) only where it may be
    top = greedy.nonzero()[:, 0]
    greedy[top] = logp[top].argmax(-1) == target[top]
    picked, greedy = picked.split(lengths), greedy.split(lengths)
    for b in range(len(rows)):
        out[where[b]] = (float(picked[b].sum()), bool(greedy[b].all()))
