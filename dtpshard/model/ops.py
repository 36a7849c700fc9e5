"""The DTP forward's kernels, each with the hand-written backward that the benchmarks showed pays:
RMSNorm, the per-device matmul over views of a dense weight, and the residual update of
docs/design.md §1 over the devices axis; rotary embedding is here too, with autograd's backward.

Every tensor with a devices axis is [L, B, T, ·]. A rank of the multi-process runtime runs the
same code with L = 1 on its own slice of each weight.
"""
from __future__ import annotations

import torch
from torch import nn


def _up(t: torch.Tensor) -> torch.Tensor:  # norms compute in at least fp32
    return t.to(torch.promote_types(t.dtype, torch.float32))


def inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1/ρ = rsqrt(mean(x²) + ε) over the last axis, keepdim: [..., D] -> [..., 1]."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as transformers' LlamaRMSNorm, so fp32 logits agree to rounding.
    x32 = _up(x)
    return weight * (x32 * inv_rms(x32, eps)).to(x.dtype)


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
        r = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        # r: [..., 1]
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


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFn.apply(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [N, heads, T, hd] with cos/sin broadcastable to it (transformers' apply_rotary_pos_emb);
    cos/sin narrower than hd (a partial rotary factor, Phi-3's): only the first dimensions rotate."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


# -- the residual update ----------------------------------------------------------------------
Arrival = tuple[torch.Tensor | None, torch.Tensor, float]  # (Σ_j p_j^k or None, p_l^k, weight w)


def residual_update(x: torch.Tensor, p: torch.Tensor, own: float, arrivals: list[Arrival]) -> torch.Tensor:
    """x_l + own·p_l + Σ_k w_k·(Σ_j p_j^k - p_l^k), in that order, for every exchange (model/exchange.py).

    Σ_j p_j^k is given (a rank's all-reduce), or None where the devices are the leading axis of
    x, p and p^k [L, B, T, D] (the simulator), which is then summed here. One new tensor, updated in
    place, instead of a temporary per term; with gradients, a hand-written backward
    (_ResidualUpdate) that saves nothing and makes one buffer per arrival.
    """
    if torch.is_grad_enabled() and (x.requires_grad or p.requires_grad or
                                    any(t is not None and t.requires_grad for s, q, _ in arrivals for t in (s, q))):
        if any(s is not None for s, _, _ in arrivals):  # a reduced sum (no engine trains through one): autograd's
            out = torch.add(x, p, alpha=own)
            for s, q, w in arrivals:
                out = out + (q.sum(0, keepdim=True) if s is None else s) * w - q * w
            return out
        return _ResidualUpdate.apply(x, p, own, [w for _, _, w in arrivals], *[q for _, q, _ in arrivals])
    return _residual_sum(x, p, own, arrivals)


def _residual_sum(x: torch.Tensor, p: torch.Tensor, own: float, arrivals: list[Arrival]) -> torch.Tensor:
    out = torch.add(x, p, alpha=own)
    for s, q, w in arrivals:
        out.add_(q.sum(0, keepdim=True) if s is None else s, alpha=w).sub_(q, alpha=w)
    return out


class _ResidualUpdate(torch.autograd.Function):
    """residual_update's gradients over the devices axis: dx = dout, dp = own·dout,
    dq_k = w_k·(Σ_l dout_l - dout): what autograd would get through sum/add_/sub_ with an expand,
    a negation and an add less."""

    @staticmethod
    def forward(ctx, x, p, own, weights, *qs):
        ctx.own, ctx.weights = own, weights
        return _residual_sum(x, p, own, [(None, q, w) for q, w in zip(qs, weights)])

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


# -- each device's rows or columns of a dense weight ---------------------------------------------
class Proj(nn.Module):
    """A bare weight (and bias) with nn.Linear's names; the DTP code reads per-device views of it.
    `adapter`: a low-rank update trained over the frozen weight (model/adapters.py), or None."""

    def __init__(self, out_features: int, in_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_module("adapter", None)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    kind = t.device.type
    if kind == "meta":  # no autocast there (the memory plan traces the model on meta: training/memory.py)
        return t.dtype
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


def _device_weights(weight: torch.Tensor, devices: int, cols: bool) -> torch.Tensor:
    """Each device's share of a dense [out, in] weight as an [L, in_l, out_l] view (W_l^T): its rows
    ([L, in, out/L]: q/k/v, gate/up) or its columns ([L, in/L, out]: o_proj, down_proj). unflatten,
    not view: the sharded columns of a shared FFN's down_proj are a strided slice of it."""
    if cols:
        return weight.unflatten(1, (devices, -1)).permute(1, 2, 0)
    return weight.unflatten(0, (devices, -1)).transpose(1, 2)


class _DeviceMatmul(torch.autograd.Function):
    """y[l] = x[l] @ W_l^T for every device l at once, W_l its rows or columns of a dense weight.

    Autograd through the per-device view copies dW into the weight's layout in the view's
    backward (rows) or hands the weight a column-major dW that AccumulateGrad then copies or adds
    element by element (columns). Here dW = dy^T x leaves the backward in the weight's own
    row-major layout: a view for rows, one copy of whole rows for columns. It is autograd's GEMM
    with its operands swapped, so the values are autograd's up to float rounding (on the CPU equal
    bit for bit at the SmolLM2-135M and Qwen3-0.6B widths, not at every shape). Follows autocast
    by hand: compute in the autocast dtype, gradients in the inputs' dtypes.
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


def _units(t: torch.Tensor, units: slice | None, cols: bool) -> torch.Tensor:
    """The rows (or with `cols` the columns) `units` of t, a view; all of it for None."""
    return t if units is None else (t[:, units] if cols else t[units])


def device_matmul(x: torch.Tensor, proj: Proj, cols: bool = False, units: slice | None = None) -> torch.Tensor:
    """x [L, B, T, in_l] times each device's rows (-> [L, B, T, out/L]) or columns (x [L, B, T, in/L]
    -> partials [L, B, T, out]) of proj; `units`: of its rows (columns) in that range only, the
    sharded neurons of a shared FFN (docs/design.md §6)."""
    L, B, T, _ = x.shape
    flat = x.reshape(L, B * T, -1)
    weight = _units(proj.weight, units, cols)
    if torch.is_grad_enabled() and (x.requires_grad or proj.weight.requires_grad):
        y = _DeviceMatmul.apply(flat, weight, L, cols)
    else:  # no backward to shape: plain bmm (which autocasts by itself)
        y = torch.bmm(flat, _device_weights(weight, L, cols))
    adapter = proj.adapter
    if adapter is not None and adapter.on:
        A, B_ = (_units(adapter.A, units, True), adapter.B) if cols else (adapter.A, _units(adapter.B, units, False))
        y = low_rank_term(y, flat, A, B_, adapter.scale, cols)
    return y.view(L, B, T, -1)


def replicated_matmul(x: torch.Tensor, proj: Proj, units: slice, cols: bool = False) -> torch.Tensor:
    """x [L, B, T, ·] times the rows (or columns) `units` of proj, the same ones on every device:
    the shared neurons of an FFN (docs/design.md §6), which each device computes whole from its own
    stream. An adapter adds its share as device_matmul's does, B·A never formed."""
    weight = _units(proj.weight, units, cols)
    y = torch.nn.functional.linear(x, weight)
    adapter = proj.adapter
    if adapter is not None and adapter.on:
        A, B = (_units(adapter.A, units, True), adapter.B) if cols else (adapter.A, _units(adapter.B, units, False))
        y = y + adapter.scale * torch.nn.functional.linear(torch.nn.functional.linear(x, A), B)
    return y


def low_rank_term(y: torch.Tensor, flat: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float,
                  cols: bool) -> torch.Tensor:
    """y + each device's share of x·(scale·B·A)^T, never forming B·A: [L, N, r] in between.

    Rows (q/k/v, gate/up): device l's rows of B·A are B_l·A, so x_l·A^T (every device the whole
    A) then B_l. Columns (o, down): its columns are B·A_l, so x_l·A_l^T then the whole B; the
    devices' partials then sum to x·(B·A)^T as the dense update would. The merged weight read
    through the same views gives these values up to float rounding (model/adapters.py)."""
    L, r = flat.shape[0], A.shape[0]
    if cols:
        a = torch.bmm(flat, A.unflatten(1, (L, -1)).permute(1, 2, 0))  # [L, N, in/L] x [L, in/L, r]
        b = B.t().expand(L, r, B.shape[0])
    else:
        a = torch.matmul(flat, A.t())  # [L, N, in] x [in, r]
        b = B.unflatten(0, (L, -1)).transpose(1, 2)  # [L, r, out/L]
    return torch.baddbmm(y, a, b, alpha=scale)
