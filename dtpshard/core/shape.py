"""What dtpshard needs to know about a checkpoint, and the one-line refusals.

The Hugging Face config is read by transformers (so rope parameters are normalised the same way
as in its reference implementation); everything the DTP code uses is copied into `ModelShape`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from dtpshard.core.errors import UserError

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class ModelShape:
    family: str
    layers: int  # n
    hidden: int  # D
    heads: int  # H query heads
    kv_groups: int  # G KV heads
    head_dim: int
    neurons: int  # N FFN neurons
    vocab: int
    rms_eps: float
    tied: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3

    @property
    def heads_per_group(self) -> int:  # r
        return self.heads // self.kv_groups

    @property
    def modules(self) -> int:  # M = 2n
        return 2 * self.layers

    def units(self, module: int) -> int:
        """Units of module m: KV groups for attention (even m), neurons for FFNs (odd m)."""
        return self.kv_groups if module % 2 == 0 else self.neurons

    def summary(self) -> dict[str, int]:
        return {"layers": self.layers, "kv_groups": self.kv_groups,
                "heads_per_group": self.heads_per_group, "neurons": self.neurons}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default)


def shape_from_hf_config(cfg: Any) -> ModelShape:
    """Validate a transformers config and return its shape; refuse anything DTP cannot run."""
    family = _get(cfg, "model_type")
    if family not in FAMILIES:
        raise UserError(f"model_type={family!r} is not supported (supported: {', '.join(FAMILIES)})")
    for moe_field in ("num_experts", "num_local_experts", "n_routed_experts"):
        if _get(cfg, moe_field):
            raise UserError(f"{moe_field}={_get(cfg, moe_field)} (mixture-of-experts models are not supported)")
    act = _get(cfg, "hidden_act", "silu")
    if act != "silu":
        raise UserError(f"hidden_act={act!r} is not supported (only SwiGLU with silu)")
    layer_types = _get(cfg, "layer_types") or []
    sliding_layers = [t for t in layer_types if t != "full_attention"]
    use_sw = _get(cfg, "use_sliding_window")
    window = _get(cfg, "sliding_window")
    if use_sw or sliding_layers or (window is not None and use_sw is None and family in ("mistral", "llama")):
        raise UserError(f"sliding_window={window!r} (use_sliding_window={use_sw!r}): "
                        "sliding-window attention is not supported")
    if family in ("llama", "mistral", "qwen3") and _get(cfg, "attention_bias"):
        raise UserError("attention_bias=True is not supported (an o_proj bias cannot be split into partials)")
    if _get(cfg, "mlp_bias"):
        raise UserError("mlp_bias=True is not supported")
    heads = cfg.num_attention_heads
    kv = _get(cfg, "num_key_value_heads") or heads
    if heads % kv:
        raise UserError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    head_dim = _get(cfg, "head_dim") or cfg.hidden_size // heads
    return ModelShape(
        family=family, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=heads,
        kv_groups=kv, head_dim=head_dim, neurons=cfg.intermediate_size, vocab=cfg.vocab_size,
        rms_eps=float(_get(cfg, "rms_norm_eps", 1e-6)), tied=bool(_get(cfg, "tie_word_embeddings", False)),
        qkv_bias=family == "qwen2", qk_norm=family == "qwen3")


def check_devices(shape: "ModelShape | dict[str, int]", devices: int, where: str | None = None) -> None:
    """L must be at least 1 and divide the KV groups and the neurons (docs/design.md §1). `shape`
    is a checkpoint's ModelShape (named as in config.json) or a layout/affinity file's model dict."""
    prefix = f"{where}: " if where else ""
    if devices < 1:
        raise UserError(f"{prefix}devices={devices} must be at least 1")
    units = ({"kv_groups": shape["kv_groups"], "neurons": shape["neurons"]} if isinstance(shape, dict)
             else {"num_key_value_heads": shape.kv_groups, "intermediate_size": shape.neurons})
    for name, n in units.items():
        if n % devices:
            raise UserError(f"{prefix}devices={devices} does not divide {name}={n}")


def check_delay(shape: "ModelShape | dict[str, int] | None", delay: float) -> None:
    """δ must be finite, >= 0 and at most the number of modules M (when a shape is given: a
    ModelShape or a layout/affinity file's model dict)."""
    if not math.isfinite(delay) or delay < 0:
        raise UserError(f"delay={delay}: must be a finite number >= 0")
    modules = None if shape is None else 2 * shape["layers"] if isinstance(shape, dict) else shape.modules
    if modules is not None and delay > modules:
        raise UserError(f"delay={delay} exceeds the number of modules M={modules}")


def check_context(hf_config: Any, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a generation that would run past the model's context (max_position_embeddings):
    positions beyond what the model was trained on give text that only looks like an answer."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_tokens + max_new_tokens > limit:
        raise UserError(f"--max-new-tokens {max_new_tokens}: the prompt's {prompt_tokens} tokens + {max_new_tokens} "
                        f"new ones exceed the model's context of {limit} positions (max_position_embeddings)")
