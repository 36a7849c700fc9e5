"""A model family, defined once: everything dtpshard knows of an architecture it runs as DTP.

Every other module asks this file: the module tree and the checkpoint reader (tensor names and
shapes, fused tensors), the permutation (which rows and columns move with which unit), the scorer
(the activation and its derivative), the forwards (the scalar multipliers, the LM head's logit
transform, one `logits()`), vLLM's model (its fused parameters) and the refusals. Adding a family
is one `Family(...)` below plus tests (docs/code.md, "Adding a family").

Inside dtpshard a decoder layer always has the same parameters, under Llama's names
(`CANONICAL`): q/k/v, o, gate, up and down projections, two pre-norms, and where the family has
them q/k biases and q/k norms. A family that stores some of them stacked in one tensor (Phi-3's
qkv_proj and gate_up_proj) says so in `fused`: the stored tensor is its parts concatenated along
rows, in order. Reading splits it, writing stacks it back, and a permutation of it is its parts'
permutations side by side, so a permuted or distilled checkpoint keeps its family's own format.

What cannot be DTP: a norm applied to a module's output before it joins the residual stream
(Gemma-2, Gemma-3, OLMo-2 "post-norms"): DTP adds each device's partial output to its own stream,
and a norm of a sum is not the sum of the norms of its parts. Likewise a bias on o_proj or
down_proj (added once, not per device), mixture-of-experts routing (a router sees the whole
input), and attention that is not softmax over the positions (linear attention, state spaces).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dtpshard.core.errors import UserError, quote

if TYPE_CHECKING:  # torch is imported where it runs: `dtpshard --help` imports no torch
    import torch


def silu_grad(g: torch.Tensor) -> torch.Tensor:
    """silu'(g) = σ(g)(1 + g(1 − σ(g)))."""
    s = g.sigmoid()
    return s * (1 + g * (1 - s))


ACTIVATIONS = ("silu",)  # the gate activations a family's hidden_act may name


def activation(name: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """hidden_act -> (the gate's activation, its derivative: the first-order affinity needs it)."""
    import torch.nn.functional as F

    return {"silu": (F.silu, silu_grad)}[name]

# a decoder layer's parameters inside dtpshard, under Llama's names (row-stacked parts of a fused tensor)
CANONICAL = ("input_layernorm.weight", "post_attention_layernorm.weight",
             "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
             "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
             "self_attn.q_norm.weight", "self_attn.k_norm.weight",
             "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
TOP_KEYS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
# the canonical tensors a layout's permutations move -> (the module whose permutation moves them,
# the axis, the rows of one unit: a KV group's query heads, one head, one neuron)
MOVED = {"self_attn.q_proj.weight": ("attn", 0, "group"), "self_attn.q_proj.bias": ("attn", 0, "group"),
         "self_attn.k_proj.weight": ("attn", 0, "head"), "self_attn.k_proj.bias": ("attn", 0, "head"),
         "self_attn.v_proj.weight": ("attn", 0, "head"), "self_attn.v_proj.bias": ("attn", 0, "head"),
         "self_attn.o_proj.weight": ("attn", 1, "group"), "mlp.gate_proj.weight": ("ffn", 0, "neuron"),
         "mlp.up_proj.weight": ("ffn", 0, "neuron"), "mlp.down_proj.weight": ("ffn", 1, "neuron")}


# a projection by its short name (an adapter target, `--adapter-targets`) -> (its submodule, its name)
PROJECTIONS = {"q": ("self_attn", "q_proj"), "k": ("self_attn", "k_proj"), "v": ("self_attn", "v_proj"),
               "o": ("self_attn", "o_proj"), "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"),
               "down": ("mlp", "down_proj")}


def layer_name(i: int, key: str) -> str:
    """Layer i's tensor `key` (canonical or stored) under its checkpoint name."""
    return f"model.layers.{i}.{key}"


# vLLM's fused parameters (serve/vllm_model.py: QKVParallelLinear, MergedColumnParallelLinear) and
# the shard id of each part its weight loader takes
VLLM_FUSED = {"self_attn.qkv_proj": (("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v")),
              "mlp.gate_up_proj": (("mlp.gate_proj", 0), ("mlp.up_proj", 1))}


@dataclass(frozen=True)
class Scalar:
    """A multiplier a family's config sets: ModelShape field `name` from config key `key`."""

    name: str
    key: str
    default: float


@dataclass(frozen=True)
class Family:
    """What dtpshard knows of a supported model family (transformers' model_type `name`)."""

    name: str
    prefix: str  # transformers' class prefix: {prefix}RotaryEmbedding, {prefix}ForCausalLM
    qkv_bias: bool = False  # q/k/v projections with a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head's q and k (Qwen3)
    window_by_default: bool = False  # a config's sliding_window is used unless use_sliding_window is false
    # stored layer tensor -> the canonical tensors it stacks along rows, in order (Phi-3)
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # the multipliers of its config (Granite); a family without one has each at its default
    scalars: tuple[Scalar, ...] = ()
    attention_scale_key: str | None = None  # the config key that replaces 1/sqrt(head_dim) (Granite)

    @property
    def modeling(self) -> str:
        """transformers' module of the family's classes."""
        return f"transformers.models.{self.name}.modeling_{self.name}"

    @property
    def causal_lm(self) -> str:
        return f"{self.prefix}ForCausalLM"

    def canonical(self, qkv_bias: bool | None = None, qk_norm: bool | None = None) -> list[str]:
        """The canonical layer tensors this family's layers have."""
        bias = self.qkv_bias if qkv_bias is None else qkv_bias
        norm = self.qk_norm if qk_norm is None else qk_norm
        return [k for k in CANONICAL if (".bias" not in k or bias) and ("_norm." not in k or norm)]

    def stored(self) -> list[str]:
        """The layer tensors its checkpoints hold (a fused one in place of its first part)."""
        parts = {p: name for name, ps in self.fused.items() for p in ps}
        out = []
        for k in self.canonical():
            if k not in parts:
                out.append(k)
            elif self.fused[parts[k]][0] == k:
                out.append(parts[k])
        return out

    def parts(self, stored: str) -> tuple[str, ...]:
        """The canonical tensors a stored layer tensor holds, stacked by rows (itself if not fused)."""
        return self.fused.get(stored, (stored,))

    def rows(self, shape: Any) -> dict[str, tuple[str, int, int]]:
        """canonical layer tensor -> (stored layer tensor, first row, end row) in the stored one."""
        sizes = {k: v[0] for k, v in layer_shapes(shape).items()}
        out = {}
        for stored in self.stored():
            start = 0
            for part in self.parts(stored):
                out[part] = (stored, start, start + sizes[part])
                start += sizes[part]
        return out

    def check_config(self, cfg: Any, where: str = "config.json") -> None:
        """This family's numbers: every multiplier a finite number, and > 0 where it divides or scales."""
        for key in [s.key for s in self.scalars] + ([self.attention_scale_key] if self.attention_scale_key else []):
            v = getattr(cfg, key, None)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise UserError(f"{where}: {key}={quote(v)} must be a finite number > 0")

    def scalar_values(self, cfg: Any) -> dict[str, float]:
        out = {s.name: float(getattr(cfg, s.key, s.default) if getattr(cfg, s.key, None) is not None else s.default)
               for s in self.scalars}
        if self.attention_scale_key and getattr(cfg, self.attention_scale_key, None) is not None:
            out["attention_scale"] = float(getattr(cfg, self.attention_scale_key))
        return out


def layer_shapes(shape: Any) -> dict[str, list[int]]:
    """The shape of every canonical tensor of one decoder layer of `shape` (a core.shape.ModelShape)."""
    D, q, kv, N, hd = shape.hidden, shape.heads * shape.head_dim, shape.kv_groups * shape.head_dim, shape.neurons, \
        shape.head_dim
    every = {"input_layernorm.weight": [D], "post_attention_layernorm.weight": [D],
             "self_attn.q_proj.weight": [q, D], "self_attn.k_proj.weight": [kv, D], "self_attn.v_proj.weight": [kv, D],
             "self_attn.o_proj.weight": [D, q], "self_attn.q_proj.bias": [q], "self_attn.k_proj.bias": [kv],
             "self_attn.v_proj.bias": [kv], "self_attn.q_norm.weight": [hd], "self_attn.k_norm.weight": [hd],
             "mlp.gate_proj.weight": [N, D], "mlp.up_proj.weight": [N, D], "mlp.down_proj.weight": [D, N]}
    return {k: every[k] for k in FAMILY[shape.family].canonical(shape.qkv_bias, shape.qk_norm)}


def stored_shapes(shape: Any, fused: bool = True) -> dict[str, list[int]]:
    """Every tensor a checkpoint of `shape` holds, with its shape: its family's own format (fused:
    the family's fused tensors), or the canonical one (a student's)."""
    fam, per = FAMILY[shape.family], layer_shapes(shape)
    out = {"model.embed_tokens.weight": [shape.vocab, shape.hidden], "model.norm.weight": [shape.hidden]}
    if not shape.tied:
        out["lm_head.weight"] = [shape.vocab, shape.hidden]
    for i in range(shape.layers):
        for key in (fam.stored() if fused else per):
            parts = fam.parts(key) if fused else (key,)
            out[f"model.layers.{i}.{key}"] = [sum(per[p][0] for p in parts), *per[parts[0]][1:]]
    return out


def _layer_key(name: str) -> tuple[str, str] | None:
    """model.layers.{i}.{key} -> (prefix with i, key)."""
    if not name.startswith("model.layers."):
        return None
    i, _, key = name[len("model.layers."):].partition(".")
    return f"model.layers.{i}.", key


def split_fused(sd: dict[str, torch.Tensor], shape: Any) -> dict[str, torch.Tensor]:
    """A state dict in the family's format -> the canonical one (a fused tensor's parts as row views)."""
    fam = FAMILY[shape.family]
    if not fam.fused:
        return dict(sd)
    rows, out = fam.rows(shape), {}
    for name, t in sd.items():
        where = _layer_key(name)
        if where is None or where[1] not in fam.fused:
            out[name] = t
            continue
        for part in fam.parts(where[1]):
            _, a, b = rows[part]
            out[where[0] + part] = t[a:b]
    return out


def join_fused(sd: dict[str, torch.Tensor], shape: Any) -> dict[str, torch.Tensor]:
    """A canonical state dict -> the family's format (its fused tensors stacked from their parts)."""
    fam = FAMILY[shape.family]
    if not fam.fused:
        return dict(sd)
    parts = {p: stored for stored, ps in fam.fused.items() for p in ps}
    out = {}
    for name, t in sd.items():
        where = _layer_key(name)
        if where is None or where[1] not in parts:
            out[name] = t
        elif fam.parts(parts[where[1]])[0] == where[1]:
            import torch

            out[where[0] + parts[where[1]]] = torch.cat([sd[where[0] + p] for p in fam.parts(parts[where[1]])])
    return out


FAMILY = {f.name: f for f in (
    Family("llama", "Llama", window_by_default=True),
    Family("qwen2", "Qwen2", qkv_bias=True),
    Family("qwen3", "Qwen3", qk_norm=True),
    Family("mistral", "Mistral", window_by_default=True),
    Family("phi3", "Phi3", window_by_default=True, fused={
        "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}),
    Family("granite", "Granite", scalars=(Scalar("embedding_multiplier", "embedding_multiplier", 1.0),
                                          Scalar("residual_multiplier", "residual_multiplier", 1.0),
                                          Scalar("logits_scaling", "logits_scaling", 1.0)),
           attention_scale_key="attention_multiplier"),
)}
FAMILIES = tuple(FAMILY)


def head_weight(weight: torch.Tensor, scaling: float = 1.0) -> torch.Tensor:
    """The LM head's matrix with the family's logit transform in it: the embedding (or head) matrix
    [V, D] divided by the logits scaling (Granite's; every other family's is 1, and nothing is
    divided). The losses take this matrix, so their gradients carry the transform too."""
    return weight if scaling == 1 else weight / scaling


def logits(h: torch.Tensor, weight: torch.Tensor, scaling: float = 1.0) -> torch.Tensor:
    """The LM head: h [..., D] -> logits [..., V]."""
    import torch.nn.functional as F

    return F.linear(h, head_weight(weight, scaling))
