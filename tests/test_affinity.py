"""Affinity scores against independent references computed from transformers' own model.

The references take the residuals and module internals from hooks on the transformers model (not
from dtpshard.dense), rebuild each source unit's contribution c, and differentiate the target
unit with autograd when c is scaled by (1 − ε) (ρ held at its dense value for the paper's first
order score, recomputed for the exact Jacobian), or actually remove c for the ablation score.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dtpshard.affinity.file import Affinity, edges_for_delay
from dtpshard.affinity.scorer import ScoreOptions, compute_affinity
from dtpshard.cli import main
from dtpshard.core.shape import UnitShape
from dtpshard.model.checkpoint import open_checkpoint
from dtpshard.model.dense import DenseModel

try:
    from test_dense import VOCAB, tiny_model, tiny_tokenizer
except ImportError:  # tests collected as a package
    from tests.test_dense import VOCAB, tiny_model, tiny_tokenizer

MODES = {"first_order": {}, "exact": {"rho": "jacobian"}, "ablation": {"rho": "ablation"}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A 3-layer Qwen2 (q/k/v biases; 6 heads in 2 KV groups), its float64 HF twin, tokens, HF trace."""
    path = tmp_path_factory.mktemp("tiny")
    hf = tiny_model(path, "qwen2", layers=3, heads=6, kv=2, head_dim=8, hidden=32, neurons=24)
    hf = hf.double().requires_grad_(False)
    dense = DenseModel.from_checkpoint(open_checkpoint(path), dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    return path, hf, dense, ids, trace(hf, ids)


def trace(hf, ids) -> dict[str, torch.Tensor]:
    """Per layer i, flattened over tokens: x_attn{i}, x_ffn{i} (residual at each norm), o{i}, act{i}."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(hf.model.layers):
        for mod, name in ((layer.input_layernorm, "x_attn"), (layer.post_attention_layernorm, "x_ffn"),
                          (layer.self_attn.o_proj, "o"), (layer.mlp.down_proj, "act")):
            handles.append(mod.register_forward_pre_hook(
                lambda m, args, key=f"{name}{i}": seen.__setitem__(key, args[0].detach().flatten(0, 1))))
    with torch.no_grad():
        hf(ids)
    for h in handles:
        h.remove()
    return seen


def reference(hf, tr, a: int, b: int, u: int, v: int, mode: str, group_unit: bool) -> float:
    """Mean over tokens of the squared damage to target unit v of module b from source unit u of module a."""
    cfg = hf.config
    H, G, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    r = H // G
    src, tgt = hf.model.layers[a // 2], hf.model.layers[b // 2]
    if a % 2 == 0:  # the r heads of KV group u, each through its o_proj columns
        o, wo = tr[f"o{a // 2}"], src.self_attn.o_proj.weight
        cs = [o[:, h * hd:(h + 1) * hd] @ wo[:, h * hd:(h + 1) * hd].T for h in range(u * r, (u + 1) * r)]
        if group_unit:
            cs = [sum(cs)]
    else:  # neuron u: act_u · W_down[:, u]
        cs = [tr[f"act{a // 2}"][:, u:u + 1] * src.mlp.down_proj.weight[:, u]]
    if b % 2:
        x, gamma = tr[f"x_ffn{b // 2}"], tgt.post_attention_layernorm.weight
    else:
        x, gamma = tr[f"x_attn{b // 2}"], tgt.input_layernorm.weight
    rho0 = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def norm(xx):
        rho = rho0 if mode == "first_order" else torch.sqrt(xx.pow(2).mean(-1, keepdim=True) + eps)
        return gamma * xx / rho

    if b % 2:  # neuron v's output, in residual units
        mlp = tgt.mlp

        def f(xx):
            n = norm(xx)
            return (F.silu(n @ mlp.gate_proj.weight[v]) * (n @ mlp.up_proj.weight[v]))[:, None] * \
                mlp.down_proj.weight[:, v].norm()
    else:  # group v's q/k/v pre-activations
        at = tgt.self_attn
        q, kv = slice(v * r * hd, (v + 1) * r * hd), slice(v * hd, (v + 1) * hd)
        w = torch.cat([at.q_proj.weight[q], at.k_proj.weight[kv], at.v_proj.weight[kv]])
        bias = torch.cat([at.q_proj.bias[q], at.k_proj.bias[kv], at.v_proj.bias[kv]])

        def f(xx):
            return norm(xx) @ w.T + bias

    n_tok = x.shape[0]
    total = 0.0
    for c in cs:
        if mode == "ablation":
            diff = f(x) - f(x - c)
        else:  # d/dε at 0 of f(x − ε c), one ε per token (tokens are independent)
            _, diff = torch.func.jvp(lambda e, c=c: f(x - e[:, None] * c), (torch.zeros(n_tok, dtype=x.dtype),),
                                     (torch.ones(n_tok, dtype=x.dtype),))
        total += float(diff.pow(2).sum(-1).mean())
    return total


def test_up_edge_paper_score_matches_autograd(setup):
    _, hf, dense, ids, tr = setup
    s = compute_affinity(dense, ids, delay=1)
    assert sorted(s) == sorted(edges_for_delay(6, 1))
    for layer in range(3):
        S = s[(2 * layer, 2 * layer + 1)]
        assert S.shape == (2, 24) and (S > 0).all()
        for g, n in ((0, 0), (1, 5), (0, 23)):
            ref = reference(hf, tr, 2 * layer, 2 * layer + 1, g, n, "first_order", False)
            assert S[g, n] == pytest.approx(ref, rel=1e-5)


def test_down_edge_equals_per_token_loop(setup):
    """S[n, g] = mean_t act²/ρ'² · ‖W_g (γ' ⊙ W_down[:, n])‖², one token at a time."""
    _, hf, dense, ids, tr = setup
    s = compute_affinity(dense, ids, delay=1)
    cfg = hf.config
    r, hd = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    for i in range(2):
        nxt = hf.model.layers[i + 1]
        wd = hf.model.layers[i].mlp.down_proj.weight
        ref = np.zeros((cfg.intermediate_size, cfg.num_key_value_heads))
        x, act = tr[f"x_attn{i + 1}"], tr[f"act{i}"]
        for t in range(x.shape[0]):
            rho2 = float(x[t].pow(2).mean() + cfg.rms_norm_eps)
            for g in range(cfg.num_key_value_heads):
                at = nxt.self_attn
                wg = torch.cat([at.q_proj.weight[g * r * hd:(g + 1) * r * hd], at.k_proj.weight[g * hd:(g + 1) * hd],
                                at.v_proj.weight[g * hd:(g + 1) * hd]])
                for n in range(cfg.intermediate_size):
                    vec = wg @ (nxt.input_layernorm.weight * wd[:, n])
                    ref[n, g] += float(act[t, n]) ** 2 / rho2 * float(vec @ vec)
        np.testing.assert_allclose(s[(2 * i + 1, 2 * i + 2)], ref / x.shape[0], rtol=1e-5)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("group_unit", [False, True])
def test_every_edge_of_delay_3_matches_reference(setup, mode, group_unit):
    """δ = 3 has every edge kind: up, down, attention->attention, FFN->FFN, and the longer ones."""
    _, hf, dense, ids, tr = setup
    s = compute_affinity(dense, ids, delay=3, opts=ScoreOptions(group_unit=group_unit, **MODES[mode]))
    assert sorted(s) == sorted(edges_for_delay(6, 3)) and len(s) == 12
    for (a, b), S in s.items():
        assert S.shape == (2 if a % 2 == 0 else 24, 2 if b % 2 == 0 else 24)
        for u, v in ((0, 0), (S.shape[0] - 1, S.shape[1] - 1), (1, 1)):
            ref = reference(hf, tr, a, b, u, v, mode, group_unit)
            assert S[u, v] == pytest.approx(ref, rel=1e-5, abs=1e-9 * S.max()), (a, b, u, v)


def test_options_change_the_scores(setup):
    _, _, dense, ids, _ = setup
    base = compute_affinity(dense, ids, delay=1)
    for proxy in ("group-unit", "exact-jacobian", "ablation"):
        opts = ScoreOptions.of(proxy)
        assert opts.proxy == proxy  # one name per proxy, its options derived from it
        other = compute_affinity(dense, ids, delay=1, opts=opts)
        assert not np.allclose(other[(0, 1)], base[(0, 1)], rtol=1e-3)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("group_unit", [False, True])
def test_chunk_micro_batch_and_blocking_do_not_change_the_result(setup, mode, group_unit, monkeypatch):
    import dtpshard.affinity.scorer as affinity

    _, _, dense, ids, _ = setup
    opts = ScoreOptions(group_unit=group_unit, **MODES[mode])
    ref = compute_affinity(dense, ids, delay=3, opts=opts, micro_batch=2)
    runs = [dict(micro_batch=1, chunk=1), dict(micro_batch=1, chunk=4), dict(micro_batch=2, chunk=5)]
    for i, kw in enumerate(runs + [{"row_block": 8}, {"blocked": False}]):  # several blocks; one batched block
        monkeypatch.setitem(affinity.BLOCKED, "cpu", kw.pop("blocked", True))
        monkeypatch.setattr(affinity, "ROW_BLOCK", kw.pop("row_block", 512))
        got = compute_affinity(dense, ids, delay=3, opts=opts, **kw)
        for e in ref:
            np.testing.assert_allclose(got[e], ref[e], rtol=1e-12, atol=1e-14 * ref[e].max(), err_msg=str((i, e)))


def test_float32_pass_is_close_to_float64(setup):
    path, _, dense, ids, _ = setup
    ref = compute_affinity(dense, ids, delay=2)
    got = compute_affinity(DenseModel.from_checkpoint(open_checkpoint(path)), ids, delay=2)
    for e in ref:
        np.testing.assert_allclose(got[e], ref[e], rtol=1e-3, atol=1e-6 * ref[e].max())


# -- the command ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tiny_model(path, "llama", layers=2, heads=4, kv=2, head_dim=8, hidden=32, neurons=16)
    tiny_tokenizer(path)
    return path


TEXT = "\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i} times." for i in range(40))


def test_command_writes_the_affinity_file(tmp_path, model_dir, capsys):
    from dtpshard.data.blocks import load_texts, make_blocks
    from dtpshard.model.checkpoint import load_tokenizer

    txt = tmp_path / "cal.txt"
    txt.write_text(TEXT)
    out = tmp_path / "aff.safetensors"
    rc = main(["affinity", str(model_dir), "--out", str(out), "--text", str(txt), "--blocks", "3",
               "--seq-len", "16", "--delay", "2", "--no-progress", "--seed", "5"])
    assert rc == 0, capsys.readouterr().err
    aff = Affinity.load(out)
    assert sorted(aff.edges) == sorted(edges_for_delay(4, 2))
    assert aff.model == UnitShape(2, 2, 2, 16)
    assert aff.delay == 2 and aff.tokens == 48 and "cal.txt" in aff.source
    assert aff.options["proxy"] == "first-order" and aff.options["extra_edges"] is True
    from safetensors import safe_open

    with safe_open(str(out), framework="numpy") as f:
        assert f.metadata()["format"] == "dtpshard.affinity/1"
        assert json.loads(f.metadata()["model"])["neurons"] == 16
    ids = make_blocks(load_tokenizer(model_dir), load_texts([txt]), 16, 3, seed=5)
    direct = compute_affinity(DenseModel.from_checkpoint(open_checkpoint(model_dir)), ids, delay=2)
    for e, S in direct.items():
        np.testing.assert_allclose(aff.edges[e], S.astype(np.float32), rtol=1e-6)


def test_command_default_offline_corpus(tmp_path, model_dir):
    out = tmp_path / "aff.safetensors"
    assert main(["affinity", str(model_dir), "--out", str(out), "--blocks", "2", "--seq-len", "8",
                 "--no-progress", "--proxy", "ablation"]) == 0
    aff = Affinity.load(out)
    assert aff.source.startswith("offline:python-stdlib-docstrings") and aff.options["proxy"] == "ablation"


def _one_line_error(capsys, argv: list[str], needle: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dtpshard affinity: error:") and needle in err, err


def test_command_bad_inputs_give_one_line(tmp_path, model_dir, capsys):
    out = str(tmp_path / "a.safetensors")
    base = ["affinity", str(model_dir), "--out", out, "--no-progress"]
    _one_line_error(capsys, base + ["--text", str(tmp_path / "missing.txt")], "not found")
    (tmp_path / "empty.txt").write_text("\n  \n")
    _one_line_error(capsys, base + ["--text", str(tmp_path / "empty.txt")], "empty")
    (tmp_path / "short.txt").write_text("the quick brown fox jumps over the lazy dog")
    _one_line_error(capsys, base + ["--text", str(tmp_path / "short.txt"), "--seq-len", "512"],
                    "shorter than one block")
    (tmp_path / "cal.txt").write_text(TEXT)
    _one_line_error(capsys, base + ["--text", str(tmp_path / "cal.txt"), "--seq-len", "64", "--blocks", "500"],
                    "blocks of 64 tokens")
    _one_line_error(capsys, base + ["--proxy", "exact-jacobian-ablation"], "--proxy")
    _one_line_error(capsys, base + ["--delay", "0.5"], "no edges")
    gelu = tmp_path / "gelu"
    gelu.mkdir()
    cfg = json.loads((model_dir / "config.json").read_text())
    (gelu / "config.json").write_text(json.dumps(dict(cfg, hidden_act="gelu")))
    _one_line_error(capsys, ["affinity", str(gelu), "--out", out], "hidden_act")
    _one_line_error(capsys, ["affinity", str(tmp_path / "nomodel"), "--out", out], "not found")
    assert not (tmp_path / "a.safetensors").exists()
