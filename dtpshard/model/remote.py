"""transformers' model class for a DTP student: `DTPForCausalLM`, a PreTrainedModel with
GenerationMixin whose forward is DTPModel's (the student format and DTPConfig: model/student.py).

The weights keep the family's names: DTPForCausalLM's parameters are DTPModel's own modules,
registered under the same names. The thin modeling_dtp.py and configuration_dtp.py in a
student's directory import DTPForCausalLM and DTPConfig from here.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationMixin, PreTrainedModel

from dtpshard.core.settings import read_record, resolve_dtp
from dtpshard.core.shape import shape_from_hf_config
from dtpshard.model.attention import KVCache
from dtpshard.model.dtp import DTPModel
from dtpshard.model.ops import Norm, Proj
from dtpshard.model.student import DTPConfig

__all__ = ["DTPConfig", "DTPForCausalLM"]


try:  # transformers 5: initialisers that skip the weights already loaded from the checkpoint
    from transformers import initialization as _init
except ImportError:  # 4.x calls _init_weights only for the weights the checkpoint lacks
    from torch.nn import init as _init


class DTPForCausalLM(PreTrainedModel, GenerationMixin):
    """DTPModel behind transformers' loading, saving and generate(). Its modules are the DTPModel's
    own (`model`, `lm_head`), registered here under the same names, so the state dict is the
    family's and the forward is DTPModel's; the DTPModel itself is kept outside the module tree
    (its parameters would otherwise be counted twice)."""

    config_class = DTPConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: DTPConfig):
        super().__init__(config)
        record = read_record(getattr(config, "dtp", None), "config.json dtp") or {}
        settings = resolve_dtp(shape_from_hf_config(config), record=record)
        dtp = DTPModel(config, settings)
        dtp.layout_sha256 = record.get("layout_sha256")
        self.model, self.lm_head = dtp.model, dtp.lm_head
        self.__dict__["_dtp"] = dtp  # not a submodule: see the class docstring
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # DTP keeps its own KV cache (every device its own groups): generate must not make one

    def _init_weights(self, module: torch.nn.Module) -> None:
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, (Proj, torch.nn.Embedding)):
            _init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                _init.zeros_(module.bias)
        elif isinstance(module, Norm):
            _init.ones_(module.weight)

    @property
    def dtp_model(self) -> Any:
        """The DTPModel that runs the forward, its rotary tables made again where they are stale
        (built on the meta device by transformers' loading, or left behind by .to())."""
        dtp = self.__dict__["_dtp"]
        inv = getattr(dtp.rotary, "inv_freq", None)
        if inv is None or inv.device != dtp.device:
            dtp.rebuild_buffers()
        return dtp

    def get_output_embeddings(self) -> torch.nn.Module | None:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, cache: Any = None, past_key_values: Any = None,
                use_cache: bool | None = None, logits_to_keep: int = 0, return_dict: bool | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """DTPModel.forward; `cache` (transformers 5's name) or `past_key_values` (4.x's) is a
        dtpshard KVCache, made here when use_cache (default: the config's, except with labels or in
        training) and none is given, and returned in the output.
        position_ids are not read: positions come from the cache and the attention mask, as
        transformers' generate makes them."""
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("DTPForCausalLM takes input_ids (inputs_embeds are not supported)")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, KVCache):
            raise ValueError(f"DTPForCausalLM keeps its own KV cache, not a {type(cache).__name__}")
        if use_cache is None:  # not while training: a cache also turns gradient checkpointing off
            use_cache = bool(getattr(self.config, "use_cache", True)) and labels is None and not self.training
        dtp = self.dtp_model
        if cache is None and use_cache:
            cache = dtp.new_cache()
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: the unmasked path, as `dtpshard generate` runs it
        out = dtp(input_ids, attention_mask=attention_mask, labels=labels, cache=cache, logits_to_keep=logits_to_keep)
        return out if return_dict is not False else out.to_tuple()

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, cache: Any = None, past_key_values: Any = None,
                                      attention_mask: torch.Tensor | None = None, use_cache: bool | None = True,
                                      **kwargs: Any) -> dict[str, Any]:
        """The tokens the cache has not seen, the cache, the mask (over cached + new tokens)."""
        cache = cache if cache is not None else past_key_values
        seen = 0 if cache is None else cache.length
        return {"input_ids": input_ids[:, seen:], "cache": cache, "attention_mask": attention_mask,
                "use_cache": use_cache, "logits_to_keep": 1}
