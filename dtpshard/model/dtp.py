"""DTPModel: a Llama-family decoder run as L devices with delay δ (docs/design.md §1), on one machine.

The devices are a leading tensor axis: every device's residual stream lives in x [L, B, T, D],
and each module computes all devices' partials with batched matmuls over per-device weight
views (model/modules.py). Parameters keep Hugging Face's names and dense shapes, so the state dict
is a plain HF state dict (of the permuted model) and device l's slice of a weight is a view, not a
copy. The multi-process runtime (runtime/ranks.py) runs the same decoder, one device per process.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dtpshard.core.errors import UserError
from dtpshard.core.family import split_fused
from dtpshard.core.layout import as_layout
from dtpshard.core.permutation import apply_layout
from dtpshard.core.settings import DENSE, DTPSettings, resolve_dtp
from dtpshard.core.shape import shape_from_hf_config
from dtpshard.model.attention import KVCache
from dtpshard.model.checkpoint import DTP_JSON
from dtpshard.model.decoder import Decoder
from dtpshard.model.delay import schedule_for
from dtpshard.model.exchange import DeviceAxis, Exchange
from dtpshard.model.hf import PretrainedMixin, causal_lm_loss, output, resolve_dtype

__all__ = ["DTPModel", "DTP_JSON", "KVCache"]


class DTPModel(PretrainedMixin, Decoder):
    """L devices, delay δ. devices=1 or delay=0 is the dense model (up to float rounding).

    Behaves like a transformers causal LM where that is cheap: `.config` (the HF config), `.device`,
    `.dtype`, `forward(input_ids, attention_mask=None, labels=None)` returning transformers'
    `CausalLMOutputWithPast` (`.logits`, `.loss`), left-padded batches, `.generate(...)`."""

    def __init__(self, hf_config: Any, settings: DTPSettings | None = None, shared: int | None = None):
        """`settings`: core.settings.resolve_dtp's (None: its defaults); `shared`: the neurons of every
        layer replicated on all devices, the last ones (docs/design.md §6; None: what a student's
        config records, else none)."""
        shape = shape_from_hf_config(hf_config)
        Decoder.__init__(self, hf_config, shape if shared is None else replace(shape, shared=shared))
        self.layout_sha256: str | None = None  # Layout.content_sha256 of the layout applied (None: contiguous)
        self.use(resolve_dtp(self.shape) if settings is None else settings)

    def set_dtp(self, devices: int | None = None, delay: float | None = None, stage3: str | None = None) -> None:
        """Change L, δ or the stage-3 scale in place (weights are shared; only views change); a
        setting not given stays as it is."""
        self.use(resolve_dtp(self.shape, devices=devices, delay=delay, stage3=stage3, record=self.settings.to_json()))

    def use(self, settings: DTPSettings) -> None:
        self.settings = settings.check(self.shape)
        self.devices, self.delay, self.stage3 = settings.devices, settings.delay, settings.stage3
        self.steps = schedule_for(self.shape.modules, settings)
        self.dense_steps = schedule_for(self.shape.modules, DENSE)  # the teacher's, in an adapter run

    @contextmanager
    def delayed(self, delay: float) -> Iterator[None]:
        """This model at δ = `delay` inside the block, at its own settings again after it (a recipe's
        delay curriculum, training/recipes.py)."""
        own = self.settings
        if delay != own.delay:
            self.use(replace(own, delay=delay))
        try:
            yield
        finally:
            if self.settings is not own:
                self.use(own)

    def dtp_settings(self) -> dict[str, Any]:
        """L, δ, stage3 and, where some are, the shared neurons: what a student records (dtp_block)."""
        return {**self.settings.to_json(), **({"shared": self.shape.shared} if self.shape.shared else {})}

    # -- the forward pass ----------------------------------------------------------------
    def hidden(self, input_ids: torch.Tensor, cache: KVCache | None = None,
               attention_mask: torch.Tensor | None = None, dense: bool = False,
               after: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
        """h = mean_l FinalNorm(x_l): [B, T, D], the LM head's input (Decoder.head_input). dense: the
        same weights run as the dense model (L = 1, δ = 0), whatever this model's settings.
        `after(m, x)`: sees the streams [L, B, T, D] after each module m (Decoder.walk)."""
        steps, devices = (self.dense_steps, 1) if dense else (self.steps, self.devices)
        exchange = Exchange(steps, DeviceAxis(), devices)
        return self.head_input(self.run_streams(input_ids, devices, exchange, cache, attention_mask, after), exchange)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, cache: KVCache | None = None, logits_to_keep: int = 0) -> Any:
        """input_ids [B, T] -> transformers' CausalLMOutputWithPast: `.logits` [B, T, V] (only the last
        `logits_to_keep` positions if > 0), `.loss` with `labels` (transformers' shifted
        cross-entropy, -100 ignored), `.past_key_values` the `cache` given. `attention_mask` [B,
        cached + T] (1 real, 0 padding) for left-padded batches; positions count real tokens only."""
        if labels is not None and logits_to_keep:
            raise ValueError("labels need the logits of every position: logits_to_keep must be 0")
        h = self.hidden(input_ids, cache, attention_mask)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.logits(h)
        return output(logits, None if labels is None else causal_lm_loss(logits, labels), cache)

    # -- loading -------------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, hf_config: Any, state_dict: dict[str, torch.Tensor], devices: int | None = None,
                        delay: float | None = None, stage3: str | None = None, layout: Any = None,
                        dtype: torch.dtype | str = torch.float32, record: dict[str, Any] | None = None,
                        settings: DTPSettings | None = None, shared: int | None = None,
                        delayed: Any = None) -> DTPModel:
        """The DTP model of a dense (or distilled) state dict (its family's format, fused tensors and
        all, or the canonical one: core/family.py), permuted by `layout` (a Layout or its
        file). L, δ and stage3 as core.settings.resolve_dtp says: `settings` (already resolved) or
        the arguments, else the student's `record`, else the layout's, else the defaults. dtype
        "auto": the config's, else the weights' (as transformers). `shared`: the neurons the weights
        already hold last as shared (a permuted checkpoint's; None: a student's record, else 0); a
        shared `layout` makes its own shared."""
        shape = shape_from_hf_config(hf_config)
        where = f"layout {layout}" if isinstance(layout, (str, Path)) else "layout"  # name the file when there is one
        layout = as_layout(layout)
        if layout is not None and record is not None:  # a student (or permuted checkpoint) holds its layout already
            if layout.content_sha256() != record.get("layout_sha256"):
                raise UserError(f"{where}: the weights are in another layout's order already (sha256 "
                                f"{record.get('layout_sha256') or 'none: contiguous'}, this one's "
                                f"{layout.content_sha256()}): leave --layout out, or give the dense model")
            layout = None  # the same layout: applied when the weights were made, never twice
        shared = shape.shared if shared is None else shared
        if layout is not None:
            layout.check_model(shape, where=where)
            if shared:  # a permutation would move the shared tail the weights were saved with
                raise UserError(f"{where}: the model already holds {shared} shared neurons a layer, last; a layout "
                                "applies to the dense model it was made from")
            shared = layout.shared
        shape = replace(shape, shared=shared)
        given = ({"devices": devices, "delay": delay, "stage3": stage3, "delayed": delayed} if settings is None
                 else settings.to_json())
        settings = resolve_dtp(shape, **given, record=record, layout=layout, where=where)
        with torch.device("meta"):
            model = cls(hf_config, settings, shared)
        sd = {k: v for k, v in split_fused(state_dict, shape).items() if not k.endswith("rotary_emb.inv_freq")}
        if model.shape.tied:
            sd.pop("lm_head.weight", None)
        stored = next((v.dtype for v in sd.values() if v.is_floating_point()), None)
        dtype = resolve_dtype(dtype, hf_config, stored)
        if layout is not None:
            sd = apply_layout(sd, model.shape, layout)
            model.layout_sha256 = layout.content_sha256()
        elif record is not None:
            model.layout_sha256 = record.get("layout_sha256")
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        model.load_state_dict(sd, strict=True, assign=True)
        model.rebuild_buffers()
        return model
