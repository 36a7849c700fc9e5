"""What dtpshard needs to know about a checkpoint, and the one-line refusals.

The Hugging Face config is read by transformers (so rope parameters are normalised the same way
as in its reference implementation); everything the DTP code uses is copied into `ModelShape`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from dtpshard.core.errors import UserError, quote
from dtpshard.core.family import ACTIVATIONS, FAMILIES, FAMILY  # noqa: F401 - FAMILIES: the names, re-exported

STUDENT_TYPE = "dtp"  # a distilled student's model_type (model/student.py): its `dtp` block names the base family
UNIT_FIELDS = ("layers", "kv_groups", "heads_per_group", "neurons")  # what a layout or an affinity file records


@dataclass(frozen=True)
class UnitShape:
    """The units a layout permutes: n layers, each with G KV groups of r query heads and N neurons.

    A layout or an affinity file knows only this much of a model; `ModelShape` is a UnitShape with
    the rest of the checkpoint's shape, so every function that needs units takes either."""

    layers: int  # n
    kv_groups: int  # G KV heads
    heads_per_group: int  # r
    neurons: int  # N FFN neurons

    @property
    def modules(self) -> int:  # M = 2n
        return 2 * self.layers

    def units(self, module: int) -> int:
        """Units of module m: KV groups for attention (even m), neurons for FFNs (odd m)."""
        return self.kv_groups if module % 2 == 0 else self.neurons

    def unit_shape(self) -> UnitShape:
        return UnitShape(self.layers, self.kv_groups, self.heads_per_group, self.neurons)

    def same_units(self, other: UnitShape) -> bool:
        return self.unit_shape() == other.unit_shape()

    def differences(self, other: UnitShape) -> list[str]:
        """'field=A vs B' for every field of this shape that differs in `other`."""
        return [f"{f.name}={getattr(self, f.name)} vs {getattr(other, f.name, None)}" for f in fields(self)
                if getattr(self, f.name) != getattr(other, f.name, None)]

    def to_json(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in UNIT_FIELDS}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> UnitShape:
        """A file's `model` object, refused in one line unless it gives four positive integers
        (no other key), none beyond what a model can have (MAX_UNITS, MAX_LAYERS): every array
        sized by them is made after this check."""
        ok = isinstance(obj, dict) and all(isinstance(obj.get(k), int) and not isinstance(obj.get(k), bool)
                                           and obj[k] >= 1 for k in UNIT_FIELDS)
        if not ok:
            raise UserError(f"{where}: model must give positive integer {', '.join(UNIT_FIELDS)}")
        extra = sorted(str(k) for k in obj if k not in UNIT_FIELDS)
        if extra:
            raise UserError(f"{where}: model has unknown key {extra[0]!r} (known: {', '.join(UNIT_FIELDS)})")
        check_sizes({k: obj[k] for k in UNIT_FIELDS}, where)
        return cls(*(obj[k] for k in UNIT_FIELDS))


@dataclass(frozen=True)
class ModelShape(UnitShape):
    """A checkpoint's shape: the units, and what the forward pass needs besides."""

    family: str
    hidden: int  # D
    head_dim: int
    vocab: int
    rms_eps: float
    tied: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3
    # what some families add (core/family.py); the defaults are every other family's
    act: str = "silu"  # the gate's activation (ACTIVATIONS)
    embedding_multiplier: float = 1.0  # the embedding's scale (Granite)
    residual_multiplier: float = 1.0  # each module output's scale before it joins the stream (Granite)
    attention_scale: float | None = None  # the scores' factor (None: 1/sqrt(head_dim); Granite's multiplier)
    logits_scaling: float = 1.0  # logits are divided by it (Granite)
    rotary_dim: int | None = None  # dimensions of each head that rotate (None: all; a partial rotary factor)
    window: int | None = None  # sliding-window attention: each query sees the `window` latest positions
    # FFN neurons of every layer replicated on all devices, the last `shared` of each layer (docs/design.md
    # §6): not a config.json key but what a shared layout, or a student recording it, adds
    shared: int = 0

    @property
    def heads(self) -> int:  # H query heads
        return self.kv_groups * self.heads_per_group

    @property
    def sharded(self) -> int:
        """Neurons of a layer split over the devices: N less the shared ones."""
        return self.neurons - self.shared

    def shard(self, devices: int) -> ModelShape:
        """The shape of one device's share: G/L KV groups (with their heads), its (N - n)/L sharded
        neurons and the n shared ones, last."""
        check_devices(self, devices)
        return replace(self, kv_groups=self.kv_groups // devices, neurons=self.sharded // devices + self.shared)

    def layer_params(self) -> int:
        """Weights of one decoder layer's projections (norm gains are negligible)."""
        qkv = self.hidden * (self.heads + 2 * self.kv_groups) * self.head_dim
        attention = qkv + self.heads * self.head_dim * self.hidden  # + o_proj
        return attention + 3 * self.neurons * self.hidden

    def params(self) -> int:
        """Every weight: the layers, the embedding and (untied) the LM head."""
        return self.layers * self.layer_params() + self.vocab * self.hidden * (1 if self.tied else 2)

    def to_dict(self) -> dict[str, Any]:
        """The shape as a run's config.json records it (compared on resume, so its keys stay fixed: a
        field at its default is left out, as runs recorded before it existed have it)."""
        out = {"family": self.family, "layers": self.layers, "hidden": self.hidden, "heads": self.heads,
               "kv_groups": self.kv_groups, "head_dim": self.head_dim, "neurons": self.neurons,
               "vocab": self.vocab, "rms_eps": self.rms_eps, "tied": self.tied, "qkv_bias": self.qkv_bias,
               "qk_norm": self.qk_norm}
        return {**out, **{f.name: getattr(self, f.name) for f in fields(self)[len(fields(UnitShape)) + 8:]
                          if getattr(self, f.name) != f.default}}


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default)


def family_config(cfg: Any) -> Any:
    """The base family's config (LlamaConfig, ...) of a config: a DTP student's (model_type "dtp",
    model/student.py's DTPConfig) rebuilt from its fields, any other config as it is. The one place
    that tells a student's config from its family's: the shape and the rotary tables read this."""
    if _get(cfg, "model_type") != STUDENT_TYPE:
        return cfg
    base = getattr(cfg, "base_config", None)
    if not callable(base):
        raise UserError(f"model_type={STUDENT_TYPE!r}: a DTP student's config, but not read by dtpshard "
                        "(load it with dtpshard.model.checkpoint.load_hf_config)")
    return base()


def _window(cfg: Any, family: str) -> int | None:
    """The sliding window a config uses, None if none; windows that vary by layer are refused."""
    layer_types = _get(cfg, "layer_types") or []
    use_sw, window = _get(cfg, "use_sliding_window"), _get(cfg, "sliding_window")
    if use_sw or any(t != "full_attention" for t in layer_types):  # Qwen's windows on some layers
        raise UserError(f"sliding_window={window!r} (use_sliding_window={use_sw!r}): sliding-window attention on "
                        "some layers only is not supported")
    if window is None or use_sw is False or not FAMILY[family].window_by_default:
        return None
    if not _is_int(window) or window < 1:
        raise UserError(f"config.json: sliding_window={quote(window)} must be a positive integer")
    limit = _get(cfg, "max_position_embeddings")
    return None if isinstance(limit, int) and window >= limit else window


def _rotary_dim(cfg: Any, head_dim: int) -> int | None:
    params = _get(cfg, "rope_parameters") or {}
    factor = params.get("partial_rotary_factor", _get(cfg, "partial_rotary_factor", 1.0)) if isinstance(params, dict) \
        else 1.0
    if not _is_number(factor) or not 0 < factor <= 1:
        raise UserError(f"config.json: partial_rotary_factor={quote(factor)} must be in (0, 1]")
    dim = int(head_dim * factor)
    if dim % 2:
        raise UserError(f"config.json: partial_rotary_factor={factor} rotates {dim} of {head_dim} dimensions, an "
                        "odd number (rotary embeddings rotate pairs)")
    return None if dim == head_dim else dim


def shape_from_hf_config(cfg: Any) -> ModelShape:
    """Validate a transformers config (a DTP student's: its base family's, with the shared neurons
    its dtp block records) and return its shape; refuse anything DTP cannot run."""
    shared = student_shared(cfg)
    cfg = family_config(cfg)
    family = _get(cfg, "model_type")
    if family not in FAMILIES:
        raise UserError(f"model_type={family!r} is not supported (supported: {', '.join(FAMILIES)})")
    spec = FAMILY[family]
    for moe_field in ("num_experts", "num_local_experts", "n_routed_experts"):
        if _get(cfg, moe_field):
            raise UserError(f"{moe_field}={_get(cfg, moe_field)} (mixture-of-experts models are not supported)")
    act = _get(cfg, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UserError(f"hidden_act={act!r} is not supported (a gated FFN with {', '.join(ACTIVATIONS)})")
    window = _window(cfg, family)
    if not spec.qkv_bias and _get(cfg, "attention_bias"):
        raise UserError("attention_bias=True is not supported (an o_proj bias cannot be split into partials)")
    if _get(cfg, "mlp_bias"):
        raise UserError("mlp_bias=True is not supported")
    check_numbers(cfg.to_dict() if callable(getattr(cfg, "to_dict", None)) else vars(cfg))  # an in-memory config too
    spec.check_config(cfg)
    heads = cfg.num_attention_heads
    kv = _get(cfg, "num_key_value_heads") or heads
    head_dim = _get(cfg, "head_dim") or cfg.hidden_size // heads
    return ModelShape(
        family=family, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads_per_group=heads // kv,
        kv_groups=kv, head_dim=head_dim, neurons=cfg.intermediate_size, vocab=cfg.vocab_size,
        rms_eps=float(_get(cfg, "rms_norm_eps", 1e-6)), tied=bool(_get(cfg, "tie_word_embeddings", False)),
        qkv_bias=spec.qkv_bias, qk_norm=spec.qk_norm, act=act, rotary_dim=_rotary_dim(cfg, head_dim), window=window,
        shared=_check_recorded_shared(shared, cfg.intermediate_size), **spec.scalar_values(cfg))


def student_shared(cfg: Any) -> Any:
    """The shared neurons a DTP student's dtp block records (docs/design.md §6): 0 for any other
    config, or a student that records none."""
    block = getattr(cfg, "dtp", None) if _get(cfg, "model_type") == STUDENT_TYPE else None
    return block.get("shared", 0) if isinstance(block, dict) else 0


def _check_recorded_shared(shared: Any, neurons: int) -> int:
    if not _is_int(shared) or not 0 <= shared < neurons:
        raise UserError(f"config.json: dtp.shared={quote(shared)} must be an integer from 0 to intermediate_size - 1 "
                        f"= {neurons - 1} (the student's weights have {neurons} neurons a layer)")
    return shared


_DIMENSIONS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
_OPTIONAL_DIMENSIONS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
MAX_PARAMS = 1 << 42  # 4.4e12 weights: beyond any dense model (405B has 4e11); the product of damaged dimensions


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def rope_thetas(raw: dict[str, Any]) -> dict[str, Any]:
    """Every rope θ a config gives, by its key: the top-level rope_theta (transformers before 5) and
    the rope_parameters block (transformers 5), per layer type where it is nested."""
    out = {k: raw[k] for k in ("rope_theta",) if k in raw}
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        nested = {f"rope_parameters.{k}": v for k, v in params.items() if isinstance(v, dict)}
        for key, block in ({"rope_parameters": params} if "rope_theta" in params else nested).items():
            if "rope_theta" in block:
                out[f"{key}.rope_theta"] = block["rope_theta"]
    return out


CONFIG_DTYPES = ("float32", "float16", "bfloat16", "float64")  # config.json's dtype, as the weights may be stored


def check_numbers(raw: dict[str, Any], where: str = "config.json") -> None:
    """A config.json's numbers checked as a model's, before transformers or anything else reads them:
    every dimension a positive integer, eps and rope θ finite and positive, heads x head_dim
    consistent, and the weights the dimensions imply bounded (MAX_PARAMS, MAX_UNITS), so nothing is
    allocated, traced or planned from a number no model has."""
    for name in _DIMENSIONS + _OPTIONAL_DIMENSIONS:
        v = raw.get(name)
        if v is None and name in _OPTIONAL_DIMENSIONS:
            continue
        if name not in raw:  # transformers would fill in its class default: a model we did not see
            raise UserError(f"{where}: no {name} (write it: transformers would take a default for it)")
        if not _is_int(v) or v < 1:
            raise UserError(f"{where}: {name}={quote(v)} must be a positive integer")
    for name, v in {"rms_norm_eps": raw.get("rms_norm_eps", 1e-6), **rope_thetas(raw)}.items():
        if not _is_number(v) or not math.isfinite(v) or v <= 0:
            raise UserError(f"{where}: {name}={quote(v)} must be a finite number > 0")
    check_scales(raw, where)
    for name in ("dtype", "torch_dtype"):  # read through getattr(torch, ...) by transformers: typed first
        v = raw.get(name)
        if v is not None and v not in CONFIG_DTYPES:
            raise UserError(f"{where}: {name}={quote(v)} is not a dtype dtpshard computes in (one of "
                            f"{', '.join(CONFIG_DTYPES)}; a quantised checkpoint must be dequantised first)")
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    kv = raw.get("num_key_value_heads") or heads
    if heads % kv:
        raise UserError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    head_dim = raw.get("head_dim")
    if head_dim is None and hidden % heads:
        raise UserError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                        "(and no head_dim is given)")
    head_dim = head_dim or hidden // heads
    if head_dim % 2:
        raise UserError(f"{where}: head_dim={head_dim} is odd (rotary embeddings rotate pairs of dimensions)")
    check_sizes({k: raw[k] for k in _DIMENSIONS + _OPTIONAL_DIMENSIONS if k != "max_position_embeddings"
                 and raw.get(k) is not None}, where)
    implied = ModelShape(layers=raw["num_hidden_layers"], kv_groups=kv, heads_per_group=heads // kv,
                         neurons=raw["intermediate_size"], family=str(raw.get("model_type")), hidden=hidden,
                         head_dim=head_dim, vocab=raw["vocab_size"], rms_eps=0.0, tied=False, qkv_bias=False,
                         qk_norm=False)
    params = implied.params()  # counted untied: the bound is on what the dimensions could hold
    if params > MAX_PARAMS:
        raise UserError(f"{where}: its dimensions imply {params:.3g} weights, beyond any model "
                        f"(at most {MAX_PARAMS:.3g}); the file is damaged")


SCALE_RANGE = (2.0 ** -20, 2.0 ** 20)  # any model's multiplier or scaling lies far inside (Granite's: 1/128 to 12)
_SCALES = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
           "partial_rotary_factor")


def check_scales(raw: dict[str, Any], where: str = "config.json") -> None:
    """Multipliers and scalings (Granite's, Phi-3's rotary factor, a rope scaling's factor) are
    numbers within SCALE_RANGE: one far outside it overflows a forward to NaN on its own."""
    values = {k: raw[k] for k in _SCALES if raw.get(k) is not None}
    for block in ("rope_scaling", "rope_parameters"):
        if isinstance(raw.get(block), dict) and raw[block].get("factor") is not None:
            values[f"{block}.factor"] = raw[block]["factor"]
    lo, hi = SCALE_RANGE
    for name, v in values.items():
        if not _is_number(v) or not lo <= v <= hi:  # NaN fails both comparisons
            raise UserError(f"{where}: {name}={quote(v)} must be a number in [{lo:.3g}, {hi:.3g}] (any model's "
                            "lies far inside)")


MAX_LAYERS = 1 << 16  # far beyond any model (405B has 126); a count beyond it is a damaged file
MAX_UNITS = 1 << 24  # per dimension: heads, KV groups, neurons, hidden, head_dim, vocab (16.7M)


def check_sizes(sizes: dict[str, int], where: str) -> None:
    """Refuse a dimension no model has before anything is allocated from it."""
    for name, n in sizes.items():
        limit = MAX_LAYERS if name in ("layers", "num_hidden_layers") else MAX_UNITS
        if isinstance(n, int) and n > limit:
            raise UserError(f"{where}: {name}={n} is beyond any model (at most {limit}); the file is damaged")


def check_devices(shape: UnitShape, devices: int, where: str | None = None, shared: int | None = None) -> None:
    """L must be at least 1 and divide the KV groups and the sharded neurons (docs/design.md §1, §6:
    the neurons less the `shared` ones, default the shape's own). Named as config.json names them
    for a checkpoint's shape, as the file does for a layout's or affinity's."""
    prefix = f"{where}: " if where else ""
    if devices < 1:
        raise UserError(f"{prefix}devices={devices} must be at least 1")
    shared = getattr(shape, "shared", 0) if shared is None else shared
    names = ("num_key_value_heads", "intermediate_size") if isinstance(shape, ModelShape) else ("kv_groups", "neurons")
    for name, n in zip(names, (shape.kv_groups, shape.neurons)):
        if n % devices and not (shared and name == names[1]):
            raise UserError(f"{prefix}devices={devices} does not divide {name}={n}")
    check_shared(shape.neurons, devices, shared, prefix)


def check_shared(neurons: int, devices: int, shared: int, prefix: str = "") -> None:
    """n shared neurons of N leave at least one sharded neuron, and N - n divisible by L."""
    if not 0 <= shared < neurons:
        raise UserError(f"{prefix}shared={shared} neurons of {neurons}: must leave at least one sharded neuron")
    if (neurons - shared) % devices:
        raise UserError(f"{prefix}devices={devices} does not divide the {neurons - shared} sharded neurons "
                        f"(intermediate_size={neurons} less shared={shared})")


def shared_count(neurons: int, devices: int, fraction: float) -> int:
    """The seed code's count of shared neurons: the smallest n >= fraction·N that leaves N - n
    divisible by L (10% of 3072 on 4 devices: 308). Refused in one line when it leaves none sharded."""
    if not 0 <= fraction < 1:
        raise UserError(f"--shared {fraction:g}: the fraction of neurons shared must be in [0, 1)")
    n = math.ceil(round(fraction * neurons, 9))  # rounded first: 0.1 x 3070 is 307.00000000000006
    if fraction > 0 and n == 0:  # a fraction asked for is never silently none
        raise UserError(f"--shared {fraction:g}: shares no neuron of {neurons}; the smallest fraction that shares "
                        f"one is {1 / neurons:.3g} (or give 0 for none)")
    while (neurons - n) % devices:
        n += 1
    if n >= neurons:
        raise UserError(f"--shared {fraction:g}: {n} of {neurons} neurons shared on {devices} devices leaves no "
                        "sharded neuron")
    return n


def check_delay(shape: UnitShape | None, delay: float) -> None:
    """δ must be finite, >= 0 and at most the number of modules M (when a shape is given)."""
    shown = f"{float(delay):g}"  # a whole δ of 1e308 is an int of 309 digits: shown as the number it is
    if not math.isfinite(delay) or delay < 0:
        raise UserError(f"delay={shown}: must be a finite number >= 0")
    if shape is not None and delay > shape.modules:
        raise UserError(f"delay={shown} exceeds the number of modules M={shape.modules}")


def check_context(hf_config: Any, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a generation that would run past the model's context (max_position_embeddings):
    positions beyond what the model was trained on give text that only looks like an answer."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_tokens + max_new_tokens > limit:
        raise UserError(f"--max-new-tokens {max_new_tokens}: the prompt's {prompt_tokens} tokens + {max_new_tokens} "
                        f"new ones exceed the model's context of {limit} positions (max_position_embeddings)")


def check_seq_len(hf_config: Any, seq_len: int, flag: str = "--seq-len") -> None:
    """Refuse blocks longer than the model's context (max_position_embeddings): calibrated,
    trained or evaluated on positions it was never trained on, a run measures something else."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and seq_len > limit:
        raise UserError(f"{flag} {seq_len}: beyond the model's context of {limit} positions "
                        "(max_position_embeddings); use a shorter --seq-len")
