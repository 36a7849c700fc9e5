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
    assert "is a checkpoint dtpshard permute wrote" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "q").exists()
    with torch.no_grad():  # its own layout again is the one in its weights: never applied twice
        again = DTPModel.from_pretrained(out, devices=4, delay=1, layout=tmp_path / "l.json")(ids).logits
    assert rel(again, want) <= TOL
    shared_layout(shape, 4, 6, seed=5).save(tmp_path / "other.json")
    with pytest.raises(UserError, match="in another layout.s order already"):
        DTPModel.from_pretrained(out, devices=4, delay=1, layout=tmp_path / "other.json")


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


def _runtime_worker(model_dir, layout_path, permuted_dir, out_dir):
    """One rank: the logits of the shared model from the checkpoint and the layout, and from the
    permuted checkpoint alone, at each δ, with a cached decode."""
    from dtpshard.core.launch import process_group, set_threads
    from dtpshard.core.settings import resolve_dtp
    from dtpshard.runtime.ranks import RankModel, check_world

    set_threads()
    ids = ids_for()
    with process_group(timeout=120) as (rank, world):
        res = {}
        for name, (path, layout) in {"layout": (model_dir, layout_path), "permuted": (permuted_dir, None)}.items():
            ckpt, lay = check_world(path, world, layout)
            net = RankModel(ckpt, rank, resolve_dtp(ckpt.shape, devices=world, delay=0), lay, timeout=120)
            res[name, "shared"] = net.shape.shared
            for delay in (0, 1, 1.5):
                net.set_delay(delay)
                res[name, delay] = net(ids)
            cache = net.new_cache()
            res[name, "cached"] = torch.cat([net(ids[:, :6], cache)] + [net(ids[:, t:t + 1], cache)
                                                                         for t in range(6, ids.shape[1])], 1)
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    return 0


def test_runtime_equals_the_simulator_at_two_ranks(tmp_path, capsys):
    from dtpshard.core.launch import launch_local

    src = save_tiny(tmp_path / "m", "qwen2", seed=6, intermediate_size=98)
    lay = shared_layout(open_checkpoint(src).shape, 2, 10, seed=4)  # 98 - 10 = 88 = 2 x 44
    lay.save(tmp_path / "l.json")
    assert main(["permute", str(src), str(tmp_path / "l.json"), "--out", str(tmp_path / "p")]) == 0
    capsys.readouterr()
    codes = launch_local(2, _runtime_worker, (str(src), str(tmp_path / "l.json"), str(tmp_path / "p"), str(tmp_path)),
                         grace=30, deadline=240)
    assert [e.code for e in codes] == [0, 0], [e.traceback or e.said for e in codes]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ids = ids_for()
    ref = DTPModel.from_pretrained(src, devices=2, delay=0, layout=tmp_path / "l.json")
    with torch.no_grad():
        for delay in (0, 1, 1.5):
            ref.set_dtp(2, delay)
            want = ref(ids).logits
            for r in range(2):
                for name in ("layout", "permuted"):
                    assert ranks[r][name, "shared"] == 10
                    assert rel(ranks[r][name, delay], want) <= TOL, (name, delay, r)
        for r in range(2):
            assert rel(ranks[r]["permuted", "cached"], want) <= TOL  # the last δ set: 1.5


# -- training: adapters, FSDP and the memory plan on a shared layout ------------------------------
@pytest.fixture(scope="module")
def train_setup(tmp_path_factory):
    from test_distill import random_docs

    root = tmp_path_factory.mktemp("shared-train")
    (root / "docs.txt").write_text("\n\n".join(random_docs(300, 3)))
    model = save_tiny(root / "m", "qwen3", seed=7, intermediate_size=98)
    shared_layout(open_checkpoint(model).shape, 2, 10, seed=5).save(root / "shared.json")  # 88 = 2 x 44
    Layout.random(open_checkpoint(model).shape, 2, 1, seed=5).save(root / "plain.json")
    return {"root": root, "model": model, "text": root / "docs.txt", "layout": root / "shared.json"}


def test_adapters_on_a_shared_layout_equal_the_merged_weights(train_setup):
    from dtpshard.model import adapters
    from test_adapters import with_random_adapters

    model = with_random_adapters(DTPModel.from_pretrained(train_setup["model"], layout=train_setup["layout"]), seed=3)
    assert model.shape.shared == 10
    params = dict(model.named_parameters())
    whole = {n: f() for n, f in adapters.merged(params, lambda t: t.detach(), model.adapters.scale).items()}
    plain = DTPModel.from_state_dict(model.hf_config, whole, settings=model.settings, shared=10)
    ids = ids_for()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("extra", [["--adapters", "4"], []], ids=["adapters", "full"])
def test_fsdp_run_equals_one_process_and_saves_a_shared_student(train_setup, extra):
    from test_distill import args_for
    from test_distill_ddp import assert_same_curves, ddp_args

    one, two = (train_setup["root"] / f"{n}{len(extra)}" for n in ("one", "two"))
    steps = {"steps": 2, "eval-every": 2, "checkpoint-every": 2}
    assert main(args_for(train_setup, one, **steps) + extra) == 0  # 2 x 2: the batch of 2 x (1 x 2)
    assert main(ddp_args(train_setup, two, **steps) + ["--nproc", "2", "--fsdp", *extra]) == 0
    assert_same_curves(one, two)
    for run in (one, two):
        student = DTPModel.from_pretrained(run / "final")
        assert student.shape.shared == 10 and (student.devices, student.delay) == (2, 1)
    a, b = (DTPModel.from_pretrained(r / "final").state_dict() for r in (one, two))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6)


def test_the_memory_plan_counts_the_replicated_slice(train_setup, capsys):
    from test_distill import args_for

    plans = {}
    for name in ("shared", "plain"):
        s = {**train_setup, "layout": train_setup["root"] / f"{name}.json"}
        assert main(args_for(s, train_setup["root"] / f"plan-{name}") + ["--plan", "--json"]) == 0
        plans[name] = json.loads(capsys.readouterr().out)
    # every device computes the 10 shared neurons' activations: more saved than with none replicated
    assert plans["shared"]["parts"]["activations"] > plans["plain"]["parts"]["activations"]
    assert not (train_setup["root"] / "plan-shared").exists()


def test_remote_code_equals_dtpshard_on_a_shared_student(tmp_path):
    from transformers import AutoModelForCausalLM

    src = save_tiny(tmp_path / "m", "granite", seed=8, intermediate_size=98)
    lay = shared_layout(open_checkpoint(src).shape, 4, 6, seed=6)
    student = tmp_path / "s"
    DTPModel.from_pretrained(src, devices=4, delay=1.5, layout=lay).save_pretrained(student, source=src)
    ref = DTPModel.from_pretrained(student)
    hf = AutoModelForCausalLM.from_pretrained(str(student), trust_remote_code=True, dtype=torch.float32).eval()
    assert type(hf).__name__ == "DTPForCausalLM"
    ids = ids_for()
    with torch.no_grad():
        want = ref(ids).logits
        assert rel(hf(ids).logits, want) <= 1e-6
        literal = literal_dtp_logits(tiny_hf_model("granite", seed=8, intermediate_size=98), ids, 4, 1.5,
                                     units=units_of_layout_file(lay.to_json(), 4))
        assert rel(want, literal) <= TOL
