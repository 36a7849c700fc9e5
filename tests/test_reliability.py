"""Issue 32's rules for files and results (the launcher's are in test_reliability_launch.py, the
file readers' in test_reliability_files.py): nothing in a run directory is unpickled; a model's
numbers are checked as a model's before any work, by every command; dtpshard reads the weights
transformers reads; a result is reported only when it is a number; flags are checked before the
first byte is written; a student run with other settings gets the one warning from every command."""
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dtpshard.cli import main
from dtpshard.core.errors import UserError
from test_distill import _cli, args_for, setup  # noqa: F401 (setup: the tiny run's fixture)


def one_line(capsys, *words):
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err), err
    assert all(w in err[-1] for w in words), err
    return err[-1]


class Payload:
    """What a hostile run directory holds: unpickling it runs os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# -- nothing from a file is unpickled ---------------------------------------------------------
def test_a_resumed_run_does_not_run_the_code_its_checkpoint_names(setup, tmp_path):  # noqa: F811
    run, marker = tmp_path / "run", tmp_path / "pwned"
    first = _cli(args_for(setup, run), {"DTPSHARD_TEST_CRASH": "step:5"})
    assert first.returncode == 17 and (run / "checkpoint.pt").is_file(), first.stderr
    state = torch.load(run / "checkpoint.pt", weights_only=True)  # what dtpshard writes reads back safely
    assert state["step"] == 3 and isinstance(state["rng"]["numpy"][1], torch.Tensor)
    torch.save({**state, "evil": Payload(marker)}, run / "checkpoint.pt")
    second = _cli(args_for(setup, run))
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert "checkpoint.pt: refused checkpoint" in lines[0] and "--force" in lines[0]
    assert not marker.exists()


def test_sharded_checkpoint_metadata_and_extras_run_no_code(tmp_path):
    import torch.distributed.checkpoint as dcp

    from dtpshard.training import fsdp

    net = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.ones(1, 3)).sum().backward()
    opt.step()
    step = tmp_path / "checkpoint.dcp" / "step-00000001"
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=step)
    torch.save({"step": 1}, step / fsdp.EXTRA)
    (tmp_path / "checkpoint.dcp" / fsdp.LATEST).write_text(step.name + "\n")
    before = net.weight.detach().clone()
    with torch.no_grad():
        net.weight.zero_()
    assert fsdp.load(tmp_path, net, opt) == {"step": 1}  # the restricted readers read what torch wrote
    assert torch.equal(net.weight, before)

    marker = tmp_path / "pwned"
    good = (step / ".metadata").read_bytes()
    (step / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UserError, match="unreadable sharded checkpoint"):
        fsdp.load(tmp_path, net, opt)
    (step / ".metadata").write_bytes(good)
    torch.save({"step": 1, "evil": Payload(marker)}, step / fsdp.EXTRA)
    with pytest.raises(UserError, match="refused checkpoint"):
        fsdp.load(tmp_path, net, opt)
    assert not marker.exists()


# -- a model's numbers are checked as a model's ------------------------------------------------
BAD_NUMBERS = {
    "rms_norm_eps=nan": {"rms_norm_eps": float("nan")},
    "rms_norm_eps=inf": {"rms_norm_eps": float("inf")},
    "rms_norm_eps=-1e-06": {"rms_norm_eps": -1e-6},
    "rms_norm_eps='x'": {"rms_norm_eps": "x"},
    "rope_parameters.rope_theta=nan": {"rope_parameters": {"rope_theta": float("nan"), "rope_type": "default"}},
    "rope_parameters.rope_theta=-5.0": {"rope_parameters": {"rope_theta": -5.0, "rope_type": "default"}},
    "num_hidden_layers=0": {"num_hidden_layers": 0},
    "hidden_size=64.0": {"hidden_size": 64.0},
    "num_attention_heads=True": {"num_attention_heads": True},
    "head_dim=0": {"head_dim": 0},
    "head_dim=7": {"head_dim": 7},
    "num_key_value_heads=-4": {"num_key_value_heads": -4},
    "num_key_value_heads=3": {"num_key_value_heads": 3},
    "max_position_embeddings=0": {"max_position_embeddings": 0},
    "no intermediate_size": {"intermediate_size": ...},  # removed: transformers would fill in a default
    "beyond any model": {"hidden_size": 1 << 20, "intermediate_size": 1 << 22, "vocab_size": 1 << 22,
                         "head_dim": 1 << 17},
}


@pytest.fixture(scope="module")
def bad_models(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("numbers")
    out = {}
    for k, (name, over) in enumerate(BAD_NUMBERS.items()):
        model = root / f"m{k}"
        shutil.copytree(tiny_dirs["llama"], model)
        cfg = json.loads((model / "config.json").read_text())
        cfg = {k: v for k, v in {**cfg, **over}.items() if v is not ...}
        (model / "config.json").write_text(json.dumps(cfg))  # NaN and Infinity as Python writes them
        out[name] = model
    return out


def _commands(model: Path, out: Path) -> dict[str, list[str]]:
    return {"eval": ["eval", str(model), "--devices", "2", "--blocks", "1", "--seq-len", "8"],
            "generate": ["generate", str(model), "--devices", "2", "--prompt", "hi", "--max-new-tokens", "1"],
            "affinity": ["affinity", str(model), "--out", str(out / "a.safetensors"), "--blocks", "1",
                         "--seq-len", "8", "--no-progress"],
            "distill --plan": ["distill", str(model), "--devices", "2", "--steps", "1", "--out", str(out / "run"),
                               "--plan"],
            "convert --plan": ["convert", str(model), "--devices", "2", "--steps", "1", "--out", str(out / "cv"),
                               "--plan"],
            "layout": ["layout", str(model), "--kind", "contiguous", "--devices", "2", "--out",
                       str(out / "l.json")],
            "teacher-cache": ["teacher-cache", str(model), "--out", str(out / "cache"), "--steps", "1",
                              "--seq-len", "8", "--no-progress"],
            "permute": ["permute", str(model), str(out.parent / "layout.json"), "--out", str(out / "p")]}


@pytest.mark.parametrize("command", ["eval", "generate", "affinity", "distill --plan", "convert --plan", "layout",
                                     "teacher-cache", "permute"])
def test_a_models_numbers_are_checked_before_any_work_by_every_command(bad_models, tiny_dirs, command, tmp_path,
                                                                       capsys):
    assert main(["layout", str(tiny_dirs["llama"]), "--kind", "random", "--devices", "2", "--out",
                 str(tmp_path / "layout.json")]) == 0
    capsys.readouterr()
    for name, model in bad_models.items():
        out = tmp_path / name.replace("=", "_").replace("'", "").replace(" ", "_")
        out.mkdir()
        assert main(_commands(model, out)[command]) == 2, name
        line = one_line(capsys)
        assert f"{model}/config.json: " in line and name.split("=")[0] in line, (name, line)
        assert not any(out.iterdir()), name  # nothing written


def test_the_weights_transformers_reads_are_the_weights_dtpshard_reads(tiny_dirs, tmp_path, capsys):
    model = tmp_path / "both"
    shutil.copytree(tiny_dirs["llama"], model)
    sd = load_file(model / "model.safetensors")
    save_file(sd, model / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in sd}}))
    assert main(["eval", str(model), "--devices", "2", "--blocks", "1", "--seq-len", "8"]) == 2
    one_line(capsys, "both model.safetensors and model.safetensors.index.json")


def test_weights_beyond_the_memory_there_is_are_refused_before_reading(tiny_dirs, monkeypatch, capsys):
    import psutil

    class Tiny:
        available = 1000  # bytes: less than the tiny model's 0.3 MB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny())
    assert main(["eval", str(tiny_dirs["llama"]), "--devices", "2", "--blocks", "1", "--seq-len", "8"]) == 2
    one_line(capsys, "its weights need", "of memory, more than the")


# -- a result is reported only when it is a number ---------------------------------------------
@pytest.fixture(scope="module")
def overflowing(tiny_dirs, tmp_path_factory):
    """Finite weights whose logits overflow: the final norm's and the LM head's weights x 1e30."""
    model = tmp_path_factory.mktemp("overflow") / "m"
    shutil.copytree(tiny_dirs["llama"], model)
    sd = load_file(model / "model.safetensors")
    sd["model.norm.weight"] = sd["model.norm.weight"].abs() * 1e30
    sd["lm_head.weight"] = sd["lm_head.weight"] * 1e30
    save_file(sd, model / "model.safetensors", metadata={"format": "pt"})
    return model


def test_a_nan_metric_is_a_refusal_not_a_result(overflowing, capsys):
    assert main(["eval", str(overflowing), "--devices", "2", "--blocks", "1", "--seq-len", "8", "--json"]) == 2
    assert capsys.readouterr().out == ""
    assert main(["eval", str(overflowing), "--devices", "2", "--blocks", "1", "--seq-len", "8"]) == 2
    one_line(capsys, "ppl is nan, not a finite number", "no result reported")


def test_an_affinity_that_is_not_numbers_is_not_written(tiny_dirs, tmp_path, capsys):
    import numpy as np

    from dtpshard.affinity.file import Affinity
    from dtpshard.core.shape import UnitShape

    shape = UnitShape(1, 2, 1, 4)
    for edges, words in (({}, "no edge was scored"),
                         ({(0, 1): np.full((2, 4), np.nan)}, "edge 0->1 has NaN or infinite scores"),
                         ({(0, 1): np.zeros((2, 4))}, "every affinity score is 0")):
        with pytest.raises(UserError, match=words):
            Affinity(shape, 1.0, edges, tokens=8).save(tmp_path / "a.safetensors")
        assert not list(tmp_path.iterdir())


def test_a_finished_run_without_weights_is_not_finished(setup, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    args = args_for(setup, run, steps=2, **{"eval-every": 2, "checkpoint-every": 2})
    assert main(args) == 0
    capsys.readouterr()
    (run / "final" / "model.safetensors").unlink()
    assert main(args) == 2
    one_line(capsys, "marked finished (DONE), but its student is damaged", "--force")
    assert main(args + ["--force"]) == 0 and (run / "final" / "model.safetensors").is_file()


# -- flags are checked before the first byte ---------------------------------------------------
def test_flags_are_checked_before_anything_is_written(setup, tmp_path, monkeypatch, capsys):  # noqa: F811
    import importlib.util

    run = tmp_path / "run"
    assert main(args_for(setup, run, **{"max-shard-size": "abc"})) == 2
    one_line(capsys, "--max-shard-size 'abc': not a size")
    assert main(["convert", str(setup["model"]), "--devices", "2", "--steps", "1", "--out", str(tmp_path / "cv"),
                 "--max-shard-size", "abc"]) == 2
    one_line(capsys, "--max-shard-size 'abc': not a size")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert main(args_for(setup, run, tensorboard=tmp_path / "tb")) == 2
    one_line(capsys, "--tensorboard needs the tensorboard package")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# -- a student run with other settings: one warning, every command -----------------------------
def test_every_command_warns_alike_for_a_student_run_with_other_settings(setup, tmp_path, capsys, caplog):  # noqa: F811
    run = tmp_path / "run"
    assert main(args_for(setup, run, steps=1, **{"eval-every": 1, "checkpoint-every": 1})) == 0
    student = run / "final"
    capsys.readouterr()
    want = (f"warning: {student} is a DTP student distilled for devices=2, delay=1, stage3=sqrt; running it with "
            "devices=4, delay=1, stage3=sqrt")
    for args in (["eval", str(student), "--devices", "4", "--blocks", "1", "--seq-len", "8", "--text",
                  str(setup["text"])],
                 ["generate", str(student), "--devices", "4", "--prompt", "hi", "--max-new-tokens", "1"]):
        caplog.clear()
        assert main(args) == 0, args
        assert [r.getMessage() for r in caplog.records if want in r.getMessage()], args  # the CLI prints it to stderr
    ran = _cli(["run", str(student), "--nproc", "4", "--prompt", "hi", "--max-new-tokens", "1"])
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr.count(want) == 1, ran.stderr  # rank 0 says it, once
