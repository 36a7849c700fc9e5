"""DTPModel as a transformers causal LM: students that say what they are, outputs and loss,
padded batches, generate() against the CLI, dtype="auto", torch.compile."""
import json
import logging
import shutil

import pytest
import torch

from dtpshard.cli import main
from dtpshard.core.layout import Layout
from dtpshard.model.dtp import DTPModel
from tiny import save_tiny, tiny_hf_model

TOL = 1e-4


def ids_for(B=2, T=11, seed=0, vocab=384):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def student(tiny_dirs, tmp_path_factory):
    """A student as distill writes one (save_pretrained of a permuted DTP model), with its layout."""
    src = tiny_dirs["qwen3"]
    layout = Layout.random(DTPModel.from_pretrained(src, 1, 0).shape, devices=2, delay=1, seed=1)
    model = DTPModel.from_pretrained(src, devices=2, delay=1, layout=layout)
    with torch.no_grad():  # "trained": no longer the teacher's function at any setting
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    out = tmp_path_factory.mktemp("student") / "final"
    model.save_pretrained(out, source=src)
    return {"path": out, "model": model, "layout": layout, "teacher": src}


def test_student_records_its_settings_and_loads_as_dtp(student, caplog):
    cfg = json.loads((student["path"] / "config.json").read_text())
    want = {"devices": 2, "delay": 1, "stage3": "sqrt", "layout_sha256": student["layout"].content_sha256()}
    assert cfg["dtp"] == {"family": "qwen3", **want} and cfg["model_type"] == "dtp"
    assert not (student["path"] / "dtp.json").exists()  # config.json is the one record (dtp.json still read)
    ids = ids_for()
    with caplog.at_level(logging.WARNING, logger="dtpshard"):
        again = DTPModel.from_pretrained(student["path"])  # the recorded settings by default
    assert not caplog.records
    assert again.dtp_settings() == {"devices": 2, "delay": 1, "stage3": "sqrt"}
    assert again.layout_sha256 == want["layout_sha256"]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, student["model"](ids).logits)


def test_dense_load_of_a_student_warns_in_one_line(student, caplog):
    from transformers import Qwen3ForCausalLM

    ids = ids_for()
    with caplog.at_level(logging.WARNING, logger="dtpshard"):
        dense = DTPModel.from_pretrained(student["path"], devices=1, delay=0)
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert "\n" not in line and "DTP student" in line and str(student["path"]) in line
    # the family's own class, forced on it, loads the weights (their names are the family's) and
    # runs them dense, which is what the warning is about: not the function the student computes
    # (AutoModelForCausalLM refuses it without remote code: test_remote.py)
    hf = Qwen3ForCausalLM.from_pretrained(str(student["path"]), dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        ref = hf(ids).logits
        assert (dense(ids).logits - ref).abs().max().item() <= TOL
        assert (student["model"](ids).logits - ref).abs().max().item() > 1e-2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dtpshard"):
        DTPModel.from_pretrained(student["teacher"], devices=1, delay=0)  # a dense checkpoint: no warning
    assert not caplog.records


def test_hf_surface_and_loss_match_transformers():
    hf = tiny_hf_model("llama")
    ids = ids_for(B=3, T=9)
    labels = ids.clone()
    labels[0, :4] = -100
    labels[2, -2:] = -100
    model = DTPModel.from_hf(hf, devices=2, delay=0)
    assert model.config is model.hf_config and model.config.model_type == "llama"
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    out, ref = model(ids, labels=labels), hf(ids, labels=labels)
    assert (out.logits - ref.logits).abs().max().item() <= TOL
    assert out.loss.item() == pytest.approx(ref.loss.item(), abs=1e-5)
    assert out[0] is out.loss and model(ids).loss is None
    dtp = DTPModel.from_hf(hf, devices=2, delay=1)(ids, labels=labels)
    ce = torch.nn.functional.cross_entropy(dtp.logits[:, :-1].reshape(-1, 384), labels[:, 1:].reshape(-1))
    assert dtp.loss.item() == pytest.approx(ce.item(), rel=1e-6)


@pytest.mark.parametrize("family,devices,delay", [("qwen3", 4, 1), ("llama", 2, 1.5), ("qwen2", 4, 0)])
def test_left_padded_batch_equals_unpadded_rows(family, devices, delay):
    model = DTPModel.from_hf(tiny_hf_model(family, seed=2), devices=devices, delay=delay)
    rows = [ids_for(1, T, seed=T)[0] for T in (10, 7, 4)]
    width, pad = 10, 0
    ids = torch.stack([torch.cat([torch.full((width - len(r),), pad), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(width - len(r)), torch.ones(len(r))]).long() for r in rows])
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        assert torch.isfinite(padded).all()
        for b, r in enumerate(rows):
            alone = model(r[None]).logits[0]
            assert (padded[b, width - len(r):] - alone).abs().max().item() <= TOL, b
        # decoding a padded batch from the cache equals the full padded forward
        cache = model.new_cache()
        parts = [model(ids[:, :6], attention_mask=mask[:, :6], cache=cache).logits]
        parts += [model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits for t in range(6, width)]
    got = torch.cat(parts, 1)
    for b, r in enumerate(rows):
        assert (got[b, width - len(r):] - padded[b, width - len(r):]).abs().max().item() <= TOL


def test_generate_left_padded_batch_equals_each_prompt_alone():
    model = DTPModel.from_hf(tiny_hf_model("qwen3", seed=4), devices=4, delay=1)
    rows = [ids_for(1, 8, seed=1)[0], ids_for(1, 5, seed=2)[0]]
    ids = torch.stack([rows[0], torch.cat([torch.zeros(3, dtype=torch.long), rows[1]])])
    mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    out = model.generate(ids, max_new_tokens=6, attention_mask=mask, eos_token_id=-1)
    for b, r in enumerate(rows):
        assert torch.equal(out[b, 8:], model.generate(r[None], max_new_tokens=6, eos_token_id=-1)[0, len(r):])


def _cli_generate(capsys, path, *extra):
    assert main(["generate", str(path), "--prompt", "import torch", "--max-new-tokens", "12", "--json",
                 "--device", "cpu", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("sampling", [False, True])
def test_generate_matches_the_cli_token_for_token(student, capsys, sampling):
    from dtpshard.model.checkpoint import load_tokenizer

    extra = ["--temperature", "0.9", "--top-p", "0.8", "--top-k", "50", "--seed", "3"] if sampling else []
    cli = _cli_generate(capsys, student["path"], *extra)
    model = DTPModel.from_pretrained(student["path"])
    ids = load_tokenizer(student["path"])("import torch", return_tensors="pt").input_ids
    kw = dict(do_sample=True, temperature=0.9, top_p=0.8, top_k=50, seed=3) if sampling else {}
    out = model.generate(ids, max_new_tokens=12, **kw)
    assert cli["prompt_ids"] == ids[0].tolist() and cli["devices"] == 2
    assert cli["new_token_ids"] == out[0, ids.shape[1]:].tolist()
    if sampling:  # the sampler really sampled: greedy decoding differs
        assert cli["new_token_ids"] != model.generate(ids, max_new_tokens=12)[0, ids.shape[1]:].tolist()


def test_dtype_auto_keeps_a_bf16_checkpoint(tmp_path):
    path = save_tiny(tmp_path / "m", "llama_tied")
    hf = tiny_hf_model("llama_tied").to(torch.bfloat16)
    hf.save_pretrained(str(path))  # the same checkpoint, stored in bf16 (config dtype bfloat16)
    assert DTPModel.from_pretrained(path).dtype == torch.bfloat16
    assert DTPModel.from_pretrained(path, dtype="float32").dtype == torch.float32
    assert DTPModel.from_pretrained(path, dtype=torch.float32).dtype == torch.float32
    model = DTPModel.from_pretrained(path, devices=2, delay=1, dtype="float32")
    model.save_pretrained(tmp_path / "s")  # a student saved in fp32 says so, whatever its teacher's dtype
    assert DTPModel.from_pretrained(tmp_path / "s").dtype == torch.float32


def test_tokenizer_flag_where_the_checkpoint_has_none(tiny_dirs, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_dirs["llama"] / f, bare / f)
    assert main(["generate", str(bare), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    assert "tokenizer" in capsys.readouterr().err
    out = _cli_generate(capsys, bare, "--tokenizer", str(tiny_dirs["llama"]))
    assert len(out["new_token_ids"]) == 12


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # qwen3: q/k-norms on strided views
def test_compiled_model_equals_eager_without_graph_breaks(family):
    """fullgraph=True fails on any graph break, also in a hand-written backward (dynamo traces it with
    the forward); aot_eager traces forward and backward the way the default backend does, in
    seconds (inductor's code generation is the slow test below)."""
    torch._dynamo.reset()
    model = DTPModel.from_hf(tiny_hf_model(family, num_hidden_layers=2), devices=2, delay=1)
    ids = ids_for(2, 8)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got, want = compiled(ids).logits, model(ids).logits
    assert (got - want).abs().max().item() <= TOL
    got.logsumexp(-1).mean().backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None
    compiled_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    want.logsumexp(-1).mean().backward()  # the eager graph's gradients
    for name, g in compiled_grads.items():
        torch.testing.assert_close(g, model.get_parameter(name).grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_inductor_compiled_model_and_cli_compile(student, capsys):
    """Inductor on the 2-core CPU: a forward alone compiled in 18 s (warm cache) to 66 s (cold) at load
    6-12; this whole test (forward, generate's prefill and decode shapes, eval) took 297 s at load 13-17."""
    torch._dynamo.reset()
    model = DTPModel.from_pretrained(student["path"])
    ids = ids_for(2, 9)
    with torch.no_grad():
        assert (torch.compile(model)(ids).logits - model(ids).logits).abs().max().item() <= TOL
    assert _cli_generate(capsys, student["path"], "--compile") == _cli_generate(capsys, student["path"])
    evals = []
    for extra in ([], ["--compile"]):
        assert main(["eval", str(student["path"]), "--teacher", str(student["teacher"]), "--blocks", "2",
                     "--seq-len", "16", "--device", "cpu", "--json", *extra]) == 0
        evals.append(json.loads(capsys.readouterr().out))
    assert evals[1]["kl"] == pytest.approx(evals[0]["kl"], rel=1e-4, abs=1e-6)
    assert evals[1]["ppl"] == pytest.approx(evals[0]["ppl"], rel=1e-4)


def _student_delay(model, delay, world):
    """The δ `dtpshard run` resolves for `world` ranks (its warnings logged)."""
    from dtpshard.runtime.run import plan_run

    return plan_run(model, "import torch", world, delay=delay, stage3=None, layout=None, max_new_tokens=1,
                    timeout=60, latency_ms=0, dtype="float32", device="cpu", threads=0, tokenizer=None, json=False,
                    cuda_graphs=False).settings.delay


def test_runtime_uses_a_students_delay(student, tiny_dirs, caplog):
    with caplog.at_level(logging.WARNING, logger="dtpshard"):
        assert _student_delay(student["path"], None, 2) == 1 and not caplog.records
        assert _student_delay(tiny_dirs["qwen3"], None, 4) == 1 and not caplog.records  # dense: no warning
        assert _student_delay(student["path"], 0, 2) == 0
    assert len(caplog.records) == 1 and "distilled for devices=2, delay=1" in caplog.records[0].getMessage()
