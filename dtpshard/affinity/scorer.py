"""Affinity scores (docs/design.md §2): how much each target unit depends on each co-located source unit.

One pass over the dense model. For every edge (a, b) of `edges_for_delay(M, δ)` the score matrix
S_ab [units(a), units(b)] is the mean over calibration tokens of the squared damage that target
unit v of module b takes when source unit u's contribution is missing from b's input residual
(under DTP at δ, module b runs before the other devices' partials of modules b-δ..b-1 arrive).

Notation, per token t. Target module b: x (the residual entering b's pre-norm), γ its gain,
ρ = sqrt(mean(x²) + ε), D the hidden size. Source unit u's contribution c_u ∈ R^D:
- a query head h of attention module a: c_h = W_o[:, h·hd:(h+1)·hd] o_h (o_h: the head's output);
  a KV group with `group_unit`: the sum of its r heads' c_h;
- a neuron n of FFN module a: c_n = act_n W_down[:, n], act_n = silu(g_n)·u_n.
The change δn of b's normalised input γ⊙x/ρ when c_u is taken away is, by `rho`:
- held, paper (default): δn = γ⊙c/ρ                             (ρ held at its dense value)
- jacobian:  δn = γ⊙(c − x·(x·c)/(Dρ²))/ρ                         (RMSNorm Jacobian, ρ moves)
- ablation:  δn = γ⊙x/ρ − γ⊙(x−c)/ρ_c, ρ_c = rms(x − c)            (leave-one-out, exact)
Target responses (then S = mean over tokens):
- FFN neuron m (module b odd): Δg = W_gate[m]·δn, Δu = W_up[m]·δn; the damage is
  d = silu'(g)·u·Δg + silu(g)·Δu with silu'(g) = σ(g)(1 + g(1−σ(g)))  (first order, "fo"), or with
  ablation d = silu(g)·u − silu(g−Δg)·(u−Δu); the score is d² · ‖W_down[:, m]‖².
- KV group g (module b even): ‖W_g δn‖², W_g the stacked q rows of its r heads, its k and v rows
  (before q/k-norm and RoPE, biases cancel); linear, so the same formula for every `rho`.
Without `group_unit` the score of a source KV group is the sum over its r heads of the per-head
scores (the paper); with it, the group's r contributions are summed before squaring.

At δ = 1 this gives the paper's two edges exactly: the up edge (attention i -> FFN i, "fo") and
the down edge (FFN i -> attention i+1, "add": mean act²/ρ'² · ‖W_g(γ'⊙W_down[:, n])‖²). For
δ ≥ 2 the same definitions give every other edge b-δ ≤ a < b: attention -> later FFN,
FFN -> later attention, attention -> attention and FFN -> FFN. The missing contribution is taken
away from b's input only (no propagation through the modules in between).

Cost. Each edge first folds its weights once, W_b diag(γ_b) W_src ([rows, cols]). Head sources
then cost one matmul per token chunk, [units, rows, w] @ [units, w, tokens] (rows 2N or
G·(r+2)·hd), and a few elementwise passes over its output: in one batched block on a GPU, per
(unit, ~ROW_BLOCK rows) block on a CPU so the temporaries stay in cache. Neuron sources reduce
over tokens with matmuls ([N, T] @ [T, ·]), except FFN -> FFN ablation, which materialises
[tokens, N, N]. Chunk sums are computed in the model dtype and accumulated in float64; scores are
divided by the token count at the end. With float64 compute the result does not depend on the
chunking, the micro-batch or the blocking beyond float64 rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from tqdm import tqdm

from dtpshard.affinity.file import edges_for_delay
from dtpshard.affinity.offload import DiskArray, HiddenStates, MemoryArray
from dtpshard.core.family import activation
from dtpshard.core.settings import DEFAULT
from dtpshard.core.shape import ModelShape
from dtpshard.core.vocab import PROXIES
from dtpshard.model.dense import DenseModel, LayerWeights

CHUNK_ELEMENTS = {"cpu": 1 << 21, "cuda": 1 << 26}  # largest temporary per token chunk, in elements
BLOCKED = {"cpu": True, "cuda": False}  # loop over (unit, row block) rather than one batched block
ROW_BLOCK = 512  # blocked: target rows (gate+up rows, or q/k/v rows of whole groups) per block


Rho = Literal["held", "jacobian", "ablation"]  # how the target's norm sees a contribution taken away


@dataclass(frozen=True)
class ScoreOptions:
    """How a score is computed: the two knobs a proxy (core.vocab.Proxy) is made of."""

    group_unit: bool = False  # a KV group's heads summed before squaring (else each head, then summed)
    rho: Rho = "held"  # held: δn = γ⊙c/ρ (the paper's); jacobian: the exact RMSNorm Jacobian; ablation: leave-one-out

    @classmethod
    def of(cls, proxy: str) -> ScoreOptions:
        return PROXY_OPTIONS[proxy]

    @property
    def proxy(self) -> str | None:
        """The proxy these options are (None for a combination no proxy names)."""
        return next((name for name, o in PROXY_OPTIONS.items() if o == self), None)

    def metadata(self, delay: float) -> dict[str, Any]:
        """What an affinity file records of how it was scored."""
        return {"proxy": self.proxy, "group_unit": self.group_unit, "rho": self.rho, "extra_edges": delay >= 2}


# the affinity proxies (docs/design.md §2): the paper's first-order fo/add score, a KV group scored
# as one unit, the exact RMSNorm Jacobian, leave-one-out ablation
PROXY_OPTIONS: dict[str, ScoreOptions] = {"first-order": ScoreOptions(), "group-unit": ScoreOptions(group_unit=True),
                                          "exact-jacobian": ScoreOptions(rho="jacobian"),
                                          "ablation": ScoreOptions(rho="ablation")}
assert set(PROXY_OPTIONS) == set(PROXIES), "every proxy name has its score options"


@dataclass
class Target:
    """Module b on a chunk of tokens (flattened), shapes [T, ·]."""

    x: torch.Tensor  # [T, D] residual entering b's norm
    rho: torch.Tensor  # [T, 1]
    g: torch.Tensor | None = None  # FFN: [T, N] gate pre-activations
    u: torch.Tensor | None = None  # FFN: [T, N] up pre-activations
    act: torch.Tensor | None = None  # FFN: [T, N] silu(g)·u
    w: torch.Tensor | None = None  # attention: [T, G, (r+2)·hd] = W_g (γ⊙x), no bias

    def rows(self, sl: slice) -> Target:
        return Target(*(None if v is None else v[sl] for v in (self.x, self.rho, self.g, self.u, self.act, self.w)))


class EdgeScorer:
    """Accumulates S_ab of one edge (a, b) over token chunks (see the module docstring)."""

    def __init__(self, s: ModelShape, w_src: torch.Tensor, tgt: LayerWeights, a: int, b: int, opts: ScoreOptions,
                 chunk: int | None = None):
        """w_src: module a's output weight (o_proj or down_proj, [D, cols]); tgt: module b's layer."""
        self.shape, self.opts, self.a, self.b = s, opts, a, b
        self.act, self.act_grad = activation(s.act)  # the family's gate activation and its derivative
        self.heads, self.to_ffn = a % 2 == 0, b % 2 == 1
        self.w_src = w_src
        gamma = tgt.ln2 if self.to_ffn else tgt.ln1
        w_tgt = torch.cat([tgt.gate, tgt.up]) if self.to_ffn else tgt.qkv_w.reshape(-1, s.hidden)  # [rows, D]
        gw_src = gamma[:, None] * self.w_src  # [D, cols] diag(γ) W_src
        self.rows = w_tgt.shape[0]
        if self.heads:  # source units: heads (width hd) or whole KV groups (width r·hd)
            self.n_src, self.width = (s.kv_groups, s.heads_per_group * s.head_dim) if opts.group_unit \
                else (s.heads, s.head_dim)
            # [U, rows, w]: W_b diag(γ) W_o[:, unit u's columns] (a strided view of one matmul)
            self.fold = (w_tgt @ gw_src).view(self.rows, self.n_src, self.width).transpose(0, 1)
            if opts.rho == "ablation":
                wu = self.w_src.view(s.hidden, self.n_src, self.width).permute(1, 0, 2)  # [U, D, w]
                self.gram = wu.transpose(1, 2) @ wu  # [U, w, w]: ‖c_u‖² = o_uᵀ Gram_u o_u
        else:
            self.n_src = s.neurons
            self.fold = gw_src.T @ w_tgt.T  # [N_src, rows]: (W_b diag(γ) W_down)ᵀ
            self.col2 = self.w_src.pow(2).sum(0)  # [N_src] ‖W_down[:, n]‖²
        self.n_dst = s.neurons if self.to_ffn else s.kv_groups
        self.down2 = tgt.down.pow(2).sum(0).double() if self.to_ffn else None  # [N] ‖W_down[:, m]‖²
        device = self.fold.device.type
        if self.heads:
            # (source units, target units) blocks: on a GPU one block (big batched matmuls); on a
            # CPU one unit and ~ROW_BLOCK target rows at a time, so the [rows, tokens] temporaries
            # of a block stay in cache
            dst_rows = 2 if self.to_ffn else self.rows // s.kv_groups  # rows per target unit
            blocked = BLOCKED.get(device, True)
            step = min(self.n_dst, max(1, ROW_BLOCK // dst_rows)) if blocked else self.n_dst
            self.blocks = [(slice(u, u + 1), slice(v, v + step)) for u in range(self.n_src)
                           for v in range(0, self.n_dst, step)] if blocked else [(slice(None), slice(None))]
            self.fold = self.fold if blocked else self.fold.contiguous()
            per_token = (1 if blocked else self.n_src) * step * dst_rows
        else:
            per_token = self.n_src * (s.neurons if self.to_ffn and opts.rho == "ablation" else 1)
            if not self.to_ffn:  # [N, G] ‖W_g(γ⊙W_down[:, n])‖²
                self.v2 = self.fold.view(self.n_src, s.kv_groups, -1).pow(2).sum(-1)
        budget = CHUNK_ELEMENTS.get(device, CHUNK_ELEMENTS["cpu"])
        self.chunk = max(1, min(chunk or budget, budget // per_token))
        self.acc = torch.zeros(self.n_src, self.n_dst, dtype=torch.float64, device=self.fold.device)
        self.tokens = 0

    # -- per-token coefficients: δn_u = α·γ⊙x + β·γ⊙c_u ----------------------------------------
    def _coefficients(self, src: torch.Tensor, t: Target) -> tuple[torch.Tensor | None, torch.Tensor]:
        rho, D = self.opts.rho, self.shape.hidden
        if rho == "held":
            return None, 1 / t.rho  # [T, 1]
        y = t.x @ self.w_src  # [T, cols]
        if self.heads:
            s = (y.view(-1, self.n_src, self.width) * src).sum(-1)  # [T, U] x·c_u
        else:
            s = src * y  # [T, N] x·c_n = act_n (x·W_down[:, n])
        if rho == "jacobian":
            return -s / (D * t.rho ** 3), 1 / t.rho
        if self.heads:
            cn2 = torch.einsum("tuv,tuv->tu", torch.einsum("tuw,uwv->tuv", src, self.gram), src)
        else:
            cn2 = src.pow(2) * self.col2
        xn2 = t.x.pow(2).sum(-1, keepdim=True)  # [T, 1]
        rho_c = torch.sqrt(((xn2 - 2 * s + cn2) / D).clamp_min(0) + self.shape.rms_eps)
        return 1 / t.rho - 1 / rho_c, 1 / rho_c

    def add(self, src: torch.Tensor, tgt: Target) -> None:
        """src: [T, H, hd] head outputs o or [T, N] neuron outputs act of module a, same tokens as tgt."""
        n = src.shape[0]
        if self.heads:
            src = src.reshape(n, self.n_src, self.width)
        for t0 in range(0, n, self.chunk):
            sl = slice(t0, t0 + self.chunk)
            part = self._add_chunk(src[sl], tgt.rows(sl))
            self.acc += part.double()
        self.tokens += n

    def _add_chunk(self, src: torch.Tensor, t: Target) -> torch.Tensor:
        alpha, beta = self._coefficients(src, t)
        if self.heads:  # token axis last: the sums over tokens run along contiguous memory
            o = src.permute(1, 2, 0)  # [U, w, T]
            beta = beta.T[:, None, :]  # [U|1, 1, T]
            alpha = None if alpha is None else alpha.T[:, None, :]
            side = self._ffn_side(t) if self.to_ffn else \
                {"w": None if alpha is None else t.w.permute(1, 2, 0).contiguous()}  # w: [G, Rg, T]
            out = o.new_empty(self.n_src, self.n_dst)
            score = self._heads_to_ffn if self.to_ffn else self._heads_to_attention
            for us, vs in self.blocks:
                out[us, vs] = score(o[us], None if alpha is None else alpha[us],
                                    beta if beta.shape[0] == 1 else beta[us], side, us, vs)
            return out
        lam = beta * src  # [T, N_src]: coefficient of W_b(γ⊙W_down[:, n])
        mu = alpha  # [T, N_src] | None: coefficient of W_b(γ⊙x)
        return self._ffn_to_ffn(lam, mu, t) if self.to_ffn else self._ffn_to_attention(lam, mu, t)

    def _ffn_side(self, t: Target) -> dict[str, torch.Tensor]:
        """Target-side [N, T] arrays of an FFN target (token axis last)."""
        g, u, rho = t.g.T, t.u.T, t.rho.T  # [N, T], [N, T], [1, T]
        if self.opts.rho == "ablation":
            return {"g": g.contiguous(), "u": u.contiguous(), "act": t.act.T.contiguous(), "rho": rho}
        a, bs = self.act_grad(g) * u, self.act(g)  # a = silu'(g)u, b = silu(g); β = 1/ρ (per token)
        side = {"a": (a / rho).contiguous(), "b": (bs / rho).contiguous(), "rho": rho}
        if self.opts.rho == "jacobian":
            side["e"] = (a * g + bs * u).contiguous()
        return side

    def _heads_to_ffn(self, o: torch.Tensor, alpha: torch.Tensor | None, beta: torch.Tensor,
                      side: dict[str, torch.Tensor], us: slice, vs: slice) -> torch.Tensor:
        """Σ_t d² [u, nb] of source units us [u, w, T] and target neurons vs; α, β [u|1, 1, T]."""
        n = self.shape.neurons
        v0, v1 = vs.start or 0, min(vs.stop or n, n)
        zg = torch.matmul(self.fold[us, v0:v1], o)  # [u, nb, T] W_gate(γ⊙c)
        zu = torch.matmul(self.fold[us, n + v0:n + v1], o)  # W_up(γ⊙c)
        if self.opts.rho == "ablation":  # g' = g − Δg, Δg = β zg + α ρ g (and u alike); d = act − silu(g')u'
            keep = 1 - alpha * side["rho"]  # [u, 1, T]
            g2 = torch.addcmul(side["g"][vs] * keep, beta, zg, value=-1)
            u2 = torch.addcmul(side["u"][vs] * keep, beta, zu, value=-1)
            d = torch.sub(side["act"][vs], self.act(g2).mul_(u2))
        else:  # d = a Δg + b Δu, Δg = zg/ρ (+ α ρ g for the exact Jacobian)
            d = zg.mul_(side["a"][vs]).addcmul_(zu, side["b"][vs])
            if alpha is not None:
                d.addcmul_(alpha * side["rho"], side["e"][vs])
        return torch.linalg.vector_norm(d, dim=-1).square_()

    def _heads_to_attention(self, o: torch.Tensor, alpha: torch.Tensor | None, beta: torch.Tensor,
                            side: dict[str, torch.Tensor | None], us: slice, vs: slice) -> torch.Tensor:
        """Σ_t ‖W_g δn‖² [u, k] of source units us [u, w, T] and target groups vs."""
        rg = self.rows // self.shape.kv_groups
        g0, g1 = vs.start or 0, vs.stop or self.shape.kv_groups
        z = torch.matmul(self.fold[us, g0 * rg:min(g1, self.shape.kv_groups) * rg], o)  # [u, k·Rg, T]
        v = (beta * z).view(z.shape[0], -1, rg, z.shape[-1])  # [u, k, Rg, T]
        if alpha is not None:
            v += alpha[:, None] * side["w"][vs]
        return torch.linalg.vector_norm(v, dim=(2, 3)).square_()

    def _ffn_to_attention(self, lam: torch.Tensor, mu: torch.Tensor | None, t: Target) -> torch.Tensor:
        G = self.shape.kv_groups
        v = self.fold.view(self.n_src, G, -1)  # [N, G, Rg] W_g(γ⊙W_down[:, n])
        out = lam.pow(2).sum(0)[:, None] * self.v2  # [N, G]
        if mu is not None:  # ‖μ w_g + λ v_ng‖² = μ²‖w_g‖² + 2μλ w_g·v_ng + λ²‖v_ng‖²
            w = t.w  # [T, G, Rg]
            out = out + mu.pow(2).T @ w.pow(2).sum(-1)
            cross = (mu * lam).T @ w.reshape(w.shape[0], -1)  # [N, G·Rg]
            out = out + 2 * (cross.view_as(v) * v).sum(-1)
        return out

    def _ffn_to_ffn(self, lam: torch.Tensor, mu: torch.Tensor | None, t: Target) -> torch.Tensor:
        n = self.shape.neurons
        fg, fu = self.fold[:, :n], self.fold[:, n:]  # [N_src, N_dst] W_gate/up(γ⊙W_down[:, n])
        if mu is not None:
            mu = mu * t.rho  # coefficient of the target's own g·ρ, u·ρ
        if self.opts.rho == "ablation":  # Δg[t, n, m] = μ g_m + λ_n fg[n, m]; materialised
            dg = lam[:, :, None] * fg + mu[:, :, None] * t.g[:, None, :]
            du = lam[:, :, None] * fu + mu[:, :, None] * t.u[:, None, :]
            d = t.act[:, None, :] - self.act(t.g[:, None, :] - dg) * (t.u[:, None, :] - du)
            return d.pow(2).sum(0)
        # d = λ_n (a_m fg + b_m fu) + μ_n e_m, with a = silu'(g)u, b = silu(g), e = a g + b u
        a, bs = self.act_grad(t.g) * t.u, self.act(t.g)
        l2 = lam.pow(2).T  # [N_src, T]
        out = fg.pow(2) * (l2 @ a.pow(2)) + 2 * fg * fu * (l2 @ (a * bs)) + fu.pow(2) * (l2 @ bs.pow(2))
        if mu is not None:
            e = a * t.g + bs * t.u
            lm = (lam * mu).T
            out = out + mu.pow(2).T @ e.pow(2) + 2 * fg * (lm @ (e * a)) + 2 * fu * (lm @ (e * bs))
        return out

    def result(self) -> np.ndarray:
        """S_ab [units(a), units(b)] float64: raw mean scores."""
        s = self.acc / max(self.tokens, 1)
        if self.heads and not self.opts.group_unit:
            s = s.view(self.shape.kv_groups, self.shape.heads_per_group, -1).sum(1)
        if self.to_ffn:
            s = s * self.down2
        # every score is a mean of squares; the expanded sums of neuron sources (cross terms) can
        # round a true ~0 to a tiny negative in the compute dtype
        return s.clamp_min(0).cpu().numpy()


def output_weight(layer: LayerWeights, module: int) -> torch.Tensor:
    """The weight through which module's units write to the residual: o_proj or down_proj, [D, cols]."""
    return layer.o_w if module % 2 == 0 else layer.down


@torch.no_grad()
def compute_affinity(model: DenseModel, blocks: torch.Tensor, delay: float = DEFAULT.delay,
                     opts: ScoreOptions = ScoreOptions(), micro_batch: int = 4, chunk: int | None = None,
                     progress: bool = False, hidden: HiddenStates | None = None) -> dict[tuple[int, int], np.ndarray]:
    """All edges of `delay` over token blocks [B, T]: {(a, b): S_ab float64 [units(a), units(b)]}.

    Module by module over all blocks, each module run by the decoder's own loop (DenseModel.step:
    Decoder.walk over that module, its hook giving what the module computed), each layer's
    weights asked for only while its modules run (a `StreamedDense` model then holds one layer
    at a time and reads each once): kept are the residual stream of
    every calibration token ([B, T, D]) and, for each module a that a later edge still needs, its
    outputs (o or act) and its output weight. `hidden` holds those [B, ...] arrays (default: all
    in memory); micro_batch sequences go through a module at once, `chunk` caps the tokens per
    score chunk. The result does not depend on the model class or on where `hidden` keeps them.
    """
    s = model.shape
    M = s.modules
    hidden = HiddenStates() if hidden is None else hidden
    edges = edges_for_delay(M, delay)
    into: dict[int, list[int]] = {b: [a for a, bb in edges if bb == b] for b in range(M)}
    last_use = {a: max(bb for aa, bb in edges if aa == a) for a, _ in edges}
    blocks = blocks.to(model.device)
    B, T = blocks.shape
    steps = range(0, B, micro_batch)
    ids, where = torch.unique(blocks, return_inverse=True)  # the streamed model reads only these rows
    table = model.embed(ids)  # [U, D]
    x_all = hidden.new((B, T, s.hidden), table.dtype, table.device)
    sources: dict[int, tuple[torch.Tensor, MemoryArray | DiskArray]] = {}  # a -> (W_o | W_down, o | act)
    out: dict[tuple[int, int], np.ndarray] = {}
    bar = tqdm(total=M * len(steps), desc="affinity", unit="step", disable=not progress)
    try:
        for b0 in steps:
            x_all.write(b0, table[where[b0:b0 + micro_batch]])
        del table
        for b in range(M):
            layer = model.weights(b // 2)
            scorers = {a: EdgeScorer(s, sources[a][0], layer, a, b, opts, chunk) for a in into[b]}
            keep = None
            for b0 in steps:
                x = x_all.read(b0, b0 + micro_batch)
                after, r = model.step(b, x)  # module b through the decoder's loop, and what it computed
                if b % 2 == 0:
                    w = r.qkv * r.rho[..., None] if into[b] and opts.rho != "held" else None
                    src, tgt = r.o, Target(x, r.rho, w=w)
                else:
                    src, tgt = r.act, Target(x, r.rho, r.gate, r.up, r.act)
                flat = Target(*(None if v is None else v.flatten(0, 1) for v in
                                (tgt.x, tgt.rho, tgt.g, tgt.u, tgt.act, tgt.w)))
                for a, scorer in scorers.items():
                    scorer.add(sources[a][1].read(b0, b0 + micro_batch).flatten(0, 1), flat)
                if b in last_use:
                    keep = hidden.new((B,) + src.shape[1:], src.dtype, src.device) if keep is None else keep
                    keep.write(b0, src)
                x_all.write(b0, after)
                bar.update()
            for a, scorer in scorers.items():
                out[(a, b)] = scorer.result()
            if keep is not None:
                sources[b] = (output_weight(layer, b), keep)
            del scorers, layer, r, src, tgt, flat, x, after  # freed before the next layer is read
            for a in [a for a in sources if last_use[a] <= b]:
                hidden.free(sources.pop(a)[1])
    finally:
        for _, arr in sources.values():
            hidden.free(arr)
        hidden.free(x_all)
        bar.close()
    return out
