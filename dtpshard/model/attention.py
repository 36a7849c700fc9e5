"""The attention core and the KV cache it appends to.

`attend` is the one call every forward makes (the simulator over all devices at once, a rank on
its own KV groups, calibration at L = 1): append the new keys and values to the cache, expand the
KV groups to their query heads, and scaled dot-product attention, causal over cache + new
positions. A cache is a sequence of slots, one per attention module, with `start` and `advance`;
a slot has `append`. `KVCache` grows with each call; the runtime's CUDA-graph decoder uses a
fixed-size one (runtime/graphs.py).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# sdpa's enable_gqa exists from torch 2.5, and the CPU flash kernel handles grouped queries itself
# from 2.9 (before, it falls back to the math kernel, which builds the whole T x T score matrix)
_CPU_GQA = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 9)


class KVSlot:
    """One attention module's keys and values so far, each [L*B, G/L, T, hd]: every device keeps only
    its own KV groups."""

    def __init__(self) -> None:
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def length(self) -> int:
        return 0 if self.kv is None else self.kv[0].shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        """-> the keys and values so far and no mask (the causal rule over them holds)."""
        if self.kv is not None:
            k, v = torch.cat([self.kv[0], k], dim=2), torch.cat([self.kv[1], v], dim=2)
        self.kv = (k, v)
        return k, v, None


class KVCache:
    """A growing slot per attention module (`cache[i]`: layer i's attention)."""

    def __init__(self, layers: int):
        self.slots = [KVSlot() for _ in range(layers)]

    def __getitem__(self, i: int) -> KVSlot:
        return self.slots[i]

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def length(self) -> int:
        return self.slots[0].length

    def start(self) -> int:
        """The position of the next token appended (an int here; a fixed-size cache's is a tensor)."""
        return self.length

    def advance(self, length: int) -> None:
        """Called once a forward has appended `length` tokens to every slot (nothing to do here)."""


def window_band(T: int, S: int, window: int, device: torch.device) -> torch.Tensor:
    """[T, S] boolean: query t (the last T of S positions) sees key s only if t − s < window, as
    transformers' sliding-window mask (positions counted in the cache, padding included)."""
    q = torch.arange(S - T, S, device=device)[:, None]
    return (q - torch.arange(S, device=device)[None]) < window


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads_per_group: int, kv: Any = None,
           mask: torch.Tensor | None = None, scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """q [N, H, T, hd], k and v [N, G, T, hd] (rotary already applied) -> o [N, H, T, hd], with
    H = G · heads_per_group. With a cache slot `kv`, k and v are appended to it first and
    query t sees the P cached positions and new positions up to t. `mask` (boolean, broadcastable
    to [N, H, T, P + T], True = attend) replaces that causal rule, e.g. for left padding; the caller
    builds it causal. A cache may give its own mask (a fixed-size cache: the positions filled, and
    its window). `scale`: the scores' factor (None: 1/sqrt(hd)); `window`: sliding-window attention,
    each query seeing only the `window` latest positions."""
    if kv is not None:
        k, v, visible = kv.append(k, v)
        mask = visible if mask is None else mask
    T = q.shape[2]
    cached = k.shape[2] - T
    if window is not None and window < k.shape[2] and not getattr(kv, "windowed", False):
        band = window_band(T, k.shape[2], window, q.device)
        mask = (band & torch.ones_like(band).tril(cached)) if mask is None else mask & band
    # On the CPU, sdpa attends grouped queries without copying k and v per query head; on CUDA
    # enable_gqa is not supported by every kernel (a math fallback would cost more than the copy).
    # enable_gqa is passed only when True, so older torch (no such argument) keeps working.
    r = heads_per_group
    gqa = r > 1 and q.device.type == "cpu" and _CPU_GQA
    if r > 1 and not gqa:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    extra = {"enable_gqa": True} if gqa else {}
    if scale is not None:
        extra["scale"] = scale
    if mask is None and cached and T > 1:  # a chunk appended to a cache: query t sees keys up to cached + t
        mask = torch.ones(T, cached + T, dtype=torch.bool, device=q.device).tril(cached)
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)
    return F.scaled_dot_product_attention(q, k, v, is_causal=cached == 0 and T > 1, **extra)
