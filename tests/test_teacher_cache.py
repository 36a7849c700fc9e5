"""The teacher cache: its loss against the literal formula, the cache's round trip and refusals,
a cached distillation that resumes after a kill; compiled DTP against eager (slow: a CPU compile)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from dtpshard.cli import main
from dtpshard.training import rundir
from dtpshard.training.losses import kl_ce_sums, teacher_topk, topk_kl_ce_sums
from dtpshard.training.teacher_cache import TeacherCache, cache_blocks, teacher_targets


def literal(h_s, w_s, t_logits, targets, k, ce_weight):
    """KL over the teacher's top k plus the tail bucket, written out with autograd."""
    logq = torch.log_softmax(h_s @ w_s.T, -1)
    logp = torch.log_softmax(t_logits, -1)
    top = logp.topk(k, -1).indices
    in_k = torch.zeros_like(logp, dtype=torch.bool).scatter(1, top, True)
    p, q = logp.exp(), logq.exp()
    p_tail, q_tail = (p * ~in_k).sum(-1), (q * ~in_k).sum(-1)
    kl = (torch.where(in_k, p * (logp - logq), 0)).sum(-1) + p_tail * (p_tail.log() - q_tail.log())
    ce = -logq.gather(1, targets[:, None])[:, 0]
    return (kl + ce_weight * ce).sum(), kl.sum(), ce.sum()


def test_topk_loss_is_the_literal_formula_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    N, D, V, k = 11, 8, 40, 6
    h = torch.randn(N, D, generator=g, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(V, D, generator=g).requires_grad_()
    t_logits = 2 * torch.randn(N, V, generator=g)
    y = torch.randint(0, V, (N,), generator=g)
    ref = literal(h, w, t_logits, y, k, 0.1)
    ref[0].backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ids, lp, tail = teacher_topk(t_logits, k)
    out = topk_kl_ce_sums(h, w, ids, lp, tail, y, 0.1, chunk=4)
    out[0].backward()
    for a, b in zip(out, ref):
        assert torch.allclose(a, b.detach(), rtol=1e-5, atol=1e-5), (a, b)
    assert torch.allclose(h.grad, gh, atol=1e-5) and torch.allclose(w.grad, gw, atol=1e-5)
    # k = V: no tail, the exact KL; and KL_K <= KL in general
    t_h = torch.randn(N, D, generator=g)
    full = kl_ce_sums(h.detach(), w.detach(), t_h, w.detach(), y, 0.1)
    ids, lp, tail = teacher_topk(t_h @ w.detach().T, V)
    assert torch.isinf(tail).all()
    allk = topk_kl_ce_sums(h.detach(), w.detach(), ids, lp, tail, y, 0.1)
    assert torch.allclose(allk[1], full[1], rtol=1e-5)
    ids, lp, tail = teacher_topk(t_h @ w.detach().T, 4)
    assert topk_kl_ce_sums(h.detach(), w.detach(), ids, lp, tail, y, 0.1)[1] <= full[1] + 1e-6


@pytest.fixture(scope="module")
def cached(tiny_dirs, tmp_path_factory):
    from test_distill import random_docs

    root = tmp_path_factory.mktemp("tcache")
    (root / "docs.txt").write_text("\n\n".join(random_docs(300, 0)))
    model = tiny_dirs["llama"]
    data = ["--steps", "8", "--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2",
            "--text", str(root / "docs.txt")]
    assert main(["teacher-cache", str(model), "--out", str(root / "cache"), "--k", "16", "--seeds", "0", "1",
                 "--no-progress", *data]) == 0
    return {"root": root, "model": model, "data": data, "cache": root / "cache"}


def test_cache_round_trip(cached):
    from dtpshard.model.dtp import DTPModel

    cache = TeacherCache(cached["cache"])
    m = json.loads((cached["cache"] / "manifest.json").read_text())
    assert m["k"] == 16 and m["dtype"] == "float16" and m["seq_len"] == 32
    blocks = cache_blocks(cached["model"], [1], 8, 32, 2, 2, 1, [str(cached["root"] / "docs.txt")], None)
    cache.check(cached["model"], blocks)
    teacher = DTPModel.from_pretrained(cached["model"], devices=1, delay=0).eval()
    ids, lp, tail = cache.lookup(blocks[5:8])
    r_ids, r_lp, r_tail = teacher_targets(teacher, blocks[5:8, :-1], 16)
    assert lp.dtype == torch.float16 and ids.shape == (3, 32, 16)
    assert torch.equal(ids, r_ids) and torch.allclose(lp.float(), r_lp, atol=1e-2, rtol=1e-3)
    assert torch.allclose(tail, r_tail, atol=1e-5)
    # a rerun of the same command keeps the finished cache
    before = {p.name: p.stat().st_mtime_ns for p in cached["cache"].iterdir()}
    assert main(["teacher-cache", str(cached["model"]), "--out", str(cached["cache"]), "--k", "16", "--seeds", "0",
                 "1", "--no-progress", *cached["data"]]) == 0
    assert before == {p.name: p.stat().st_mtime_ns for p in cached["cache"].iterdir()}


def _one_line(capsys, *what):
    err = [x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("note:")]
    assert len(err) == 1 and all(w in err[0] for w in what), err


def test_cache_refusals(cached, tiny_dirs, tmp_path, capsys):
    base = ["distill", "--teacher-cache", str(cached["cache"]), "--no-progress", "--eval-blocks", "2", *cached["data"]]
    assert main([base[0], str(cached["model"]), "--out", str(tmp_path / "a"), *base[1:], "--seed", "2"]) == 2
    _one_line(capsys, "built for other training blocks")
    assert main([base[0], str(tiny_dirs["llama_tied"]), "--out", str(tmp_path / "b"), *base[1:]]) == 2
    _one_line(capsys, "built for another teacher")
    assert main([base[0], str(cached["model"]), "--out", str(tmp_path / "c"), *base[1:], "--seq-len", "16"]) == 2
    _one_line(capsys, "built for seq_len 32")
    assert main(["teacher-cache", str(cached["model"]), "--out", str(cached["cache"]), "--k", "8", "--no-progress",
                 *cached["data"]]) == 2
    _one_line(capsys, "holds something else", "--force")
    assert main([base[0], str(cached["model"]), "--out", str(tmp_path / "d"), *base[1:], "--fsdp"]) == 2
    _one_line(capsys, "--teacher-cache with --fsdp")
    assert main(["distill", str(cached["model"]), "--out", str(tmp_path / "e"), "--fsdp", "--compile"]) == 2
    _one_line(capsys, "--compile on with --fsdp")
    assert not any((tmp_path / n).exists() for n in "abde")


def _cli(args, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}  # conftest's PYTHONPATH: the crash hook
    return subprocess.run([sys.executable, "-m", "dtpshard", *args], env=env, capture_output=True, text=True,
                          timeout=600)


def test_cached_distillation_resumes_after_a_kill(cached, tmp_path, capsys):
    def args(run):
        return ["distill", str(cached["model"]), "--out", str(run), "--teacher-cache", str(cached["cache"]),
                "--no-progress", "--eval-blocks", "2", "--eval-every", "4", "--checkpoint-every", "3", "--devices",
                "2", "--lr", "1e-3", "--warmup", "2", "--eval-text", str(cached["root"] / "docs.txt"), "--seed", "1",
                *cached["data"]]

    straight = tmp_path / "straight"
    assert main(args(straight)) == 0
    rows = rundir.read_metrics(straight)
    train = [r for r in rows if r["kind"] == "train"]
    assert train[-1]["kl"] < train[0]["kl"] and all(r["kl"] >= 0 for r in train)
    assert json.loads((straight / "config.json").read_text())["teacher_cache_id"]["k"] == 16
    run = tmp_path / "run"
    first = _cli(args(run), {"DTPSHARD_TEST_CRASH": "step:5"})
    assert first.returncode == 17, first.stderr
    assert _cli(args(run)).returncode == 0

    def strip(rs):
        return [{k: v for k, v in r.items() if k != "wall"} for r in rs]

    assert strip(rundir.read_metrics(run)) == strip(rows)
    # the same run without the cache computes another loss: refused
    (run / "DONE").unlink()
    no_cache = args(run)
    i = no_cache.index("--teacher-cache")
    del no_cache[i:i + 2]
    assert main(no_cache) == 2
    _one_line(capsys, "teacher_cache_id")


def test_compile_mode_resolution():
    from dtpshard.core.errors import UserError
    from dtpshard.model.compiled import AUTO_MIN_STEPS, want_compile

    assert want_compile("on", "cpu", 1) and not want_compile("off", "cuda", 10**6)
    assert want_compile("auto", "cuda", 1)
    assert want_compile("auto", "cpu", AUTO_MIN_STEPS) and not want_compile("auto", "cpu", AUTO_MIN_STEPS - 1)
    with pytest.raises(UserError):
        want_compile("maybe", "cpu")


@pytest.mark.slow
def test_compiled_dtp_equals_eager(tmp_path, monkeypatch):
    """A minute of CPU compile (less with a warm inductor cache): slow."""
    from dtpshard.model.compiled import compile_module
    from dtpshard.model.dtp import DTPModel
    from tiny import tiny_hf_model

    class Hidden(torch.nn.Module):  # the student's LM-head input, what distillation trains through
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model.hidden(ids)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = DTPModel.from_hf(tiny_hf_model("qwen3"), devices=4, delay=1)
    ids = torch.randint(0, 384, (2, 33), generator=torch.Generator().manual_seed(0))
    grads = []
    for net in (Hidden(model), compile_module(Hidden(model))):
        model.zero_grad(set_to_none=True)
        h = net(ids)
        h.square().mean().backward()
        grads.append((h.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (h0, g0), (h1, g1) = grads
    assert (h0 - h1).abs().max() < 1e-4
    assert max((g0[n] - g1[n]).abs().max().item() for n in g0) < 1e-4


def test_experiment_builds_one_cache_for_every_arm(tiny_dirs, tmp_path, monkeypatch):
    import dtpshard.training.teacher_cache as tc
    from test_experiment import config_text, corpus

    cfg = tmp_path / "study.toml"
    text = config_text(tiny_dirs["llama"], corpus(tmp_path / "corpus.txt"))
    cfg.write_text(text.replace("delay = 1\n", "delay = 1\nteacher_cache_k = 8\n", 1))
    shards = []
    write = tc._write_shard
    monkeypatch.setattr(tc, "_write_shard", lambda path, *a: (shards.append(path), write(path, *a)))
    out = tmp_path / "exp"
    assert main(["experiment", str(cfg), "--out", str(out)]) == 0
    assert len(shards) == 1  # the teacher ran once for both arms
    manifest = json.loads((out / "teacher-cache" / "manifest.json").read_text())
    assert manifest["k"] == 8 and manifest["blocks"] == 4  # seed 0: 2 steps x 2 x 1 blocks
    for run in ("optimised-s0", "contiguous-s0"):
        config = json.loads((out / "runs" / run / "config.json").read_text())
        assert config["teacher_cache_id"]["k"] == 8 and (out / "runs" / run / "DONE").is_file()
