"""Shared neurons in the model (docs/design.md §6): the simulator against an independent literal
transcription (tests/reference.py) at δ ∈ {0, 1, 1.5}, δ = 0 the dense model, a permuted
checkpoint that stays the dense function with the shared neurons last and loads as the shared
model with no other argument, and a student that records its count."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dtpshard.cli import main
from dtpshard.core.errors import UserError
from dtpshard.core.layout import Layout
from dtpshard.core.shape import shape_from_hf_config
from dtpshard.model.checkpoint import open_checkpoint
from dtpshard.model.dtp import DTPModel
from reference import literal_dtp_logits, units_of_layout_file
from tiny import save_tiny, tiny_hf_model

TOL = 1e-4  # fp32 logits, relative to their largest magnitude
FAMILIES = ("llama", "qwen3", "phi3", "granite")


def ids_for(vocab=384, B=2, T=10, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def shared_layout(shape, devices, count, seed=0) -> Layout:
    rng = np.random.default_rng(seed)
    sets = [np.sort(rng.choice(shape.neurons, count, replace=False)) for _ in range(shape.layers)]
    return Layout.random(shape, devices, 1, seed=seed, shared=sets, shared_by="random")


def rel(a, b) -> float:
    return (a - b).abs().max().item() / b.abs().max().item()


@pytest.fixture(scope="module", params=FAMILIES)
def hf(request):
    return tiny_hf_model(request.param, seed=5, intermediate_size=98)  # 98: only N - n divides by L


@torch.no_grad()
@pytest.mark.parametrize("delay", [0, 1, 1.5])
def test_simulator_equals_the_literal_transcription(hf, delay):
    shape = shape_from_hf_config(hf.config)
    lay = shared_layout(shape, 2 if shape.family == "phi3" else 4, 6, seed=3)  # 98 - 6 = 92 = 4 x 23
    ids = ids_for(shape.vocab)
    model = DTPModel.from_hf(hf, devices=lay.devices, delay=delay, layout=lay)
    assert model.shape.shared == 6
    got = model(ids).logits
    want = literal_dtp_logits(hf, ids, lay.devices, delay, units=units_of_layout_file(lay.to_json(), lay.devices))
    assert rel(got, want) <= TOL
    dense = hf(ids).logits
    if delay == 0:
        assert rel(got, dense) <= TOL
    else:
        assert rel(got, dense) > 1e-2  # δ >= 1 is another function


def test_permuted_checkpoint_is_dense_with_shared_last_and_loads_shared(tmp_path, capsys):
    src = save_tiny(tmp_path / "m", "llama", seed=2, intermediate_size=98)
    shape = open_checkpoint(src).shape
    lay = shared_layout(shape, 4, 6, seed=1)
    lay.save(tmp_path / "l.json")
    out = tmp_path / "p"
    assert main(["permute", str(src), str(tmp_path / "l.json"), "--out", str(out), "--check", "logits"]) == 0
    capsys.readouterr()
    before, after = open_checkpoint(src).state_dict(), open_checkpoint(out).state_dict()
    for i in range(shape.layers):  # the shared neurons are the last 6 rows of gate/up, columns of down
        shared = torch.as_tensor(lay.shared_neurons(i))
        for name in ("gate_proj", "up_proj"):
            w = f"model.layers.{i}.mlp.{name}.weight"
            assert torch.equal(after[w][-6:], before[w][shared])
        w = f"model.layers.{i}.mlp.down_proj.weight"
        assert torch.equal(after[w][:, -6:], before[w][:, shared])
    ids = ids_for()
    with torch.no_grad():
        dense_src = DTPModel.from_pretrained(src, 1, 0)(ids).logits
        dense_out = DTPModel.from_pretrained(out, 1, 0)(ids).logits
        assert rel(dense_out, dense_src) <= 1e-5
        # no other argument: the permuted directory's layout.json says 6 are shared
        model = DTPModel.from_pretrained(out, devices=4, delay=1)
        assert model.shape.shared == 6
        want = DTPModel.from_pretrained(src, devices=4, delay=1, layout=tmp_path / "l.json")(ids).logits
        assert rel(model(ids).logits, want) <= TOL
    # a permuted shared checkpoint is not permuted again, nor given a layout
    assert main(["permute", str(out), str(tmp_path / "l.json"), "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds 6 shared neurons" in err and len(err.splitlines()) == 1 and not (tmp_path / "q").exists()
    with pytest.raises(UserError, match="already holds 6 shared neurons"):
        DTPModel.from_pretrained(out, devices=4, delay=1, layout=tmp_path / "l.json")


def test_student_records_its_count_and_round_trips(tmp_path):
    src = save_tiny(tmp_path / "m", "qwen3", seed=4, intermediate_size=98)
    shape = open_checkpoint(src).shape
    lay = shared_layout(shape, 4, 6, seed=2)
    model = DTPModel.from_pretrained(src, devices=4, delay=1, layout=lay)
    student = tmp_path / "s"
    model.save_pretrained(student, source=src)
    block = json.loads((student / "config.json").read_text())["dtp"]
    assert block["shared"] == 6 and block["devices"] == 4
    ids = ids_for()
    with torch.no_grad():
        back = DTPModel.from_pretrained(student)
        assert back.shape.shared == 6 and (back.devices, back.delay) == (4, 1)
        assert rel(back(ids).logits, model(ids).logits) <= 1e-6
        # run dense, the student's weights are still the dense model's
        dense = DTPModel.from_pretrained(src, 1, 0)(ids).logits
        assert rel(DTPModel.from_pretrained(student, 1, 0)(ids).logits, dense) <= 1e-5


@pytest.mark.parametrize("recorded, said", [(98, "must be an integer from 0"), (5, "does not divide the 93 sharded"),
                                            (-1, "must be an integer from 0"), ("6", "must be an integer from 0")])
def test_student_whose_count_disagrees_with_its_weights(tmp_path, capsys, recorded, said):
    src = save_tiny(tmp_path / "m", "llama", seed=4, intermediate_size=98)
    model = DTPModel.from_pretrained(src, devices=4, delay=1, layout=shared_layout(open_checkpoint(src).shape, 4, 6))
    student = tmp_path / "s"
    model.save_pretrained(student, source=src)
    cfg = json.loads((student / "config.json").read_text())
    cfg["dtp"]["shared"] = recorded
    (student / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", str(student), "--prompt", "import torch", "--max-new-tokens", "2", "--device",
                 "cpu"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert said in err and len(err.splitlines()) == 1 and captured.out == ""


def test_shared_layout_of_another_shape_is_refused(tmp_path, capsys):
    src = save_tiny(tmp_path / "m", "llama", seed=4, intermediate_size=98)
    other = save_tiny(tmp_path / "o", "llama", seed=4, intermediate_size=102)
    shared_layout(open_checkpoint(other).shape, 4, 6).save(tmp_path / "l.json")  # 102 - 6 = 96
    assert main(["permute", str(src), str(tmp_path / "l.json"), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert "neurons=102" in err and len(err.splitlines()) == 1 and not (tmp_path / "p").exists()
    with pytest.raises(UserError, match="neurons=102"):
        DTPModel.from_pretrained(src, devices=4, delay=1, layout=tmp_path / "l.json")
