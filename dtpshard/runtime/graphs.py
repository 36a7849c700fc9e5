"""CUDA-graph decoding for the NCCL runtime: one graph replay per generated token.

A decode step of a small model on a GPU is dominated by launch overhead: a few hundred small
kernels and 2n NCCL all-reduces per token. Captured once in a CUDA graph (NCCL collectives are
capturable once the communicator exists), a step is one replay. That needs static shapes and
addresses, so this decoder keeps its own KV cache of `max_len` positions per layer
([B, G/L, max_len, hd], the new token written at the position held in a device tensor) and
attends over all of it with a mask of the positions filled so far; the DTP schedule, the
partials and the Link's asynchronous sums are RankModel's, unchanged. The prompt is prefilled
eagerly (RankModel with a growing cache) and copied in.

On a CPU the same static-cache step runs without a graph (tests check it against eager decoding
there); the capture itself was written without a GPU at hand and is checked by
bench/cuda_check.py and tests/test_graphs.py on a GPU machine. Not for latency emulation
(host-side sleeps do not replay).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dtpshard.core.errors import UserError
from dtpshard.model.attention import attend
from dtpshard.model.dtp import KVCache, rms_norm, rotate_half


class GraphDecoder:
    """RankModel's interface (new_cache, __call__) for generate_ids; decode steps replay a graph."""

    def __init__(self, net, batch: int, max_len: int):
        s, self.net, self.max_len = net.shape, net, max_len
        dev, dt = net.lm_head.device, net.lm_head.dtype
        groups = s.kv_groups // net.world
        self.k = [torch.zeros(batch, groups, max_len, s.head_dim, device=dev, dtype=dt) for _ in range(s.layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.positions = torch.arange(max_len, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.length = 0

    def new_cache(self) -> KVCache:
        return self.net.new_cache()

    def __call__(self, input_ids: torch.Tensor, cache: KVCache | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        if cache is None or input_ids.shape[1] > 1 or self.length == 0:  # the prompt: eager, then copied in
            out = self.net(input_ids, cache, logits_to_keep)
            if cache is not None:
                self._load(cache)
            return out
        if self.length >= self.max_len:
            raise UserError(f"CUDA-graph decoding: more than max_len={self.max_len} positions")
        self.tok.copy_(input_ids)
        if not self.tok.is_cuda:
            self.logits = self._step(advance=True)
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
        self.length += 1
        cache.kv = [(k[:, :, :self.length], v[:, :, :self.length]) for k, v in zip(self.k, self.v)]
        return self.logits.clone()

    def _load(self, cache: KVCache) -> None:
        self.length = cache.length
        if self.length > self.max_len:
            raise UserError(f"CUDA-graph decoding: the prompt has {self.length} positions, max_len={self.max_len}")
        for i, (k, v) in enumerate(cache.kv):
            self.k[i][:, :, :self.length].copy_(k)
            self.v[i][:, :, :self.length].copy_(v)
        self.pos.fill_(self.length)

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        keep = [(k.clone(), v.clone()) for k, v in zip(self.k, self.v)]
        with torch.cuda.stream(side):  # warm-up outside the graph (allocator, NCCL, lazy inits)
            self._step(advance=False)
        torch.cuda.current_stream().wait_stream(side)
        for (k, v), (k0, v0) in zip(zip(self.k, self.v), keep):  # the warm-up wrote one position: undo
            k.copy_(k0)
            v.copy_(v0)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step(advance=True)

    @torch.no_grad()
    def _step(self, advance: bool) -> torch.Tensor:
        """One token at position self.pos: RankModel.__call__ with the static cache."""
        net, s = self.net, self.net.shape
        x = F.embedding(self.tok, net.w["model.embed_tokens.weight"])
        cos, sin = net.rotary(x, self.pos[None])
        cos, sin = cos[:, None], sin[:, None]
        visible = (self.positions <= self.pos)[None, None, None]  # [1, 1, 1, max_len]
        link = net.link
        for m, step in enumerate(net.steps):
            i = m // 2
            p = net._ffn(i, x) if m % 2 else self._attention(i, x, cos, sin, visible)
            if net.delay == 0:
                x = x + link.reduce(p, f"the all-reduce of module {m}")
                continue
            if m in net.last_use:
                link.post(m, p)
            x = x + p if step.own_scale == 1 else x + step.own_scale * p
            for k, wt in step.arrivals:
                x = x + link.others(k) if wt == 1 else x + wt * link.others(k)
                if net.last_use[k] == m:
                    link.drop(k)
        h = rms_norm(x, net.w["model.norm.weight"], s.rms_eps)
        if net.delay != 0 and net.world > 1:
            h = link.reduce(h, "the final mean over ranks") / net.world
        if advance:
            self.pos.add_(1)
        return F.linear(h, net.lm_head)  # [B, 1, V]

    def _attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   visible: torch.Tensor) -> torch.Tensor:
        s, w, pre = self.net.shape, self.net.w, f"model.layers.{i}."
        h = rms_norm(x, w[pre + "input_layernorm.weight"], s.rms_eps)
        B = h.shape[0]
        q, k, v = (F.linear(h, w[pre + f"self_attn.{n}_proj.weight"], w.get(pre + f"self_attn.{n}_proj.bias"))
                   .view(B, 1, -1, s.head_dim).transpose(1, 2) for n in "qkv")
        if s.qk_norm:
            q = rms_norm(q, w[pre + "self_attn.q_norm.weight"], s.rms_eps)
            k = rms_norm(k, w[pre + "self_attn.k_norm.weight"], s.rms_eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        self.k[i].index_copy_(2, self.pos, k)
        self.v[i].index_copy_(2, self.pos, v)
        o, _ = attend(q, self.k[i], self.v[i], s.heads_per_group, mask=visible)  # the whole static cache, masked
        return F.linear(o.transpose(1, 2).reshape(B, 1, -1), w[pre + "self_attn.o_proj.weight"])
