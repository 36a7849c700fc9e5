"""The distillation loss KL(teacher ‖ student) + w·CE, computed in chunks of token positions.

A 151k vocabulary makes full [B, T, V] fp32 logits for teacher and student (plus their
softmaxes and the gradient) tens of GB. Both heads are linear in the hidden states, so the
loss and its gradient with respect to the student's hidden states h_s are computed chunk by
chunk in the forward pass and only dL/dh_s [N, D] is kept for backward: peak memory is a few
[chunk, V] buffers, whatever the batch.

Per position t, with z = h W^T, p = softmax(z):
    KL_t = Σ_v p_t[v] (log p_t[v] - log p_s[v])       (teacher t, student s)
    CE_t = -log p_s[y_t]
    d(KL_t + w·CE_t)/dz_s = (1 + w)·p_s - p_t - w·onehot(y_t)
"""
from __future__ import annotations

import torch

from dtpshard.core.family import logits

CHUNK_ELEMENTS = 1 << 25  # [chunk, V] fp32 buffers of ~128 MB each


def chunk_tokens(vocab: int, elements: int = CHUNK_ELEMENTS) -> int:
    return max(1, elements // max(1, vocab))


def _logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """w: the LM head with its logit transform (a model's head_weight). Under CUDA autocast this
    matmul runs in bf16; the softmaxes below are always fp32."""
    return logits(h, w).float()


def _chunked(ctx, h_s: torch.Tensor, w_s: torch.Tensor, ce_weight: float, chunk: int, body):
    """The driver both fused losses share: `body(a, b, want_grad)` scores rows a:b and returns
    (kl, ce, g), g [c, V] the loss's gradient w.r.t. those rows' logits (None unless want_grad).
    The sums are accumulated here and the gradients w.r.t. h_s and w_s formed chunk by chunk,
    so no [N, V] tensor ever exists; backward only scales them."""
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    kl_sum = torch.zeros((), dtype=torch.float32, device=h_s.device)
    ce_sum = torch.zeros((), dtype=torch.float32, device=h_s.device)
    grad_h = torch.empty(h_s.shape, dtype=torch.float32, device=h_s.device) if need_h else None
    grad_w = torch.zeros(w_s.shape, dtype=torch.float32, device=w_s.device) if need_w else None
    for a in range(0, h_s.shape[0], chunk):
        b = min(a + chunk, h_s.shape[0])
        kl, ce, g = body(a, b, need_h or need_w)
        kl_sum += kl
        ce_sum += ce
        if need_h:
            grad_h[a:b] = g @ w_s.float()  # [c, D]
        if need_w:
            grad_w += g.t() @ h_s[a:b].float()
    ctx.save_for_backward(grad_h, grad_w)
    ctx.h_dtype, ctx.w_dtype = h_s.dtype, w_s.dtype
    ctx.mark_non_differentiable(kl_sum, ce_sum)
    return kl_sum + ce_weight * ce_sum, kl_sum, ce_sum


def _scaled_grads(ctx, g_loss: torch.Tensor, inputs: int) -> tuple:
    grad_h, grad_w = ctx.saved_tensors
    gh = (grad_h * g_loss).to(ctx.h_dtype) if grad_h is not None else None
    gw = (grad_w * g_loss).to(ctx.w_dtype) if grad_w is not None else None
    return (gh, gw) + (None,) * (inputs - 2)


def _kl_ce(z_s: torch.Tensor, z_t: torch.Tensor | None, y: torch.Tensor) -> tuple:
    """(kl, ce, log p_s, p_t) of one chunk of fp32 logits [c, V] (kl 0 and p_t None without a teacher)."""
    logp_s = torch.log_softmax(z_s, dim=-1)
    ce = -logp_s.gather(1, y[:, None]).sum()
    if z_t is None:
        return 0.0, ce, logp_s, None
    logp_t = torch.log_softmax(z_t, dim=-1)
    p_t = logp_t.exp()
    return (p_t * (logp_t - logp_s)).sum(), ce, logp_s, p_t


class _FusedKLCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_s, w_s, h_t, w_t, targets, ce_weight: float, chunk: int):
        """h_s, h_t [N, D]; w_s, w_t [V, D]; targets [N] -> (loss_sum, kl_sum, ce_sum), fp32 scalars."""
        def body(a: int, b: int, want_grad: bool):
            y = targets[a:b]
            kl, ce, logp_s, p_t = _kl_ce(_logits(h_s[a:b], w_s), None if h_t is None else _logits(h_t[a:b], w_t), y)
            if not want_grad:
                return kl, ce, None
            g = logp_s.exp_().mul_(1.0 + ce_weight if h_t is not None else ce_weight)  # reuses the buffer
            if h_t is not None:
                g.sub_(p_t)
            g.scatter_add_(1, y[:, None], torch.full((b - a, 1), -ce_weight, device=g.device))
            return kl, ce, g

        return _chunked(ctx, h_s, w_s, ce_weight, chunk, body)

    @staticmethod
    def backward(ctx, g_loss, _g_kl, _g_ce):
        return _scaled_grads(ctx, g_loss, 7)


@torch.no_grad()
def eval_sums(h_s: torch.Tensor, w_s: torch.Tensor, h_t: torch.Tensor | None, w_t: torch.Tensor | None,
              targets: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """[kl_sum, ce_sum, top1_sum] in float64 over the positions of h_s [..., D]: KL(teacher ‖
    student) and CE as kl_ce_sums computes them, and top-1 agreement, the positions where the
    student's most likely token is the teacher's (0 without a teacher)."""
    D = h_s.shape[-1]
    h_s, y = h_s.reshape(-1, D), targets.reshape(-1)
    h_t = None if h_t is None else h_t.reshape(-1, D)
    chunk = chunk or chunk_tokens(w_s.shape[0])
    out = torch.zeros(3, dtype=torch.float64, device=h_s.device)
    for a in range(0, h_s.shape[0], chunk):
        z_t = None if h_t is None else _logits(h_t[a:a + chunk], w_t)
        kl, ce, logp_s, _ = _kl_ce(_logits(h_s[a:a + chunk], w_s), z_t, y[a:a + chunk])
        top1 = 0.0 if z_t is None else (logp_s.argmax(-1) == z_t.argmax(-1)).sum()
        out += torch.stack([torch.as_tensor(v, dtype=torch.float64, device=out.device) for v in (kl, ce, top1)])
    return out


def kl_ce_sums(h_s: torch.Tensor, w_s: torch.Tensor, h_t: torch.Tensor | None, w_t: torch.Tensor | None,
               targets: torch.Tensor, ce_weight: float = 0.1,
               chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sums over positions of KL(teacher ‖ student) + ce_weight·CE, of KL, and of CE.

    h_s, h_t: [..., D] hidden states (the LM heads' inputs), w_s, w_t: [V, D], targets [...].
    Only the first output is differentiable (w.r.t. h_s, and w_s if it requires grad); without
    a teacher (h_t None) KL is 0 and the loss is ce_weight·CE.
    """
    D = h_s.shape[-1]
    h_s = h_s.reshape(-1, D)
    if h_t is not None:
        h_t = h_t.reshape(-1, D).detach()
        w_t = w_t.detach()
    chunk = chunk or chunk_tokens(w_s.shape[0])
    return _FusedKLCE.apply(h_s, w_s, h_t, w_t, targets.reshape(-1), float(ce_weight), int(chunk))


# -- the loss against a teacher cache (training/teacher_cache.py) ------------------------------
def _masked_lse(z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log Σ_{v ∉ ids} exp z_v per row (-inf where every entry is in ids)."""
    return z.scatter(1, ids, float("-inf")).logsumexp(-1)


class _FusedTopKKLCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_s, w_s, top_ids, top_logp, tail_logp, targets, ce_weight: float, chunk: int):
        def body(a: int, b: int, want_grad: bool):
            z = _logits(h_s[a:b], w_s)
            lse = z.logsumexp(-1, keepdim=True)
            ids, lp, lt = top_ids[a:b], top_logp[a:b].float(), tail_logp[a:b].float()
            p, pt = lp.exp(), lt.exp()
            lq_top = z.gather(1, ids) - lse  # log q_v, v in the top k
            lq_tail = _masked_lse(z, ids) - lse[:, 0]  # log q_tail
            tail_kl = torch.where(pt > 0, pt * (lt - lq_tail), torch.zeros_like(pt))
            kl = (p * (lp - lq_top)).sum() + tail_kl.sum()
            y = targets[a:b]
            ce = -(z.gather(1, y[:, None]) - lse).sum()
            if not want_grad:
                return kl, ce, None
            q = (z - lse).exp_()  # reuses z: [c, V]
            mass = p.sum(-1, keepdim=True) + pt[:, None]  # Σ_K p + p_tail (1 up to the cache's rounding)
            tail_coef = torch.where(pt > 0, pt * torch.exp(-lq_tail), torch.zeros_like(pt))[:, None]
            g = q * (mass + ce_weight) - q * tail_coef  # the tail's share, then put back on the top k
            g.scatter_add_(1, ids, q.gather(1, ids) * tail_coef - p)
            g.scatter_add_(1, y[:, None], torch.full((b - a, 1), -ce_weight, device=g.device))
            return kl, ce, g

        return _chunked(ctx, h_s, w_s, ce_weight, chunk, body)

    @staticmethod
    def backward(ctx, g_loss, _g_kl, _g_ce):
        return _scaled_grads(ctx, g_loss, 8)


def topk_kl_ce_sums(h_s: torch.Tensor, w_s: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor,
                    tail_logp: torch.Tensor, targets: torch.Tensor, ce_weight: float = 0.1,
                    chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kl_ce_sums with the teacher given by its cached top k (training/teacher_cache.py).

    Per position, with K the teacher's top-k tokens, p_v = exp(top_logp_v) (v ∈ K),
    p_tail = exp(tail_logp) = Σ_{v∉K} p_v, q = softmax(h_s W_s^T) and q_tail = Σ_{v∉K} q_v:

        KL_K = Σ_{v∈K} p_v·(log p_v - log q_v) + p_tail·(log p_tail - log q_tail)

    the exact KL between the two distributions coarsened to K plus one tail bucket (so
    0 ≤ KL_K ≤ KL; equal when the teacher's tail is spread like the student's). Its gradient
    w.r.t. the student logits is S·q - p·1_K - p_tail·q/q_tail·1_{∉K}, S = Σ_K p + p_tail.
    CE and the other conventions are kl_ce_sums'. top_ids [..., k] (int), top_logp [..., k]
    (any float dtype), tail_logp [...] and targets [...] over the same positions as h_s.
    """
    D = h_s.shape[-1]
    k = top_ids.shape[-1]
    chunk = chunk or chunk_tokens(w_s.shape[0])
    return _FusedTopKKLCE.apply(h_s.reshape(-1, D), w_s, top_ids.reshape(-1, k).long(), top_logp.reshape(-1, k),
                                tail_logp.reshape(-1), targets.reshape(-1), float(ce_weight), int(chunk))


def teacher_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top_ids, top_logp [..., k], tail_logp [...]) of the teacher's logits [..., V], in fp32."""
    V = logits.shape[-1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    top_logp, top_ids = logp.topk(min(k, V), dim=-1, sorted=True)
    flat = logp.reshape(-1, V)
    tail = _masked_lse(flat, top_ids.reshape(-1, top_ids.shape[-1])).reshape(logp.shape[:-1])
    return top_ids, top_logp, tail


def stream_distance(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Σ over positions of the mean over devices of 1 − cos(x_l, t): every device's stream x [L, B,
    T, D] after a module against the dense teacher's t [1, B, T, D] at the same point (a recipe's
    stream matching, training/recipes.py). A cosine, because the next module reads its stream
    through an RMSNorm (its direction, not its scale), and because it is bounded: the squared
    distance relative to the teacher's norm, tried first, was dominated by a few positions (on
    SmolLM2 at δ = 1, one position's value reached 1.9e4 where a module's mean was 0.5 to 50: one
    stream forms an attention sink's massive activation and the other does not)."""
    return (1 - torch.nn.functional.cosine_similarity(x.float(), t.float().expand_as(x), dim=-1)).mean(0).sum()
