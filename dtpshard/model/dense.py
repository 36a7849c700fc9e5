"""The dense model, module by module, exposing what affinity needs: the DTP modules at L = 1, δ = 0.

`DenseModel` holds the same decoder layers as DTPModel (model/modules.py) with the whole weights,
runs each module as the single device of an L = 1 model (where its partial is the dense module
output), and asks it for the intermediates the affinity scores are made of (its `trace`):

- `attention(i, x)`: the module output, the per-query-head attention outputs o_h (before
  o_proj; head h's contribution to the residual is c_h = W_o[:, h·hd:(h+1)·hd] o_h, and the
  module output is Σ_h c_h), the rms ρ of the input residual, and the q/k/v pre-activations of the
  normalised input stacked per KV group (bias excluded), i.e. W_g (γ ⊙ x / ρ).
- `ffn(i, x)`: the module output, the neuron outputs act = silu(g)·u, the gate/up
  pre-activations g, u and ρ.
- `weights(i)`: layer i's matrices in the form the scorer folds (`LayerWeights`).

`StreamedDense` is the same model over the checkpoint's files, one decoder layer held at a time
(calibration of models bigger than memory).

KV group g owns query heads g·r .. g·r+r-1 (transformers' repeat_kv order), so the o_proj columns
and q rows of a group are contiguous.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dtpshard.core.shape import ModelShape
from dtpshard.model.checkpoint import Checkpoint
from dtpshard.model.decoder import rotary_for
from dtpshard.model.delay import LocalExchange, schedule
from dtpshard.model.hf import student_record, warn_if_student
from dtpshard.model.modules import Layer
from dtpshard.model.ops import inv_rms, rms_norm


@dataclass
class AttentionOut:
    out: torch.Tensor  # [B, T, D] module output = Σ_h c_h
    o: torch.Tensor  # [B, T, H, hd] per-head attention output before o_proj
    rho: torch.Tensor  # [B, T, 1] rms of the input residual
    qkv: torch.Tensor  # [B, T, G, (r+2)·hd] per group: its r heads' q rows, k rows, v rows of γ⊙x/ρ, no bias


@dataclass
class FFNOut:
    out: torch.Tensor  # [B, T, D] module output = W_down act
    act: torch.Tensor  # [B, T, N] silu(g)·u
    gate: torch.Tensor  # [B, T, N] g
    up: torch.Tensor  # [B, T, N] u
    rho: torch.Tensor  # [B, T, 1]


@dataclass
class LayerWeights:
    """A decoder layer's matrices as the affinity scorer folds them (views of the layer's, but qkv_w)."""

    ln1: torch.Tensor  # [D] attention pre-norm gain γ
    qkv_w: torch.Tensor  # [G, (r+2)·hd, D] q/k/v rows stacked per KV group
    o_w: torch.Tensor  # [D, H·hd]
    ln2: torch.Tensor  # [D] FFN pre-norm gain γ
    gate: torch.Tensor  # [N, D]
    up: torch.Tensor  # [N, D]
    down: torch.Tensor  # [D, N]

    @classmethod
    def of(cls, layer: Layer, s: ModelShape) -> LayerWeights:
        a, f = layer.self_attn, layer.mlp
        r, hd, g = s.heads_per_group, s.head_dim, s.kv_groups
        qkv_w = torch.cat([a.q_proj.weight.view(g, r * hd, s.hidden), a.k_proj.weight.view(g, hd, s.hidden),
                           a.v_proj.weight.view(g, hd, s.hidden)], dim=1)
        return cls(layer.input_layernorm.weight, qkv_w, a.o_proj.weight, layer.post_attention_layernorm.weight,
                   f.gate_proj.weight, f.up_proj.weight, f.down_proj.weight)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """ρ = sqrt(mean(x²) + ε) over the last axis, keepdim: [..., D] -> [..., 1]."""
    return 1 / inv_rms(x, eps)


def load_layer(get: Callable[[str], torch.Tensor], s: ModelShape, i: int) -> Layer:
    """Decoder layer i from `get(HF tensor name)` (already in the compute dtype and device)."""
    prefix = f"model.layers.{i}."
    with torch.device("meta"):
        layer = Layer(s)
    layer.load_state_dict({k: get(prefix + k) for k in layer.state_dict()}, strict=True, assign=True)
    return layer.requires_grad_(False)


class DenseModel:
    """The dense forward pass, module by module (module 2i: attention i, 2i+1: FFN i)."""

    def __init__(self, shape: ModelShape, hf_config: Any, state_dict: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.shape, self.dtype, self.device = shape, dtype, torch.device(device)

        def get(name: str) -> torch.Tensor:
            return state_dict[name].to(device=self.device, dtype=dtype)

        self.embed_w = get("model.embed_tokens.weight")  # [V, D]
        self.norm_w = get("model.norm.weight")
        self.lm_head = self.embed_w if shape.tied else get("lm_head.weight")
        self.layers: Sequence[Layer] = [load_layer(get, shape, i) for i in range(shape.layers)]
        self.rotary = rotary_for(hf_config).to(self.device)
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> DenseModel:
        warn_if_student(ckpt.path, student_record(Path(ckpt.path), ckpt.hf_config), devices=1, delay=0)
        return cls(ckpt.shape, ckpt.hf_config, ckpt.state_dict(), dtype, device)

    # -- pieces ----------------------------------------------------------------------------------
    def rope(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, 1, T, hd] for positions 0..T-1, from transformers' rotary class."""
        if seq_len not in self._rope:
            pos = torch.arange(seq_len, device=self.device)[None]
            cos, sin = self.rotary(torch.zeros(1, dtype=self.dtype, device=self.device), pos)
            self._rope[seq_len] = (cos[:, None].to(self.dtype), sin[:, None].to(self.dtype))
        return self._rope[seq_len]

    def weights(self, i: int) -> LayerWeights:
        return LayerWeights.of(self.layers[i], self.shape)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, D] residual stream."""
        return self.embed_w[ids.to(self.device)]

    def attention(self, i: int, x: torch.Tensor) -> AttentionOut:
        """Attention of layer i on residual x [B, T, D]."""
        s = self.shape
        B, T, _ = x.shape
        trace: dict[str, torch.Tensor] = {}
        out = self.layers[i].partials(True, x[None], *self.rope(T), trace=trace)[0]
        r, hd, G = s.heads_per_group, s.head_dim, s.kv_groups
        qkv = torch.cat([trace["q"][0].view(B, T, G, r * hd), trace["k"][0].view(B, T, G, hd),
                         trace["v"][0].view(B, T, G, hd)], dim=-1)
        o = trace["o"].transpose(1, 2)  # [B, H, T, hd] -> [B, T, H, hd]
        return AttentionOut(out, o, rms(x, s.rms_eps), qkv)

    def ffn(self, i: int, x: torch.Tensor) -> FFNOut:
        """SwiGLU FFN of layer i on residual x [B, T, D]."""
        trace: dict[str, torch.Tensor] = {}
        out = self.layers[i].partials(False, x[None], None, None, trace=trace)[0]
        return FFNOut(out, trace["act"][0], trace["gate"][0], trace["up"][0], rms(x, self.shape.rms_eps))

    def head_contributions(self, i: int, o: torch.Tensor) -> torch.Tensor:
        """c_h: [B, T, H, hd] head outputs -> [B, T, H, D] their contributions to the residual."""
        s = self.shape
        w = self.layers[i].self_attn.o_proj.weight.view(s.hidden, s.heads, s.head_dim)  # [D, H, hd]
        return torch.einsum("bthk,dhk->bthd", o, w)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.norm_w, self.shape.rms_eps) @ self.lm_head.T

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, V] logits: the L = 1, δ = 0 schedule over these modules."""
        x = self.embed(ids)[None]  # [1, B, T, D]
        exchange = LocalExchange(0)
        cos, sin = self.rope(ids.shape[1])
        for m, step in enumerate(schedule(self.shape.modules, 1, 0)):
            x = exchange.update(m, x, self.layers[m // 2].partials(m % 2 == 0, x, cos, sin), step)
        return self.logits(x[0])


EMBED_BLOCK_BYTES = 64 << 20  # embedding rows read at once by StreamedDense


class _LayerWindow(Sequence[Layer]):
    """`layers` of a StreamedDense: layer i is read when asked for, replacing the one held before."""

    def __init__(self, model: StreamedDense):
        self.model, self.index, self.layer = model, -1, None

    def __len__(self) -> int:
        return self.model.shape.layers

    def __getitem__(self, i):  # type: ignore[override]
        i = range(len(self))[i]
        if i != self.index:
            self.index, self.layer = -1, None  # free the old layer before the new one is read
            self.layer, self.index = load_layer(self.model.read, self.model.shape, i), i
        return self.layer


class StreamedDense(DenseModel):
    """The same model read from the checkpoint's files as it goes, holding one decoder layer at a time.

    A pass that visits the layers in order (as calibration does) reads each layer once and holds
    only it, whatever the model's size. The embedding is read in row blocks keeping only the rows
    asked for; the final norm and LM head are read only when logits are asked for. The values are
    the DenseModel's bit for bit: the same tensors, converted the same way.
    """

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.shape, self.dtype, self.device = ckpt.shape, dtype, torch.device(device)
        self.ckpt = ckpt
        self.layers = _LayerWindow(self)
        self.rotary = rotary_for(ckpt.hf_config).to(self.device)
        self._rope = {}

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        return self.ckpt.files.get(name, rows).to(device=self.device, dtype=self.dtype)

    @property
    def norm_w(self) -> torch.Tensor:  # type: ignore[override]
        return self.read("model.norm.weight")

    @property
    def lm_head(self) -> torch.Tensor:  # type: ignore[override]
        return self.read("model.embed_tokens.weight" if self.shape.tied else "lm_head.weight")

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.device)
        V, D = self.shape.vocab, self.shape.hidden
        out = torch.empty(ids.shape + (D,), dtype=self.dtype, device=self.device)
        step = max(1, EMBED_BLOCK_BYTES // (4 * D))
        for r0 in range(0, V, step):
            hit = (ids >= r0) & (ids < r0 + step)
            if bool(hit.any()):  # the rows picked before the conversion: only those are copied
                block = self.ckpt.files.get("model.embed_tokens.weight", slice(r0, min(V, r0 + step)))
                out[hit] = block[(ids[hit] - r0).cpu()].to(device=self.device, dtype=self.dtype)
        return out
