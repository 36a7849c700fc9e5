"""Chunked KL + CE and `evaluate` against full-logit references computed with plain torch ops
and transformers' own model; `dtpshard eval` end to end; its refusals."""
import json
import random

import pytest
import torch
import torch.nn.functional as F

from dtpshard.cli import main
from dtpshard.core.layout import Layout
from dtpshard.core.shape import UnitShape
from dtpshard.model.dtp import DTPModel
from dtpshard.training.evaluate import eval_blocks_for, evaluate
from dtpshard.training.losses import kl_ce_sums


def reference_sums(h_s, w_s, h_t, w_t, y, ce_weight):
    """Full [N, V] logits, the textbook formulas."""
    ls, lt = F.log_softmax(h_s @ w_s.T, -1), F.log_softmax(h_t @ w_t.T, -1)
    kl = F.kl_div(ls, lt, log_target=True, reduction="sum")
    ce = F.cross_entropy(h_s @ w_s.T, y, reduction="sum")
    return kl + ce_weight * ce, kl, ce


@pytest.mark.parametrize("chunk", [7, 1000])
def test_fused_loss_and_gradients_match_full_logits(chunk):
    g = torch.Generator().manual_seed(0)
    N, D, V = 23, 8, 50
    h_s = torch.randn(N, D, generator=g, requires_grad=True)
    w_s = torch.randn(V, D, generator=g, requires_grad=True)
    h_t, w_t = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    y = torch.randint(0, V, (N,), generator=g)
    got = kl_ce_sums(h_s, w_s, h_t, w_t, y, ce_weight=0.1, chunk=chunk)
    (got[0] * 0.7).backward()
    gh, gw = h_s.grad.clone(), w_s.grad.clone()
    h_s.grad = w_s.grad = None
    ref = reference_sums(h_s, w_s, h_t, w_t, y, 0.1)
    (ref[0] * 0.7).backward()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, h_s.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, w_s.grad, rtol=1e-5, atol=1e-6)


def test_fused_loss_without_teacher_is_weighted_ce():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    w = torch.randn(30, 8, generator=g)
    y = torch.randint(0, 30, (2, 5), generator=g)
    loss, kl, ce = kl_ce_sums(h, w, None, None, y, ce_weight=0.3, chunk=4)
    loss.backward()
    h2 = h.detach().clone().requires_grad_(True)
    ref = 0.3 * F.cross_entropy((h2 @ w.T).reshape(-1, 30), y.reshape(-1), reduction="sum")
    ref.backward()
    assert float(kl) == 0.0
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6)


def _hf_reference(student, hf, blocks):
    ids, y = blocks[:, :-1], blocks[:, 1:]
    with torch.no_grad():
        ls = F.log_softmax(student(ids).logits, -1).reshape(-1, hf.config.vocab_size)
        lt = F.log_softmax(hf(ids).logits, -1).reshape(-1, hf.config.vocab_size)
    kl = F.kl_div(ls, lt, log_target=True, reduction="sum").item() / y.numel()
    ce = F.nll_loss(ls, y.reshape(-1)).item()
    return kl, torch.tensor(ce).exp().item(), (ls.argmax(-1) == lt.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_evaluate_matches_transformers_reference(family):
    from tiny import tiny_hf_model

    hf = tiny_hf_model(family, seed=3)
    layout = Layout.random(DTPModel.from_hf(hf, 1, 0).shape, devices=2, delay=1, seed=5)
    student = DTPModel.from_hf(hf, devices=2, delay=1, layout=layout)
    blocks = torch.randint(0, hf.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(2))
    kl, ppl, top1 = _hf_reference(student, hf, blocks)
    assert kl > 1e-3 and top1 < 1  # δ = 1 really differs from the dense teacher
    for teacher in (hf, DTPModel.from_hf(hf, devices=1, delay=0)):  # transformers' model or the dense DTP model
        for micro in (1, 2, 3):
            r = evaluate(student, teacher, blocks, micro_batch=micro)
            assert r["tokens"] == 3 * 16
            assert r["kl"] == pytest.approx(kl, rel=1e-5)
            assert r["ppl"] == pytest.approx(ppl, rel=1e-5)
            assert r["top1"] == pytest.approx(top1, abs=1e-6)  # the share of the 48 positions (fp32 mean)
    assert evaluate(student, None, blocks)["kl"] is None and evaluate(student, None, blocks)["top1"] is None


def test_tensor_parallel_student_has_zero_kl():
    from tiny import tiny_hf_model

    hf = tiny_hf_model("qwen2", seed=1)
    blocks = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    r = evaluate(DTPModel.from_hf(hf, devices=4, delay=0), hf, blocks, micro_batch=2)
    assert abs(r["kl"]) < 1e-6 and r["top1"] == 1.0  # fp32 rounding only; δ = 1 gives ~0.1


@pytest.fixture(scope="module")
def eval_text(tmp_path_factory):
    """Documents of random words: enough held-out ones for a few blocks."""
    rng = random.Random(0)
    docs = [" ".join("".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 6)))
                     for _ in range(rng.randint(30, 60))) for _ in range(300)]
    path = tmp_path_factory.mktemp("evaltext") / "docs.txt"
    path.write_text("\n\n".join(docs))
    return path


def test_eval_cmd_json_equals_evaluate(tiny_dirs, eval_text, capsys):
    model = tiny_dirs["llama"]
    args = ["eval", str(model), "--devices", "2", "--delay", "1", "--text", str(eval_text), "--blocks", "3",
            "--seq-len", "16", "--micro-batch", "2", "--json"]
    assert main(args + ["--teacher", str(model)]) == 0
    out = json.loads(capsys.readouterr().out)
    blocks, source = eval_blocks_for(model, text=[str(eval_text)], blocks=3, seq_len=16)
    assert "[eval:" in source and blocks.shape == (3, 17)
    ref = evaluate(DTPModel.from_pretrained(model, 2, 1), DTPModel.from_pretrained(model, 1, 0), blocks, 3)
    assert out["tokens"] == 48 and out["kl"] == pytest.approx(ref["kl"], rel=1e-6)
    assert out["ppl"] == pytest.approx(ref["ppl"], rel=1e-6)
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kl"] is None and out["ppl"] == pytest.approx(ref["ppl"], rel=1e-6)


def _one_error_line(capsys, what):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and what in err, err
    return err


def test_eval_cmd_refusals(tiny_dirs, eval_text, tmp_path, capsys):
    model = str(tiny_dirs["llama"])
    base = ["eval", model, "--text", str(eval_text), "--blocks", "2", "--seq-len", "16"]
    assert main(base + ["--devices", "3"]) == 2
    _one_error_line(capsys, "devices=3")
    assert main(base + ["--devices", "2", "--delay", "7"]) == 2
    _one_error_line(capsys, "delay=7")
    other = Layout.contiguous(UnitShape(3, 4, 2, 64), devices=2)
    other.save(tmp_path / "other.json")
    assert main(base + ["--devices", "2", "--layout", str(tmp_path / "other.json")]) == 2
    _one_error_line(capsys, "neurons=64")
    (tmp_path / "empty.txt").write_text("")
    assert main(["eval", model, "--text", str(tmp_path / "empty.txt")]) == 2
    _one_error_line(capsys, "empty")
    assert main(base + ["--blocks", "500"]) == 2
    _one_error_line(capsys, "blocks")


def test_default_eval_data_is_the_offline_corpus_held_out_share(tiny_dirs, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never reach for the hub in tests
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    blocks, source = eval_blocks_for(tiny_dirs["llama"], blocks=2, seq_len=16)
    assert blocks.shape == (2, 17) and source.startswith("offline:") and "[eval:" in source
    assert capsys.readouterr().err == ""  # no hub attempt, so nothing to fall back from
