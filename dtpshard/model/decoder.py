"""The decoder both DTP forwards share: embedding, layers, final norm and LM head with transformers'
parameter names, and the loop over the delay schedule.

The loop is written once (`Decoder.walk`): every device's residual stream starts as the token
embedding, each module's partials are computed from the streams (modules.Module.partials) and
handed to the exchange (model/exchange.py), which adds them as the schedule says (model/delay.py),
moving them over the devices axis (the simulator) or over torch.distributed (a rank's Link,
runtime/ranks.py).
A rank is the same decoder built for one device's shard of the shape, run with L = 1; the dense
model (model/dense.py) is the whole decoder at L = 1, δ = 0, and calibration reads what each
module computed through the loop's `hook`.
"""
from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtpshard.core.errors import UserError
from dtpshard.core.family import FAMILY, head_weight, logits
from dtpshard.core.shape import ModelShape, family_config
from dtpshard.model.attention import KVCache
from dtpshard.model.exchange import DeviceAxis, Exchange
from dtpshard.model.modules import Layer, Partials, Trace, sequence
from dtpshard.model.ops import Norm, Proj


def checkpoint_segment(modules: int) -> int:
    """Modules per gradient-checkpointing segment: about √(M/2), which balances the segments'
    saved starts (two [L, B, T, D] tensors each at δ ≤ 1) against one segment's activations
    recomputed at once in backward (a module's are about four such tensors)."""
    return max(1, round(math.sqrt(modules / 2)))


def rotary_for(hf_config: Any) -> nn.Module:
    """The family's own transformers rotary class (rope scaling and theta exactly as transformers);
    a student's config gives its base family's."""
    cfg = family_config(hf_config)
    family = FAMILY[cfg.model_type]
    return getattr(importlib.import_module(family.modeling), family.prefix + "RotaryEmbedding")(config=cfg)


def positions_from_mask(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """Position ids [B, length] of the last `length` tokens, counted over real tokens only, as
    transformers' generate does for left padding (padding positions get 1, never read)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)[:, -length:]


def padding_attn_mask(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """Boolean SDPA mask [B, 1, T, S] for the last T = `length` queries over S = mask width keys:
    causal and no padding key. A padding query also sees itself, so no row is empty (an all-False
    row makes SDPA return NaN); its output is never read by a real token."""
    S = attention_mask.shape[1]
    q = torch.arange(S - length, S, device=attention_mask.device)[:, None]  # [T, 1] absolute position
    k = torch.arange(S, device=attention_mask.device)[None]  # [1, S]
    allowed = (k <= q)[None] & attention_mask.bool()[:, None, :]  # [B, T, S]
    return (allowed | (k == q)[None])[:, None]


class Decoder(nn.Module):
    """The parameters of a Llama-family decoder of shape `shape` (a rank's: its shard), and its forward
    over a delay schedule and an exchange."""

    def __init__(self, hf_config: Any, shape: ModelShape):
        super().__init__()
        self.hf_config, self.shape = hf_config, shape
        s = shape
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.model.layers = nn.ModuleList(Layer(s) for _ in range(s.layers))
        self.model.norm = Norm(s.hidden, s.rms_eps)
        self.lm_head = None if s.tied else Proj(s.vocab, s.hidden)
        self.rotary = rotary_for(hf_config)
        self.gradient_checkpointing = False
        self.sequence = sequence(self.model, s.layers)  # the 2n modules: views, no parameters of their own

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [V, D]
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's matrix with the family's logit transform (core/family.py head_weight)."""
        return head_weight(self.lm_head_weight, self.shape.logits_scaling)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head: h [..., D] (head_input's) -> logits [..., V]."""
        return logits(h, self.lm_head_weight, self.shape.logits_scaling)

    def new_cache(self) -> KVCache:
        return KVCache(self.shape.layers)

    def rebuild_buffers(self) -> None:
        """The rotary tables are buffers computed from the config, not weights: after a load onto
        the meta device (or to_empty) they are made again."""
        self.rotary = rotary_for(self.hf_config).to(self.lm_head_weight.device)

    def module_partials(self, m: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        cache: Any = None, mask: torch.Tensor | None = None) -> Partials:
        """(partials p^m, local) [L, B, T, D] of module m (2i: attention i, 2i+1: FFN i) from the
        streams x (modules.Module.partials)."""
        return self.sequence[m].partials(x, cos, sin, cache, mask)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, D] embeddings (times the family's embedding multiplier)."""
        e = self.model.embed_tokens(input_ids)
        return e if self.shape.embedding_multiplier == 1 else e * self.shape.embedding_multiplier

    def rope(self, x: torch.Tensor, start: int | torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, 1, length, hd] of positions start .. start + length - 1."""
        cos, sin = self.rotary(x, torch.arange(length, device=x.device)[None] + start)  # [1, T, hd]
        return cos[:, None], sin[:, None]

    def _rope(self, emb: torch.Tensor, devices: int, cache: Any,
              attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(cos, sin, mask) for the new tokens: [1, 1, T, hd] and no mask, or for a left-padded batch
        [L*B, 1, T, hd] and its mask, repeated over the devices in the heads' device-major order."""
        B, T = emb.shape[:2]
        if attention_mask is None:
            return (*self.rope(emb, 0 if cache is None else cache.start(), T), None)
        past = 0 if cache is None else cache.length
        if tuple(attention_mask.shape) != (B, past + T):
            raise UserError(f"attention_mask has shape {list(attention_mask.shape)}, expected [{B}, {past + T}] "
                            "(batch, cached + new tokens)")
        attention_mask = attention_mask.to(emb.device)
        cos, sin = self.rotary(emb, positions_from_mask(attention_mask, T))  # [B, T, hd]
        return (cos[:, None].repeat(devices, 1, 1, 1), sin[:, None].repeat(devices, 1, 1, 1),
                padding_attn_mask(attention_mask, T).repeat(devices, 1, 1, 1))

    def run_streams(self, input_ids: torch.Tensor, devices: int, exchange: Exchange, cache: Any = None,
                    attention_mask: torch.Tensor | None = None,
                    after: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
        """input_ids [B, T] -> the devices' final residual streams x [devices, B, T, D] (a rank: devices = 1).
        `after(m, x)`: sees the streams after each module m (walk's)."""
        emb = self.embed(input_ids)  # [B, T, D]
        cos, sin, mask = self._rope(emb, devices, cache, attention_mask)
        x = emb.unsqueeze(0).expand(devices, *emb.shape)  # every device starts from the embedding
        x = self.walk(x, cos, sin, exchange, cache, mask, after=after)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        return x

    def walk(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, exchange: Exchange,
             cache: Any = None, mask: torch.Tensor | None = None, modules: range | None = None,
             hook: Callable[[int, torch.Tensor, torch.Tensor, Trace], None] | None = None,
             after: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
        """The module loop: streams x [L, B, T, D] through `modules` (default all 2n) -> x after them.

        `hook(m, x, p, trace)`, when given, sees each module's input streams, its partials and
        what it computed on the way (modules.Trace) before the exchange adds them; without a
        hook no trace is kept. `after(m, x)` sees the streams once module m's update is added
        (a recipe's stream matching, training/recipes.py)."""
        ckpt = self.gradient_checkpointing and torch.is_grad_enabled() and cache is None
        if ckpt and hook is None and after is None and modules is None and isinstance(exchange.reduce, DeviceAxis):
            return self._walk_segments(x, cos, sin, exchange, mask)
        for m in range(len(exchange.schedule)) if modules is None else modules:
            if hook is not None:
                trace: Trace = {}
                p, local = self.sequence[m].partials(x, cos, sin, cache, mask, trace)
                hook(m, x, p if local is None else p + local, trace)
            elif ckpt:
                p, local = checkpoint(self.module_partials, m, x, cos, sin, None, mask, use_reentrant=False)
            else:
                p, local = self.module_partials(m, x, cos, sin, cache, mask)
            x = exchange.update(m, x, p, local)
            if after is not None:
                after(m, x)
        return x

    def _walk_segments(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, exchange: Exchange,
                       mask: torch.Tensor | None) -> torch.Tensor:
        """walk under gradient checkpointing in the simulator: segments of `checkpoint_segment`
        modules, each saving only what crosses its start (the streams and the partials still on
        their way) and recomputed whole in backward. Per module, L streams of [B, T, D] would be
        saved at every one of the 2n modules: at 70B, L = 4 and 4 x 1024 tokens, 43 GiB a process.
        The values are the per-module walk's: a segment is the same updates on the same tensors."""
        M = len(exchange.schedule)
        k = checkpoint_segment(M)
        for a in range(0, M, k):
            def segment(x: torch.Tensor, pending: dict[int, torch.Tensor], ms: range = range(a, min(a + k, M))):
                sub = Exchange(exchange.schedule, exchange.reduce, exchange.devices)
                sub.pending = {q: [p, None] for q, p in pending.items()}
                for m in ms:
                    x = sub.update(m, x, *self.module_partials(m, x, cos, sin, None, mask))
                return x, {q: e[0] for q, e in sub.pending.items()}

            x, pending = checkpoint(segment, x, {q: e[0] for q, e in exchange.pending.items()}, use_reentrant=False)
            exchange.pending = {q: [p, None] for q, p in pending.items()}
        return x

    def head_input(self, x: torch.Tensor, exchange: Exchange) -> torch.Tensor:
        """h = mean_l FinalNorm(x_l): [B, T, D], the LM head's input."""
        return exchange.mean(self.model.norm(x))
