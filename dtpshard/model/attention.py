"""The attention core shared by the single-process model (dtp.py) and the runtime's ranks
(dtpshard.runtime.ranks): append the new keys and values to a KV cache, expand the KV groups to
their query heads (on the CPU, sdpa's enable_gqa does it without copies), and scaled dot-product attention, causal over cache + new positions."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# sdpa's enable_gqa exists from torch 2.5, and the CPU flash kernel handles grouped queries itself
# from 2.9 (before, it falls back to the math kernel, which builds the whole T x T score matrix)
_CPU_GQA = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 9)


def _gqa(on: bool) -> dict:
    return {"enable_gqa": True} if on else {}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads_per_group: int,
           past: "tuple[torch.Tensor, torch.Tensor] | None" = None,
           mask: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple]:
    """q [N, H, T, hd], k and v [N, G, T, hd] (rotary already applied), past (k, v) [N, G, P, hd]
    or None -> (o [N, H, T, hd], the cache entry (k, v) [N, G, P + T, hd]). Query t sees the
    P cached positions and new positions up to t; H = G · heads_per_group. `mask` (boolean,
    broadcastable to [N, H, T, P + T], True = attend) replaces that causal rule, e.g. for left
    padding; the caller builds it causal."""
    cached = 0
    if past is not None:
        cached = past[0].shape[2]
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    # On the CPU, sdpa attends grouped queries without copying k and v per query head; on CUDA
    # enable_gqa is not supported by every kernel (a math fallback would cost more than the copy).
    # enable_gqa is passed only when True, so older torch (no such argument) keeps working.
    T = q.shape[2]
    r = heads_per_group
    gqa = r > 1 and q.device.type == "cpu" and _CPU_GQA
    kv = (k, v)
    if r > 1 and not gqa:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    if mask is not None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **_gqa(gqa))
    elif cached == 0 or T == 1:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=cached == 0 and T > 1, **_gqa(gqa))
    else:  # a chunk appended to a cache: query t sees keys up to cached + t
        mask = torch.ones(T, cached + T, dtype=torch.bool, device=q.device).tril(cached)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **_gqa(gqa))
    return o, kv
