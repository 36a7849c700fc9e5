"""DTPModel: a Llama-family decoder run as L devices with delay δ (docs/design.md §1), on one machine.

The devices are a leading tensor axis: every device's residual stream lives in x [L, B, T, D],
and each module computes all devices' partials with batched matmuls over per-device weight
views. Parameters keep Hugging Face's names and dense shapes, so the state dict is a plain HF
state dict (of the permuted model) and device l's slice of a weight is a view, not a copy.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtpshard.core.shape import ModelShape, check_delay, check_devices, shape_from_hf_config
from dtpshard.model.attention import attend
from dtpshard.model.delay import STAGE3, horizon, schedule
from dtpshard.core.errors import UserError
from dtpshard.model.hf import DTP_JSON, PretrainedMixin  # noqa: F401 - DTP_JSON re-exported


def _up(t: torch.Tensor) -> torch.Tensor:  # norms compute in at least fp32
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as transformers' LlamaRMSNorm, so fp32 logits agree to rounding.
    x32 = _up(x)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class _RMSNormFn(torch.autograd.Function):
    """rms_norm with a hand-written backward that saves only x and 1/rms.

    Autograd would also keep the normalised x and the output, each [L, B, T, D]: with L
    residual streams that is what pushes DTP's activation memory over the dense model's. Every
    pass over [L, B, T, D] counts here (the norms are most of DTP's extra elementwise work), so
    the backward reuses two buffers in place, and 1/rms comes from vector_norm, which squares
    without a temporary (equal to rms_norm's to float rounding).
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = _up(x)
        r = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()  # [..., 1]
        ctx.save_for_backward(x, weight, r)
        y = x32 * r
        return y.mul_(weight) if y.dtype == x.dtype == weight.dtype else weight * y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        # n = x·r, y = w·n: dw = Σ dy·n, dx = r·(dn - n·mean(dn·n)) with dn = dy·w
        x, weight, r = ctx.saved_tensors
        x32 = _up(x)
        g = _up(dy) * r  # dy·r (a new buffer even for fp32 dy: it is updated in place below)
        # t is made contiguous whatever dy's strides: dynamo refuses out= into a strided tensor (the
        # q/k-norms' inputs are transposed views), and a graph break would split the compiled
        # model at every norm
        t = torch.mul(g, x32, out=torch.empty_like(g, memory_format=torch.contiguous_format))  # dy·n
        dw = t.reshape(-1, t.shape[-1]).sum(0)
        g.mul_(_up(weight))  # dn·r
        s = torch.mul(g, x32, out=t).mean(-1, keepdim=True).mul_(r).mul_(r)  # r²·mean(dn·n)
        dx = g.addcmul_(x32, s, value=-1)  # r·dn - x·r²·mean(dn·n)
        return dx.to(x.dtype), dw.to(weight.dtype), None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def residual_update(x: torch.Tensor, p: torch.Tensor, own: float,
                    arrivals: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
    """x_l + own·p_l + Σ_k w_k·(Σ_j p_j^k - p_l^k) for every device l at once, x and p [L, B, T, D].

    One new tensor, updated in place, instead of a temporary per term; with gradients, a
    hand-written backward (_ResidualUpdate) that saves nothing and makes one buffer per arrival.
    """
    if torch.is_grad_enabled() and (x.requires_grad or p.requires_grad or any(q.requires_grad for q, _ in arrivals)):
        return _ResidualUpdate.apply(x, p, own, [w for _, w in arrivals], *[q for q, _ in arrivals])
    return _residual_sum(x, p, own, [w for _, w in arrivals], [q for q, _ in arrivals])


def _residual_sum(x: torch.Tensor, p: torch.Tensor, own: float, weights: list[float], qs: list[torch.Tensor]):
    out = torch.add(x, p, alpha=own)
    for q, w in zip(qs, weights):
        out.add_(q.sum(0, keepdim=True), alpha=w).sub_(q, alpha=w)
    return out


class _ResidualUpdate(torch.autograd.Function):
    """residual_update's gradients: dx = dout, dp = own·dout, dq_k = w_k·(Σ_l dout_l - dout):
    what autograd would get through sum/add_/sub_ with an expand, a negation and an add less."""

    @staticmethod
    def forward(ctx, x, p, own, weights, *qs):
        ctx.own, ctx.weights = own, weights
        return _residual_sum(x, p, own, weights, list(qs))

    @staticmethod
    def backward(ctx, dout):
        dp = dout if ctx.own == 1 else dout * ctx.own
        dqs = []
        if ctx.weights:
            total = dout.sum(0, keepdim=True)  # [1, B, T, D]
            for w in ctx.weights:
                dq = torch.sub(total, dout)
                dqs.append(dq if w == 1 else dq.mul_(w))
        return (dout, dp, None, None, *dqs)


class Proj(nn.Module):
    """A bare weight (and bias) with nn.Linear's names; the DTP code reads per-device views of it."""

    def __init__(self, out_features: int, in_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFn.apply(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


def _device_weights(weight: torch.Tensor, devices: int, cols: bool) -> torch.Tensor:
    """Each device's share of a dense [out, in] weight as an [L, in_l, out_l] view (W_l^T): its rows
    ([L, in, out/L]: q/k/v, gate/up) or its columns ([L, in/L, out]: o_proj, down_proj)."""
    out, inp = weight.shape
    if cols:
        return weight.view(out, devices, inp // devices).permute(1, 2, 0)
    return weight.view(devices, out // devices, inp).transpose(1, 2)


class _DeviceMatmul(torch.autograd.Function):
    """y[l] = x[l] @ W_l^T for every device l at once, W_l its rows or columns of a dense weight.

    Autograd through the per-device view copies dW into the weight's layout in the view's
    backward (rows) or hands the weight a column-major dW that AccumulateGrad then copies or adds
    element by element (columns: 10 ms against 0.8 ms for a contiguous [1024, 3072] add in a
    torch.profiler run on a 2-core CPU). Here dW = dy^T x leaves
    the backward in the weight's own row-major layout: a view for rows, one copy of whole rows
    for columns. It is autograd's GEMM with its operands swapped, so the values are autograd's up
    to float rounding; on the CPU they were equal bit for bit at the SmolLM2-135M and Qwen3-0.6B
    widths (and in the study arm retrained in docs/results/smollm2-l3-d1), not at every shape.
    Follows autocast by hand: compute in the autocast dtype, gradients in the inputs' dtypes.
    """

    @staticmethod
    def forward(ctx, x, weight, devices, cols):  # x [L, N, in_l] -> [L, N, out_l]
        dt = _compute_dtype(x)
        xc = x.to(dt)
        ctx.save_for_backward(xc, weight)
        ctx.devices, ctx.cols, ctx.x_dtype = devices, cols, x.dtype
        return torch.bmm(xc, _device_weights(weight.to(dt), devices, cols))

    @staticmethod
    def backward(ctx, dy):
        xc, weight = ctx.saved_tensors
        dy = dy.to(xc.dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w = _device_weights(weight.to(xc.dtype), ctx.devices, ctx.cols)
            dx = torch.bmm(dy, w.transpose(1, 2)).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = torch.bmm(dy.transpose(1, 2), xc)  # [L, out_l, in_l]
            if ctx.cols:  # [L, out, in/L] -> [out, L, in/L]: a copy of whole rows (autograd's own
                dw = dw.permute(1, 0, 2)  # GEMM, [L, in/L, out], would need a transposing one)
            dw = dw.reshape(weight.shape).to(weight.dtype)
        return dx, dw, None, None


def _device_matmul(x: torch.Tensor, proj: "Proj", cols: bool = False) -> torch.Tensor:
    """x [L, B, T, in_l] times each device's rows (-> [L, B, T, out/L]) or columns (x [L, B, T, in/L]
    -> partials [L, B, T, out]) of proj."""
    L, B, T, _ = x.shape
    return _DeviceMatmul.apply(x.reshape(L, B * T, -1), proj.weight, L, cols).view(L, B, T, -1)


class Attention(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.s = s
        self.q_proj = Proj(s.heads * s.head_dim, s.hidden, s.qkv_bias)
        self.k_proj = Proj(s.kv_groups * s.head_dim, s.hidden, s.qkv_bias)
        self.v_proj = Proj(s.kv_groups * s.head_dim, s.hidden, s.qkv_bias)
        self.o_proj = Proj(s.hidden, s.heads * s.head_dim)
        if s.qk_norm:
            self.q_norm = Norm(s.head_dim, s.rms_eps)
            self.k_norm = Norm(s.head_dim, s.rms_eps)

    def _heads(self, proj: Proj, h: torch.Tensor, L: int) -> torch.Tensor:
        """[L, B, T, D] -> [L*B, heads/L, T, hd] for this device's rows of proj."""
        y = _device_matmul(h, proj)
        if proj.bias is not None:
            y = y + proj.bias.view(L, 1, 1, -1)
        _, B, T, E = y.shape
        # a strided view, no copy: q/k-norm and RoPE write new tensors anyway
        return y.view(L * B, T, E // self.s.head_dim, self.s.head_dim).transpose(1, 2)

    def partials(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv: "tuple[torch.Tensor, torch.Tensor] | None",
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple]:
        """h [L, B, T, D] (each device's normed stream) -> partials [L, B, T, D], new (k, v).
        `mask`: a boolean [L*B, 1, T, past + T] mask (padded batches) replacing the causal one."""
        L, B, T, _ = h.shape
        q, k, v = self._heads(self.q_proj, h, L), self._heads(self.k_proj, h, L), self._heads(self.v_proj, h, L)
        if self.s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin  # cos/sin [1, 1, T, hd], or [L*B, 1, T, hd] with a mask
        k = k * cos + rotate_half(k) * sin
        o, (k, v) = attend(q, k, v, self.s.heads_per_group, kv, mask)  # one attention call over all devices
        Hl = o.shape[1]
        o = o.transpose(1, 2).reshape(L, B, T, Hl * self.s.head_dim)  # [L*B, Hl, T, hd] -> [L, B, T, Hl*hd]
        p = _device_matmul(o, self.o_proj, cols=True)
        return p, (k, v)


class FFN(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.gate_proj = Proj(s.neurons, s.hidden)
        self.up_proj = Proj(s.neurons, s.hidden)
        self.down_proj = Proj(s.hidden, s.neurons)

    def partials(self, h: torch.Tensor) -> torch.Tensor:
        """h [L, B, T, D] -> partials [L, B, T, D]: device l's neurons through its down_proj columns."""
        act = F.silu(_device_matmul(h, self.gate_proj)) * _device_matmul(h, self.up_proj)
        return _device_matmul(act, self.down_proj, cols=True)


class Layer(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.input_layernorm = Norm(s.hidden, s.rms_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = Norm(s.hidden, s.rms_eps)
        self.mlp = FFN(s)


class KVCache:
    """Per layer (k, v), each [L*B, G/L, T, hd]: every device keeps only its own KV groups."""

    def __init__(self, layers: int):
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layers

    @property
    def length(self) -> int:
        return 0 if self.kv[0] is None else self.kv[0][0].shape[2]


def rotary_for(hf_config: Any) -> nn.Module:
    import importlib

    family = hf_config.model_type
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls_name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family] + "RotaryEmbedding"
    return getattr(mod, cls_name)(config=hf_config)


class DTPModel(PretrainedMixin, nn.Module):
    """L devices, delay δ. devices=1 or delay=0 is the dense model (up to float rounding).

    Behaves like a transformers causal LM where that is cheap: `.config` (the HF config), `.device`,
    `.dtype`, `forward(input_ids, attention_mask=None, labels=None)` returning transformers'
    `CausalLMOutputWithPast` (`.logits`, `.loss`), left-padded batches, `.generate(...)`."""

    def __init__(self, hf_config: Any, devices: int = 4, delay: float = 1, stage3: str = "sqrt"):
        super().__init__()
        self.hf_config = hf_config
        self.shape = s = shape_from_hf_config(hf_config)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.model.layers = nn.ModuleList(Layer(s) for _ in range(s.layers))
        self.model.norm = Norm(s.hidden, s.rms_eps)
        self.lm_head = None if s.tied else Proj(s.vocab, s.hidden)
        self.rotary = rotary_for(hf_config)
        self.gradient_checkpointing = False
        self.layout_sha256: str | None = None  # of the layout applied to the weights (None: contiguous)
        self.set_dtp(devices, delay, stage3)

    def set_dtp(self, devices: int, delay: float, stage3: str = "sqrt") -> None:
        """Change L, δ or the stage-3 scale in place (weights are shared; only views change)."""
        check_devices(self.shape, devices)
        check_delay(self.shape, delay)
        if stage3 not in STAGE3:
            raise UserError(f"stage3={stage3!r}: must be one of {', '.join(STAGE3)}")
        self.devices, self.delay, self.stage3 = devices, delay, stage3
        self.steps = schedule(self.shape.modules, devices, delay, stage3)

    def dtp_settings(self) -> dict[str, Any]:
        return {"devices": self.devices, "delay": self.delay, "stage3": self.stage3}

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [V, D]
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    # -- the forward pass ----------------------------------------------------------------
    def module_partials(self, m: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Partials p^m [L, B, T, D] of module m from the devices' residual streams x [L, B, T, D]."""
        layer = self.model.layers[m // 2]
        if m % 2:
            return layer.mlp.partials(layer.post_attention_layernorm(x))
        kv = None if cache is None else cache.kv[m // 2]
        p, new_kv = layer.self_attn.partials(layer.input_layernorm(x), cos, sin, kv, mask)
        if cache is not None:
            cache.kv[m // 2] = new_kv
        return p

    def rope(self, x: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + length, device=x.device)[None]
        cos, sin = self.rotary(x, pos)  # [1, T, hd]
        return cos[:, None], sin[:, None]

    def _padded(self, emb: torch.Tensor, attention_mask: torch.Tensor, past: int) -> tuple[torch.Tensor, ...]:
        """(cos, sin, mask) of a padded batch, repeated over the devices in the heads' device-major order."""
        from dtpshard.model.hf import padding_attn_mask, positions_from_mask

        B, T = emb.shape[:2]
        if tuple(attention_mask.shape) != (B, past + T):
            raise UserError(f"attention_mask has shape {list(attention_mask.shape)}, expected [{B}, {past + T}] "
                            "(batch, cached + new tokens)")
        attention_mask = attention_mask.to(emb.device)
        cos, sin = self.rotary(emb, positions_from_mask(attention_mask, T))  # [B, T, hd]
        L = self.devices
        return (cos[:, None].repeat(L, 1, 1, 1), sin[:, None].repeat(L, 1, 1, 1),
                padding_attn_mask(attention_mask, T).repeat(L, 1, 1, 1))

    def streams(self, input_ids: torch.Tensor, cache: KVCache | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The devices' final residual streams x [L, B, T, D]."""
        L = self.devices
        emb = self.model.embed_tokens(input_ids)  # [B, T, D]
        past = 0 if cache is None else cache.length
        mask = None
        if attention_mask is None:
            cos, sin = self.rope(emb, past, input_ids.shape[1])
        else:
            cos, sin, mask = self._padded(emb, attention_mask, past)
        x = emb.unsqueeze(0).expand(L, *emb.shape)  # every device starts from the embedding
        recent: dict[int, torch.Tensor] = {}  # module -> its partials, kept for δ modules
        keep = horizon(self.delay)
        ckpt = self.gradient_checkpointing and torch.is_grad_enabled() and cache is None
        for m, step in enumerate(self.steps):
            if ckpt:
                p = checkpoint(self.module_partials, m, x, cos, sin, None, mask, use_reentrant=False)
            else:
                p = self.module_partials(m, x, cos, sin, cache, mask)
            recent[m] = p
            x = residual_update(x, p, step.own_scale, [(recent[k], w) for k, w in step.arrivals])
            recent.pop(m - keep, None)
        return x

    def hidden(self, input_ids: torch.Tensor, cache: KVCache | None = None,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """h = mean_l FinalNorm(x_l): [B, T, D], the LM head's input."""
        return self.model.norm(self.streams(input_ids, cache, attention_mask)).mean(0)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, cache: KVCache | None = None, logits_to_keep: int = 0) -> Any:
        """input_ids [B, T] -> transformers' CausalLMOutputWithPast: `.logits` [B, T, V] (only the last
        `logits_to_keep` positions if > 0), `.loss` with `labels` (transformers' shifted
        cross-entropy, -100 ignored), `.past_key_values` the `cache` given. `attention_mask` [B,
        cached + T] (1 real, 0 padding) for left-padded batches; positions count real tokens only."""
        from dtpshard.model.hf import causal_lm_loss, output

        if labels is not None and logits_to_keep:
            raise ValueError("labels need the logits of every position: logits_to_keep must be 0")
        h = self.hidden(input_ids, cache, attention_mask)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = F.linear(h, self.lm_head_weight)
        return output(logits, None if labels is None else causal_lm_loss(logits, labels), cache)

    def new_cache(self) -> KVCache:
        return KVCache(self.shape.layers)

    # -- loading -------------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, hf_config: Any, state_dict: dict[str, torch.Tensor], devices: int = 4,
                        delay: float = 1, stage3: str = "sqrt", layout: Any = None,
                        dtype: torch.dtype | str = torch.float32) -> "DTPModel":
        """dtype "auto": the config's, else the weights' (as transformers)."""
        from dtpshard.core.layout import as_layout
        from dtpshard.core.permutation import apply_layout
        from dtpshard.model.hf import resolve_dtype

        with torch.device("meta"):
            model = cls(hf_config, devices, delay, stage3)
        sd = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
        if model.shape.tied:
            sd.pop("lm_head.weight", None)
        stored = next((v.dtype for v in sd.values() if v.is_floating_point()), None)
        dtype = resolve_dtype(dtype, hf_config, stored)
        where = f"layout {layout}" if isinstance(layout, (str, Path)) else "layout"  # name the file when there is one
        layout = as_layout(layout)
        if layout is not None:
            layout.check_model(model.shape.summary(), where=where)
            if layout.devices != devices:
                raise UserError(f"{where} was made for devices={layout.devices}, the model runs devices={devices}")
            sd = apply_layout(sd, model.shape, layout)
            model.layout_sha256 = layout.content_sha256()
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        model.load_state_dict(sd, strict=True, assign=True)
        model.rotary = rotary_for(hf_config)  # its buffers were built on meta
        return model
