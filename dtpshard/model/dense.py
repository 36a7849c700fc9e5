"""The dense model, module by module, over a Hugging Face state dict, exposing what affinity needs.

`DenseModel` runs the same function as transformers' LlamaForCausalLM / MistralForCausalLM /
Qwen2ForCausalLM / Qwen3ForCausalLM (pre-norm RMSNorm blocks, GQA attention with RoPE from the
family's own transformers rotary class, Qwen2 q/k/v biases, Qwen3 per-head q/k RMSNorm, SwiGLU
FFN), but one module at a time and with the intermediates the affinity scores are made of:

- `attention(i, x)`: the module output, the per-query-head attention outputs o_h (before
  o_proj; head h's contribution to the residual is c_h = W_o[:, h·hd:(h+1)·hd] o_h, and the
  module output is Σ_h c_h), the rms ρ of the input residual, and the q/k/v pre-activations of the
  normalised input stacked per KV group (bias excluded), i.e. W_g (γ ⊙ x / ρ).
- `ffn(i, x)`: the module output, the neuron outputs act = silu(g)·u, the gate/up
  pre-activations g, u and ρ.

`StreamedDense` is the same model over the checkpoint's files, one decoder layer held at a time
(calibration of models bigger than memory).

KV group g owns query heads g·r .. g·r+r-1 (transformers' repeat_kv order), so the o_proj columns
and q rows of a group are contiguous. Weights are kept as [out, in] matrices like nn.Linear.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dtpshard.model.checkpoint import Checkpoint
from dtpshard.core.shape import ModelShape
from dtpshard.model.dtp import rotary_for, rotate_half

def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """ρ = sqrt(mean(x²) + ε) over the last axis, keepdim: [..., D] -> [..., 1]."""
    return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


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
class Layer:
    ln1: torch.Tensor  # [D] attention pre-norm gain γ
    qkv_w: torch.Tensor  # [G, (r+2)·hd, D] q/k/v rows stacked per KV group
    qkv_b: torch.Tensor | None  # [G, (r+2)·hd] (Qwen2)
    q_norm: torch.Tensor | None  # [hd] (Qwen3)
    k_norm: torch.Tensor | None  # [hd]
    o_w: torch.Tensor  # [D, H·hd]
    ln2: torch.Tensor  # [D] FFN pre-norm gain γ
    gate: torch.Tensor  # [N, D]
    up: torch.Tensor  # [N, D]
    down: torch.Tensor  # [D, N]


def load_layer(get: Callable[[str], torch.Tensor], s: ModelShape, i: int) -> Layer:
    """Decoder layer i from `get(HF tensor name)` (already in the compute dtype and device)."""
    r, hd, g = s.heads_per_group, s.head_dim, s.kv_groups
    p = f"model.layers.{i}."
    qkv_w = torch.cat([get(p + "self_attn.q_proj.weight").view(g, r * hd, s.hidden),
                       get(p + "self_attn.k_proj.weight").view(g, hd, s.hidden),
                       get(p + "self_attn.v_proj.weight").view(g, hd, s.hidden)], dim=1)
    qkv_b = None
    if s.qkv_bias:
        qkv_b = torch.cat([get(p + "self_attn.q_proj.bias").view(g, r * hd),
                           get(p + "self_attn.k_proj.bias").view(g, hd),
                           get(p + "self_attn.v_proj.bias").view(g, hd)], dim=1)
    return Layer(
        ln1=get(p + "input_layernorm.weight"), qkv_w=qkv_w.contiguous(), qkv_b=qkv_b,
        q_norm=get(p + "self_attn.q_norm.weight") if s.qk_norm else None,
        k_norm=get(p + "self_attn.k_norm.weight") if s.qk_norm else None,
        o_w=get(p + "self_attn.o_proj.weight"), ln2=get(p + "post_attention_layernorm.weight"),
        gate=get(p + "mlp.gate_proj.weight"), up=get(p + "mlp.up_proj.weight"),
        down=get(p + "mlp.down_proj.weight"))


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
                        device: str | torch.device = "cpu") -> "DenseModel":
        from dtpshard.model.hf import recorded_dtp, warn_if_student

        warn_if_student(ckpt.path, recorded_dtp(ckpt.hf_config), devices=1, delay=0)
        return cls(ckpt.shape, ckpt.hf_config, ckpt.state_dict(), dtype, device)

    # -- pieces ----------------------------------------------------------------------------------
    def rope(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, hd] for positions 0..T-1, from transformers' rotary class."""
        if seq_len not in self._rope:
            pos = torch.arange(seq_len, device=self.device)[None]
            cos, sin = self.rotary(torch.zeros(1, dtype=self.dtype, device=self.device), pos)
            self._rope[seq_len] = (cos[0].to(self.dtype), sin[0].to(self.dtype))
        return self._rope[seq_len]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, D] residual stream."""
        return self.embed_w[ids.to(self.device)]

    def attention(self, i: int, x: torch.Tensor) -> AttentionOut:
        """Attention of layer i on residual x [B, T, D]."""
        s, L = self.shape, self.layers[i]
        B, T, D = x.shape
        H, G, r, hd = s.heads, s.kv_groups, s.heads_per_group, s.head_dim
        rho = rms(x, s.rms_eps)
        h = x / rho * L.ln1
        qkv = (h @ L.qkv_w.view(-1, D).T).view(B, T, G, (r + 2) * hd)
        pre = qkv if L.qkv_b is None else qkv + L.qkv_b
        q = pre[..., :r * hd].reshape(B, T, H, hd)
        k = pre[..., r * hd:(r + 1) * hd]  # [B, T, G, hd]
        v = pre[..., (r + 1) * hd:]
        if L.q_norm is not None:
            q = q / rms(q, s.rms_eps) * L.q_norm
            k = k / rms(k, s.rms_eps) * L.k_norm
        cos, sin = self.rope(T)
        cos, sin = cos[:, None], sin[:, None]  # [T, 1, hd]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)  # [B, H, T, hd]
        o = a.transpose(1, 2)  # [B, T, H, hd]
        out = o.reshape(B, T, H * hd) @ L.o_w.T
        return AttentionOut(out, o, rho, qkv)

    def ffn(self, i: int, x: torch.Tensor) -> FFNOut:
        """SwiGLU FFN of layer i on residual x [B, T, D]."""
        L = self.layers[i]
        rho = rms(x, self.shape.rms_eps)
        h = x / rho * L.ln2
        g, u = h @ L.gate.T, h @ L.up.T
        act = F.silu(g) * u
        return FFNOut(act @ L.down.T, act, g, u, rho)

    def head_contributions(self, i: int, o: torch.Tensor) -> torch.Tensor:
        """c_h: [B, T, H, hd] head outputs -> [B, T, H, D] their contributions to the residual."""
        s = self.shape
        w = self.layers[i].o_w.view(s.hidden, s.heads, s.head_dim)  # [D, H, hd]
        return torch.einsum("bthk,dhk->bthd", o, w)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return (x / rms(x, self.shape.rms_eps) * self.norm_w) @ self.lm_head.T

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, V] logits (the dense model)."""
        x = self.embed(ids)
        for i in range(self.shape.layers):
            x = x + self.attention(i, x).out
            x = x + self.ffn(i, x).out
        return self.logits(x)


EMBED_BLOCK_BYTES = 64 << 20  # embedding rows read at once by StreamedDense


class _LayerWindow(Sequence[Layer]):
    """`layers` of a StreamedDense: layer i is read when asked for, replacing the one held before."""

    def __init__(self, model: "StreamedDense"):
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
