"""A literal transcription of docs/design.md §1, written independently of dtpshard.model.

Plain Python loops over devices, modules, heads; RoPE and attention written out by hand.
Slow and obvious on purpose: the tests compare DTPModel against it.

Shared neurons (docs/design.md §6) are transcribed here too, on the UNPERMUTED model: `units`
says, per layer, which original KV groups and neurons each device holds and which neurons every
device holds (`units_of_layout_file` reads them off a layout file's JSON by the letter of its format).
"""
from __future__ import annotations

import math

import torch


def _cfg(hf_config):
    c = hf_config
    H, G = c.num_attention_heads, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // H
    rp = getattr(c, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    return H, G, hd, theta, c.rms_norm_eps, c.model_type


def _mult(c, key):  # Granite's multipliers (every other family: none)
    return float(getattr(c, key, 1.0)) if c.model_type == "granite" else 1.0


def _weights(sd, pre, c):
    """A layer's q, k, v, gate and up matrices, read from Phi-3's fused tensors where it has them."""
    if c.model_type != "phi3":
        return {n: sd[pre + f"{'self_attn' if n in 'qkv' else 'mlp'}.{n}_proj.weight"]
                for n in ("q", "k", "v", "gate", "up")}
    H, G, hd = c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    qkv, gate_up = sd[pre + "self_attn.qkv_proj.weight"], sd[pre + "mlp.gate_up_proj.weight"]
    N = gate_up.shape[0] // 2
    return {"q": qkv[:H * hd], "k": qkv[H * hd:(H + G) * hd], "v": qkv[(H + G) * hd:],
            "gate": gate_up[:N], "up": gate_up[N:]}


def _norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, theta, factor=1.0):  # x [T, hd], positions 0..T-1; the first factor·hd dimensions rotate
    T, full = x.shape
    hd = int(full * factor)
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    y = x[:, :hd]
    rot = torch.cat([-y[:, hd // 2:], y[:, :hd // 2]], -1)
    return torch.cat([y * cos + rot * sin, x[:, hd:]], -1)


def units_of_layout_file(obj, L):
    """Per layer {"groups": [device l's KV groups], "neurons": [device l's neurons], "shared": [...]}
    from a layout file's JSON: position p holds unit perm[p]; the last `shared` positions of
    ffn_perm are every device's, the rest split in L equal runs."""
    n = obj.get("shared", 0)
    out = []
    for layer in obj["layers"]:
        kv, ffn = layer["kv_perm"], layer["ffn_perm"]
        g, k = len(kv) // L, (len(ffn) - n) // L
        out.append({"groups": [kv[l * g:(l + 1) * g] for l in range(L)],
                    "neurons": [ffn[l * k:(l + 1) * k] for l in range(L)], "shared": ffn[len(ffn) - n:]})
    return out


def _ffn(sd, hf_config, pre, x, rows):
    """The FFN of the neurons `rows` on one sequence x [T, D] (pre-norm included)."""
    W = _weights(sd, pre, hf_config)
    h = _norm(x, sd[pre + "post_attention_layernorm.weight"], hf_config.rms_norm_eps)
    g = h @ W["gate"][rows].T
    u = h @ W["up"][rows].T
    return (torch.nn.functional.silu(g) * u) @ sd[pre + "mlp.down_proj.weight"][:, rows].T


def shared_output(sd, hf_config, i, x, neurons):
    """What device l adds at once, unscaled, after FFN i: the shared neurons on its own stream x."""
    if not len(neurons):
        return torch.zeros_like(x)
    return _ffn(sd, hf_config, f"model.layers.{i}.", x, list(neurons)) * _mult(hf_config, "residual_multiplier")


def device_partial(sd, hf_config, m, l, L, x, units=None):
    """p_l^m = f_m^l(x): device l's heads or neurons of module m, for one sequence x [T, D] (times
    Granite's residual multiplier: what joins the stream). `units`: units_of_layout_file's, else
    device l holds the l-th contiguous run."""
    H, G, hd, theta, eps, family = _cfg(hf_config)
    r = H // G
    i = m // 2
    pre = f"model.layers.{i}."
    W = _weights(sd, pre, hf_config)
    if m % 2 == 1:
        N = W["gate"].shape[0]
        rows = list(units[i]["neurons"][l]) if units else slice(l * N // L, (l + 1) * N // L)
        return _ffn(sd, hf_config, pre, x, rows) * _mult(hf_config, "residual_multiplier")
    h = _norm(x, sd[pre + "input_layernorm.weight"], eps)
    T = x.shape[0]
    out = torch.zeros_like(x)
    factor = (getattr(hf_config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    scale = _mult(hf_config, "attention_multiplier") if family == "granite" else 1 / math.sqrt(hd)
    window = getattr(hf_config, "sliding_window", None) if family == "phi3" else None
    hidden = torch.ones(T, T, dtype=torch.bool).triu(1)  # a query does not see later positions
    if window is not None:  # nor those `window` or more before it
        hidden |= torch.ones(T, T, dtype=torch.bool).tril(-window)
    for g_ in (units[i]["groups"][l] if units else range(l * G // L, (l + 1) * G // L)):
        ks = slice(g_ * hd, (g_ + 1) * hd)
        k = h @ W["k"][ks].T
        v = h @ W["v"][ks].T
        if family == "qwen2":
            k = k + sd[pre + "self_attn.k_proj.bias"][ks]
            v = v + sd[pre + "self_attn.v_proj.bias"][ks]
        if family == "qwen3":
            k = _norm(k, sd[pre + "self_attn.k_norm.weight"], eps)
        k = _rope(k, theta, factor)
        for h_ in range(g_ * r, (g_ + 1) * r):
            qs = slice(h_ * hd, (h_ + 1) * hd)
            q = h @ W["q"][qs].T
            if family == "qwen2":
                q = q + sd[pre + "self_attn.q_proj.bias"][qs]
            if family == "qwen3":
                q = _norm(q, sd[pre + "self_attn.q_norm.weight"], eps)
            q = _rope(q, theta, factor)
            scores = (q @ k.T) * scale
            scores = scores.masked_fill(hidden, float("-inf"))
            out = out + (scores.softmax(-1) @ v) @ sd[pre + "self_attn.o_proj.weight"][:, qs].T
    return out * _mult(hf_config, "residual_multiplier")


def own_scale(m, M, L, d, stage3, delayed=None):
    """s_m at a whole δ = d. Per-module delay: module k's sum lands at k + d when k is delayed, at k
    when plain; stage 1 is every module before the first landing, stage 3 a delayed module whose
    sum lands past the last module."""
    if delayed is None:
        delayed = range(M)
    first = min(k + d if k in delayed else k for k in range(M))
    if m < first:
        return math.sqrt(L)
    if m in delayed and m + d >= M:
        return math.sqrt(L) if stage3 == "sqrt" else 1.0
    return 1.0


def literal_dtp_logits(hf_model, ids, L, delta, stage3="sqrt", units=None, delayed=None):
    """Logits [B, T, V] of the DTP model by the letter of docs/design.md §1 (and §6: each device adds
    the shared neurons' output of its own stream at once, unscaled, and never sends it), `units`
    as device_partial takes them; `delayed`: the modules delayed by δ (None: all), the others plain
    tensor parallel."""
    sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
    cfg = hf_model.config
    M = 2 * cfg.num_hidden_layers
    d = math.floor(delta)
    a = delta - d
    on_time = set(range(M)) - set(range(M) if delayed is None else delayed)
    lands = {}  # module m -> [(source k, weight)]: where each module's sum lands
    for k in range(M):
        for at, w in ([(k, 1.0)] if k in on_time else [(k + d, 1 - a), (k + d + 1, a)]):
            if at < M and w > 0:
                lands.setdefault(at, []).append((k, w))
    lm = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    out = []
    for seq in ids:
        xs = [sd["model.embed_tokens.weight"][seq] * _mult(cfg, "embedding_multiplier") for _ in range(L)]
        P = {}
        for m in range(M):
            P[m] = [device_partial(sd, cfg, m, l, L, xs[l], units) for l in range(L)]
            own = [shared_output(sd, cfg, m // 2, xs[l], units[m // 2]["shared"] if units else [])
                   if m % 2 else 0 for l in range(L)]
            s = own_scale(m, M, L, d, stage3, delayed)
            if a:
                s = (1 - a) * s + a * own_scale(m, M, L, d + 1, stage3, delayed)
            new = []
            for l in range(L):
                x = xs[l] + s * P[m][l] + own[l]
                for k, w in lands.get(m, []):
                    x = x + w * sum(P[k][j] for j in range(L) if j != l)
                new.append(x)
            xs = new
        h = sum(_norm(x, sd["model.norm.weight"], cfg.rms_norm_eps) for x in xs) / L
        out.append(h @ lm.T / _mult(cfg, "logits_scaling"))
    return torch.stack(out)
