"""The dense model for calibration: the Decoder (model/decoder.py) of the whole shape at L = 1, δ = 0.

`DenseModel` is the same decoder as DTPModel with the whole weights run as one device, where a
module's partial is the dense module output. Calibration reads, through the decoder's module loop
and its hook (`step`), the intermediates the affinity scores are made of:

- attention (module 2i): the module output, the per-query-head attention outputs o_h (before
  o_proj; head h's contribution to the residual is c_h = W_o[:, h·hd:(h+1)·hd] o_h, and the
  module output is Σ_h c_h), the rms ρ of the input residual, and the q/k/v pre-activations of the
  normalised input stacked per KV group (bias excluded), i.e. W_g (γ ⊙ x / ρ).
- FFN (module 2i+1): the module output, the neuron outputs act = silu(g)·u, the gate/up
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
from typing import Any

import torch

from dtpshard.core.settings import DENSE, warn_if_other_settings
from dtpshard.core.shape import ModelShape, shape_from_hf_config
from dtpshard.model.checkpoint import Checkpoint
from dtpshard.model.decoder import Decoder, rotary_for
from dtpshard.model.delay import schedule_for
from dtpshard.model.exchange import DeviceAxis, Exchange
from dtpshard.model.modules import Layer
from dtpshard.model.ops import inv_rms


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
        """o_w and down carry the family's residual multiplier: a unit's contribution to the stream
        is what they give."""
        a, f = layer.self_attn, layer.mlp
        r, hd, g = s.heads_per_group, s.head_dim, s.kv_groups
        qkv_w = torch.cat([a.q_proj.weight.view(g, r * hd, s.hidden), a.k_proj.weight.view(g, hd, s.hidden),
                           a.v_proj.weight.view(g, hd, s.hidden)], dim=1)
        m = s.residual_multiplier
        o_w, down = (a.o_proj.weight, f.down_proj.weight) if m == 1 else (a.o_proj.weight * m, f.down_proj.weight * m)
        return cls(layer.input_layernorm.weight, qkv_w, o_w, layer.post_attention_layernorm.weight,
                   f.gate_proj.weight, f.up_proj.weight, down)


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


class DenseModel(Decoder):
    """The dense forward pass (module 2i: attention i, 2i+1: FFN i): the decoder at L = 1, δ = 0."""

    def __init__(self, hf_config: Any, shape: ModelShape, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        super().__init__(hf_config, shape)
        self.dtype, self.device = dtype, torch.device(device)
        self.steps = schedule_for(shape.modules, DENSE)
        self._ropes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_state_dict(cls, hf_config: Any, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", shape: ModelShape | None = None) -> DenseModel:
        """The dense model of a (dense) state dict, every weight in `dtype` on `device`."""
        with torch.device("meta"):
            model = cls(hf_config, shape or shape_from_hf_config(hf_config), dtype, device)
        model.load_state_dict({k: state_dict[k].to(device=model.device, dtype=dtype) for k in model.state_dict()},
                              strict=True, assign=True)
        model.rebuild_buffers()
        return model.requires_grad_(False)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> DenseModel:
        ckpt.check_fits(None)
        warn_if_other_settings(ckpt.path, ckpt.record, DENSE)
        return cls.from_state_dict(ckpt.hf_config, ckpt.state_dict(), dtype, device, ckpt.shape)

    def exchange(self) -> Exchange:
        """One device: each module's output is added to the one residual stream, nothing moves."""
        return Exchange(self.steps, DeviceAxis(), 1)

    # -- pieces ----------------------------------------------------------------------------------
    def rope_for(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, 1, T, hd] for positions 0..T-1 (Decoder.rope), kept per length: calibration
        asks for the same length at every module."""
        if seq_len not in self._ropes:
            self._ropes[seq_len] = self.rope(torch.zeros(1, dtype=self.dtype, device=self.device), 0, seq_len)
        return self._ropes[seq_len]

    def weights(self, i: int) -> LayerWeights:
        return LayerWeights.of(self.model.layers[i], self.shape)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, D] residual stream."""
        return super().embed(ids.to(self.device))

    def step(self, m: int, x: torch.Tensor) -> tuple[torch.Tensor, AttentionOut | FFNOut]:
        """Module m on the residual x [B, T, D], through the decoder's loop: the residual after it
        and what calibration reads of it (the loop's hook)."""
        s = self.shape
        B, T, _ = x.shape
        seen: dict[str, Any] = {}

        def hook(_m: int, _x: torch.Tensor, p: torch.Tensor, trace: dict[str, torch.Tensor]) -> None:
            seen.update(trace, out=p[0])

        cos, sin = self.rope_for(T) if m % 2 == 0 else (None, None)
        after = self.walk(x[None], cos, sin, self.exchange(), modules=range(m, m + 1), hook=hook)[0]
        if m % 2:
            return after, FFNOut(seen["out"], seen["act"][0], seen["gate"][0], seen["up"][0], rms(x, s.rms_eps))
        r, hd, G = s.heads_per_group, s.head_dim, s.kv_groups
        qkv = torch.cat([seen["q"][0].view(B, T, G, r * hd), seen["k"][0].view(B, T, G, hd),
                         seen["v"][0].view(B, T, G, hd)], dim=-1)
        o = seen["o"].transpose(1, 2)  # [B, H, T, hd] -> [B, T, H, hd]
        return after, AttentionOut(seen["out"], o, rms(x, s.rms_eps), qkv)

    def attention(self, i: int, x: torch.Tensor) -> AttentionOut:
        """Attention of layer i on residual x [B, T, D]."""
        return self.step(2 * i, x)[1]  # type: ignore[return-value]

    def ffn(self, i: int, x: torch.Tensor) -> FFNOut:
        """SwiGLU FFN of layer i on residual x [B, T, D]."""
        return self.step(2 * i + 1, x)[1]  # type: ignore[return-value]

    def head_contributions(self, i: int, o: torch.Tensor) -> torch.Tensor:
        """c_h: [B, T, H, hd] head outputs -> [B, T, H, D] their contributions to the residual."""
        s = self.shape
        w = self.model.layers[i].self_attn.o_proj.weight.view(s.hidden, s.heads, s.head_dim)  # [D, H, hd]
        return torch.einsum("bthk,dhk->bthd", o, w)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, V] logits: the L = 1, δ = 0 schedule over these modules."""
        exchange = self.exchange()
        x = self.run_streams(ids.to(self.device), 1, exchange)
        return self.logits(self.head_input(x, exchange))


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
    asked for; the final norm and LM head are read only when logits are asked for. The values are the
    DenseModel's bit for bit: the same tensors, converted the same way.
    """

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        with torch.device("meta"):  # the embedding and the layers stay unread: the window reads them
            super().__init__(ckpt.hf_config, ckpt.shape, dtype, device)
        self.ckpt = ckpt
        del self.model.layers
        self.model.layers = _LayerWindow(self)
        self.rebuild_buffers()

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        return self.ckpt.files.get(name, rows).to(device=self.device, dtype=self.dtype)

    @property
    def lm_head_weight(self) -> torch.Tensor:  # type: ignore[override]
        return self.read("model.embed_tokens.weight" if self.shape.tied else "lm_head.weight")

    def rebuild_buffers(self) -> None:
        self.rotary = rotary_for(self.hf_config).to(self.device)

    def head_input(self, x: torch.Tensor, exchange: Any) -> torch.Tensor:
        if self.model.norm.weight.is_meta:  # read when logits are first asked for
            self.model.norm.load_state_dict({"weight": self.read("model.norm.weight")}, assign=True)
            self.model.norm.requires_grad_(False)
        return super().head_input(x, exchange)

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
        return out if self.shape.embedding_multiplier == 1 else out * self.shape.embedding_multiplier
