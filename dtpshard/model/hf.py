"""What makes `DTPModel` look like a transformers causal LM: the loss, the output object,
`dtype="auto"`, loading and saving, and the DTP block a student records in its config.json."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Self

import torch
import torch.nn.functional as F

from dtpshard.core.devices import DTYPES, config_dtype, dtype_name
from dtpshard.core.errors import UserError
from dtpshard.core.settings import warn_if_other_settings
from dtpshard.model.checkpoint import Checkpoint, open_checkpoint, save_checkpoint
from dtpshard.model.decode import generate_ids
from dtpshard.model.shards import DEFAULT_MAX_SHARD_SIZE, Weights


def output(logits: torch.Tensor, loss: torch.Tensor | None = None, cache: Any = None) -> Any:
    """transformers' own output class, so `.logits`, `.loss`, `out[0]` and `out["logits"]` work."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    out = CausalLMOutputWithPast(loss=loss, logits=logits)
    if cache is not None:  # transformers 5 names the field `cache`, 4.x `past_key_values`
        out["cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"] = cache
    return out


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' ForCausalLMLoss: position t predicts labels[t + 1], -100 ignored, mean over the rest."""
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].to(logits.device)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)


def resolve_dtype(dtype: Any, hf_config: Any, stored: torch.dtype | None) -> torch.dtype:
    """`dtype="auto"` (transformers' rule): the config's dtype, else the stored weights' dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise UserError(f"dtype={dtype!r}: one of auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    named = config_dtype(hf_config)
    if isinstance(named, str):
        named = DTYPES.get(named)
    if isinstance(named, torch.dtype) and named.is_floating_point:
        return named
    return stored if stored is not None and stored.is_floating_point else torch.float32


class PretrainedMixin:
    """DTPModel's transformers-like surface: config/device/dtype, generate, loading and saving."""

    @property
    def config(self) -> Any:  # the Hugging Face config, as on a transformers model
        return self.hf_config

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 20, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 attention_mask: torch.Tensor | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, seed: int | None = None) -> torch.Tensor:
        """[B, T] prompt ids -> [B, T + new] with the KV cache, as transformers' generate: greedy
        unless do_sample (then temperature, top_k, top_p); rows that emitted an EOS token are
        padded after it; stops when all have. eos_token_id defaults to the config's; `seed` fixes
        the sampling generator (None: torch's global RNG). `dtpshard generate` calls this."""
        if eos_token_id is None:
            eos_token_id = getattr(self.hf_config, "eos_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(self.hf_config, "pad_token_id", None)
        return generate_ids(self, input_ids.to(self.device), max_new_tokens, temperature if do_sample else 0.0,
                            top_k, seed, eos_token_id, top_p=top_p, attention_mask=attention_mask,
                            pad_id=pad_token_id)

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module, devices: int | None = None, delay: float | None = None,
                **kw: Any) -> Self:
        """From an in-memory transformers model (e.g. one dequantised from GGUF)."""
        sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
        return cls.from_state_dict(hf_model.config, sd, devices, delay, **kw)

    @classmethod
    def from_pretrained(cls, path: str | Path, devices: int | None = None, delay: float | None = None,
                        dtype: torch.dtype | str = "auto", layout: Any = None, stage3: str | None = None,
                        device: str | torch.device = "cpu", delayed: Any = None) -> Self:
        """Load a local HF checkpoint directory. L, δ, stage3 and the delayed modules: the arguments,
        else what a distilled student recorded (the `dtp` block of its config.json, or its dtp.json),
        else the layout's, else core.settings.DEFAULT (core.settings.resolve_dtp). dtype "auto" keeps
        the checkpoint's (a bf16 checkpoint loads as bf16), as transformers does."""
        return cls.from_checkpoint(open_checkpoint(path), devices, delay, dtype, layout, stage3, device, delayed)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, devices: int | None = None, delay: float | None = None,
                        dtype: torch.dtype | str = "auto", layout: Any = None, stage3: str | None = None,
                        device: str | torch.device = "cpu", delayed: Any = None) -> Self:
        """from_pretrained of a checkpoint a command has open already (config.json not read again)."""
        ckpt.check_fits(dtype)
        model = cls.from_state_dict(ckpt.hf_config, ckpt.state_dict(), devices, delay, stage3, layout, dtype,
                                    ckpt.defaults, shared=ckpt.shape.shared, delayed=delayed)
        warn_if_other_settings(ckpt.path, ckpt.record, model.settings, ckpt.shape.modules)
        model.source_path = Path(ckpt.path)
        model.checkpoint = ckpt  # opened once: its tokenizer, files and record without reading config.json again
        return model.to(device)

    def dtp_block(self) -> dict[str, Any]:
        """What a student records (config.json's `dtp` block and dtp.json): the settings it runs with."""
        return {**self.dtp_settings(), "layout_sha256": self.layout_sha256}

    def save_pretrained(self, out_dir: Path, source: Path | None = None, weights: Weights | None = None,
                        dtype: torch.dtype | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                        write: bool = True, card: str | None = None) -> None:
        """Write the student (into an already-temporary `out_dir`): the weights (`weights`, default
        this model's own; a sharded model passes the gathering ones) in safetensors shards of at
        most `max_shard_size`, in `dtype` (default the model's), under the base family's names;
        config.json as model_type "dtp" (model/student.py: the family's fields, the `dtp` block,
        architectures and auto_map), the remote-code files that make transformers load it as
        DTP, the model card README.md (`card`, default one without a run's numbers) and the
        tokenizer files (copied from `source`)."""
        from dtpshard.model.student import REMOTE_CODE, DTPConfig, usage_card

        dtype = dtype or self.dtype
        config = DTPConfig.for_student(self.hf_config, self.dtp_block())  # a new object: the teacher's is untouched
        config.dtype = dtype  # what dtype="auto" will load: the weights as saved
        weights = weights or Weights.of(self.state_dict(), dtype)
        save_checkpoint(Path(out_dir), config, weights, source or getattr(self, "source_path", None),
                        max_shard_size=max_shard_size, write=write)
        if write:
            for name, text in {**REMOTE_CODE, "README.md": card or usage_card(config, dtype_name(dtype))}.items():
                (Path(out_dir) / name).write_text(text, encoding="utf-8")
