"""A decoder's modules, computed per device: the one definition of a partial.

Device l's partial of an attention is its pre-norm input through its own heads (q/k/v rows with
their biases, q/k-norm, RoPE, attention over its KV groups, its o_proj columns); of an FFN, its own
neurons (gate/up rows, the gated activation, its down_proj columns); either times the family's
residual multiplier (core/family.py), which distributes over the devices' partials. The inputs carry the devices axis
[L, B, T, D] and the weights are the dense ones, read as per-device views (ops.device_matmul), so:

- the simulator (`DTPModel`) holds the dense weights and runs all L devices at once;
- a rank of the runtime holds only its own slice (a shape `ModelShape.shard(L)`) and runs L = 1;
- calibration runs the dense model, L = 1 on the whole weights, and asks for the intermediates the
  affinity scores are made of through `trace`.

Parameter names are transformers' (model.layers.i.self_attn.q_proj, ...), so a state dict is a plain
HF one. The modules of docs/design.md §1 are the flat sequence `sequence(layers)` of 2n views over
those layers: module 2i is layer i's pre-norm and attention (KV-cache slot i), module 2i+1 its
pre-norm and FFN; a view holds no parameter of its own.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtpshard.core.family import activation
from dtpshard.core.shape import ModelShape
from dtpshard.model.attention import attend
from dtpshard.model.ops import Norm, Proj, device_matmul, replicated_matmul, rotary

Trace = dict[str, torch.Tensor]  # what a module computed on the way, when asked (calibration)
Partials = tuple[torch.Tensor, torch.Tensor | None]  # (sent, local): Module.partials


class Attention(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.s = s
        self.q_proj = Proj(s.heads * s.head_dim, s.hidden, s.qkv_bias)
        self.k_proj = Proj(s.kv_groups * s.head_dim, s.hidden, s.qkv_bias)
        self.v_proj = Proj(s.kv_groups * s.head_dim, s.hidden, s.qkv_bias)
        self.o_proj = Proj(s.hidden, s.heads * s.head_dim)
        if s.qk_norm:
            self.q_norm = Norm(s.head_dim, s.rms_eps)
            self.k_norm = Norm(s.head_dim, s.rms_eps)

    def _heads(self, name: str, h: torch.Tensor, trace: Trace | None) -> torch.Tensor:
        """[L, B, T, D] -> [L*B, heads/L, T, hd] for this device's rows of the q, k or v projection."""
        proj = getattr(self, f"{name}_proj")
        y = device_matmul(h, proj)  # [L, B, T, E]
        if trace is not None:
            trace[name] = y  # before the bias: W (γ ⊙ x / ρ)
        L, B, T, E = y.shape
        if proj.bias is not None:
            y = y + proj.bias.view(L, 1, 1, -1)
        # a strided view, no copy: q/k-norm and RoPE write new tensors anyway
        return y.view(L * B, T, E // self.s.head_dim, self.s.head_dim).transpose(1, 2)

    def partials(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: Any = None,
                 mask: torch.Tensor | None = None, trace: Trace | None = None) -> torch.Tensor:
        """h [L, B, T, D] (each device's normed stream) -> partials [L, B, T, D]. cos/sin [1, 1, T, hd]
        (or [L*B, 1, T, hd] for a padded batch, with `mask` a boolean [L*B, 1, T, past + T]); the
        new keys and values go into the KV-cache slot `kv`."""
        L, B, T, _ = h.shape
        q, k, v = (self._heads(n, h, trace) for n in "qkv")
        if self.s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        o = attend(rotary(q, cos, sin), rotary(k, cos, sin), v, self.s.heads_per_group, kv, mask,
                   self.s.attention_scale, self.s.window)
        if trace is not None:
            trace["o"] = o  # [L*B, H/L, T, hd], the o_proj input per head
        o = o.transpose(1, 2).reshape(L, B, T, -1)  # [L*B, Hl, T, hd] -> [L, B, T, Hl*hd]
        return device_matmul(o, self.o_proj, cols=True)


class FFN(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.act = activation(s.act)[0]
        self.gate_proj = Proj(s.neurons, s.hidden)
        self.up_proj = Proj(s.neurons, s.hidden)
        self.down_proj = Proj(s.hidden, s.neurons)
        # docs/design.md §6: the last `shared` neurons are every device's (None: none are)
        self.sharded = slice(0, s.sharded) if s.shared else None
        self.shared = slice(s.sharded, s.neurons) if s.shared else None

    def partials(self, h: torch.Tensor, trace: Trace | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [L, B, T, D] -> (partials, local), each [L, B, T, D]: device l's sharded neurons through
        their down_proj columns, and the shared neurons' whole output on its own stream (None when
        none are shared), which is never sent."""
        units = self.sharded
        g, u = device_matmul(h, self.gate_proj, units=units), device_matmul(h, self.up_proj, units=units)
        act = self.act(g) * u
        if trace is not None:
            trace.update(gate=g, up=u, act=act)
        p = device_matmul(act, self.down_proj, cols=True, units=units)
        if self.shared is None:
            return p, None
        g, u = replicated_matmul(h, self.gate_proj, self.shared), replicated_matmul(h, self.up_proj, self.shared)
        return p, replicated_matmul(self.act(g) * u, self.down_proj, self.shared, cols=True)


class Layer(nn.Module):
    """A decoder layer's parameters under transformers' names; its two modules are `Module` views."""

    def __init__(self, s: ModelShape):
        super().__init__()
        self.input_layernorm = Norm(s.hidden, s.rms_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = Norm(s.hidden, s.rms_eps)
        self.mlp = FFN(s)


class Module:
    """Module m of the decoder: a view of layer m // 2 of `stack.layers` (its pre-norm and its
    attention for even m, its FFN for odd m). The layer is looked up at each call, so the view
    follows whatever holds the layers (an nn.ModuleList, or the streamed model's window that
    reads one layer at a time)."""

    def __init__(self, stack: Any, m: int):
        self.stack, self.m, self.index = stack, m, m // 2
        self.attention = m % 2 == 0

    @property
    def layer(self) -> Layer:
        return self.stack.layers[self.index]

    def partials(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, cache: Any = None,
                 mask: torch.Tensor | None = None, trace: Trace | None = None) -> Partials:
        """(partials, local) [L, B, T, D] of this module on the streams x [L, B, T, D]: what is sent,
        and what each device adds at once unscaled and never sends (a shared FFN's, docs/design.md
        §6; else None). An attention reads and appends to its own slot of `cache` (slot i for layer i)."""
        layer = self.layer
        local = None
        if self.attention:
            kv = None if cache is None else cache[self.index]
            p = layer.self_attn.partials(layer.input_layernorm(x), cos, sin, kv, mask, trace)
        else:
            p, local = layer.mlp.partials(layer.post_attention_layernorm(x), trace)
        scale = layer.self_attn.s.residual_multiplier  # what joins the stream (Granite's residual multiplier)
        if scale == 1:
            return p, local
        return p * scale, None if local is None else local * scale


def sequence(stack: Any, layers: int) -> tuple[Module, ...]:
    """The 2n modules (attention 0, FFN 0, attention 1, ...) over `stack.layers`."""
    return tuple(Module(stack, m) for m in range(2 * layers))

