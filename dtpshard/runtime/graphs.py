"""CUDA-graph decoding for the NCCL runtime: one graph replay per generated token.

A decode step of a small model on a GPU is dominated by launch overhead: a few hundred small
kernels and 2n NCCL all-reduces per token. Captured once in a CUDA graph (NCCL collectives are
capturable once the communicator exists), a step is one replay. That needs static shapes and
addresses, so this decoder is a cache and a replay around the rank's own forward (RankModel, the
same modules, schedule and Link): `StaticKVCache` keeps `max_len` positions per layer
([B, G/L, max_len, hd]), writes the new token at the position held in a device tensor and lets
attention see the positions filled so far through a mask. The prompt is prefilled eagerly with
the growing cache and copied in.

On a CPU the same static-cache step runs without a graph (tests check it against eager decoding
there); the capture itself is checked by bench/cuda_check.py and tests/test_graphs.py on a GPU
machine. Not for latency emulation (host-side sleeps do not replay).
"""
from __future__ import annotations

import torch

from dtpshard.core.errors import UserError
from dtpshard.model.attention import KVCache


class StaticSlot:
    """One attention module's fixed buffers [B, G/L, max_len, hd]; the position is the cache's. Its
    mask is the whole rule, a sliding window's too (attend adds none: `windowed`)."""

    windowed = True

    def __init__(self, cache: StaticKVCache, k: torch.Tensor):
        self.cache, self.k, self.v = cache, k, torch.zeros_like(k)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pos, positions = self.cache.pos, self.cache.positions
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        visible = positions <= pos
        if self.cache.window is not None:
            visible = visible & (pos - positions < self.cache.window)
        return self.k, self.v, visible[None, None, None]  # [1, 1, 1, max_len]


class StaticKVCache:
    """The cache protocol of model/attention.py over fixed buffers: one token per call."""

    def __init__(self, layers: int, batch: int, groups: int, max_len: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype, window: int | None = None):
        self.slots = [StaticSlot(self, torch.zeros(batch, groups, max_len, head_dim, device=device, dtype=dtype))
                      for _ in range(layers)]
        self.pos = torch.zeros(1, dtype=torch.long, device=device)  # where the next token goes
        self.positions = torch.arange(max_len, device=device)
        self.max_len, self.window = max_len, window

    def __getitem__(self, i: int) -> StaticSlot:
        return self.slots[i]

    def start(self) -> torch.Tensor:
        return self.pos

    def advance(self, length: int) -> None:
        self.pos.add_(length)

    def load(self, cache: KVCache) -> None:
        """Take over a prefilled growing cache."""
        if cache.length > self.max_len:
            raise UserError(f"CUDA-graph decoding: the prompt has {cache.length} positions, max_len={self.max_len}")
        for slot, grown in zip(self.slots, cache.slots):
            slot.k[:, :, :cache.length].copy_(grown.kv[0])
            slot.v[:, :, :cache.length].copy_(grown.kv[1])
        self.pos.fill_(cache.length)


class GraphDecoder:
    """RankModel's interface (new_cache, calling it) for generate_ids; decode steps replay a graph."""

    def __init__(self, net, batch: int, max_len: int):  # a RankModel
        s, self.net, self.max_len = net.shape, net, max_len
        w = net.lm_head_weight
        self.static = StaticKVCache(s.layers, batch, s.kv_groups, max_len, s.head_dim, w.device, w.dtype, s.window)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=w.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.length = 0

    def new_cache(self) -> KVCache:
        return self.net.new_cache()

    def __call__(self, input_ids: torch.Tensor, cache: KVCache | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        if cache is None or input_ids.shape[1] > 1 or self.length == 0:  # the prompt: eager, then copied in
            out = self.net(input_ids, cache, logits_to_keep)
            if cache is not None:
                self.static.load(cache)
                self.length = cache.length
            return out
        if self.length >= self.max_len:
            raise UserError(f"CUDA-graph decoding: more than max_len={self.max_len} positions")
        self.tok.copy_(input_ids)
        if not self.tok.is_cuda:
            self.logits = self.net(self.tok, self.static)
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
        self.length += 1
        for grown, slot in zip(cache.slots, self.static.slots):
            grown.kv = (slot.k[:, :, :self.length], slot.v[:, :, :self.length])
        return self.logits.clone()

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        keep = [(slot.k.clone(), slot.v.clone()) for slot in self.static.slots]
        pos = self.static.pos.clone()
        with torch.cuda.stream(side):  # warm-up outside the graph (allocator, NCCL, lazy inits)
            self.net(self.tok, self.static)
        torch.cuda.current_stream().wait_stream(side)
        for slot, (k0, v0) in zip(self.static.slots, keep):  # the warm-up wrote one position: undo
            slot.k.copy_(k0)
            slot.v.copy_(v0)
        self.static.pos.copy_(pos)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.net(self.tok, self.static)
