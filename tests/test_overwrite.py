"""No command writes over what it reads: an --out that is an input (the model, its weights, the
teacher, the affinity file) is refused in one line before any work, and the input is untouched."""
import shutil

import pytest

from dtpshard.cli import main
from test_experiment import config_text, corpus


def snapshot(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def model(tmp_path, tiny_dirs):
    dst = tmp_path / "model"
    shutil.copytree(tiny_dirs["llama"], dst)
    return dst


def refused(capsys, args, needle):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_affinity_never_writes_over_the_model(model, capsys):
    before = snapshot(model)
    for out in (model / "model.safetensors", model / "config.json", model):
        refused(capsys, ["affinity", str(model), "--out", str(out), "--blocks", "1", "--seq-len", "8",
                         "--no-progress"], "an input of this command")
    assert snapshot(model) == before


def test_affinity_out_directory_refused_before_the_pass(model, tmp_path, capsys):
    (tmp_path / "d").mkdir()  # tmp_path itself holds the model: refused as containing an input
    refused(capsys, ["affinity", str(model), "--out", str(tmp_path / "d"), "--blocks", "1", "--seq-len", "8",
                     "--no-progress"], "is a directory; give the path of the file to write")


def test_layout_never_writes_over_its_source(model, tmp_path, capsys):
    aff = tmp_path / "a.safetensors"
    assert main(["affinity", str(model), "--out", str(aff), "--blocks", "1", "--seq-len", "8", "--no-progress"]) == 0
    capsys.readouterr()
    before = aff.read_bytes()
    refused(capsys, ["layout", str(aff), "--devices", "2", "--out", str(aff)], "is the source")
    assert aff.read_bytes() == before


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_distill_never_uses_the_teacher_as_its_run(model, capsys, force):
    before = snapshot(model)
    refused(capsys, ["distill", str(model), "--out", str(model), "--steps", "1", "--devices", "2", *force],
            "is the teacher directory")
    assert snapshot(model) == before


def test_experiment_never_uses_the_model_as_its_directory(model, tmp_path, capsys):
    study = tmp_path / "study.toml"
    study.write_text(config_text(model, corpus(tmp_path / "c.txt")))
    before = snapshot(model)
    refused(capsys, ["experiment", str(study), "--out", str(model), "--force"], "is the model directory")
    assert snapshot(model) == before


@pytest.mark.parametrize("command", ["distill", "experiment"])
def test_force_never_starts_over_a_directory_that_is_not_a_run(model, tmp_path, capsys, command):
    other = tmp_path / "other_model"
    shutil.copytree(model, other)  # not the teacher, but a model directory all the same
    before = snapshot(other)
    if command == "distill":
        args = ["distill", str(model), "--out", str(other), "--steps", "1", "--devices", "2", "--force"]
    else:
        study = tmp_path / "study.toml"
        study.write_text(config_text(model, corpus(tmp_path / "c.txt")))
        args = ["experiment", str(study), "--out", str(other), "--force"]
    refused(capsys, args, "is not a dtpshard run's")
    assert snapshot(other) == before


def test_distill_never_writes_beside_unrelated_files(model, tmp_path, capsys, monkeypatch):
    busy = tmp_path / "busy"
    (busy / "data").mkdir(parents=True)
    (busy / "notes.txt").write_text("mine")
    before = snapshot(busy)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    args = ["distill", str(model), "--out", str(busy), "--text", str(text), "--steps", "1", "--devices", "2",
            "--seq-len", "8", "--micro-batch", "1", "--grad-accum", "1", "--eval-blocks", "1", "--device", "cpu",
            "--no-progress"]
    from dtpshard.training.strategy import Replicated, Sharded

    def no_model(*a, **k):
        raise AssertionError("a model was read before the refusal")

    with monkeypatch.context() as m:
        m.setattr(Replicated, "build", no_model)
        m.setattr(Sharded, "build", no_model)
        refused(capsys, args, f"--out {busy}: not empty and not a dtpshard run (holds data and 1 more)")
    assert snapshot(busy) == before and sorted(p.name for p in busy.iterdir()) == ["data", "notes.txt"]
    assert main(args + ["--force"]) == 0  # the user's explicit choice: the run goes beside them
    assert (busy / "DONE").is_file() and (busy / "notes.txt").read_text() == "mine"


def test_distill_and_experiment_never_take_each_others_directory(model, tmp_path, capsys):
    study = tmp_path / "study.toml"
    study.write_text(config_text(model, corpus(tmp_path / "c.txt")))
    exp, run = tmp_path / "exp", tmp_path / "run"
    for d, fmt in ((exp, "dtpshard.experiment/1"), (run, "dtpshard.distill/1")):
        d.mkdir()
        (d / "config.json").write_text(f'{{"format": "{fmt}"}}')
    before = snapshot(tmp_path)
    for force in ([], ["--force"]):
        refused(capsys, ["distill", str(model), "--out", str(exp), "--steps", "1", "--devices", "2", *force],
                f"--out {exp}: is a dtpshard experiment directory, not a distillation run")
        refused(capsys, ["experiment", str(study), "--out", str(run), *force],
                f"--out {run}: is a dtpshard distill directory, not an experiment directory")
    assert snapshot(tmp_path) == before


def test_experiment_never_writes_beside_unrelated_files(model, tmp_path, capsys, monkeypatch):
    import dtpshard.studies.experiment as experiment

    study = tmp_path / "study.toml"
    study.write_text(config_text(model, corpus(tmp_path / "c.txt")))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / ".git").mkdir()  # hidden names count too: only the lock and our temporaries do not
    before = snapshot(busy)
    with monkeypatch.context() as m:
        m.setattr(experiment, "resolve_model", lambda *a: pytest.fail("the model was read before the refusal"))
        refused(capsys, ["experiment", str(study), "--out", str(busy)],
                f"--out {busy}: not empty and not an experiment directory (holds .git)")
    assert snapshot(busy) == before


def test_a_killed_start_leaves_nothing_that_blocks_the_rerun(tmp_path):
    """A kill before config.json was in place leaves at most the lock and a temporary: both the
    directory's own. A hidden name that only looks like ours (no .tmp-) is someone else's."""
    from dtpshard.core.errors import UserError
    from dtpshard.training.rundir import refuse_unrelated

    d = tmp_path / "exp"
    d.mkdir()
    (d / ".lock").write_text("dtpshard-lock 4000001\n")  # a dead process's lock
    from dtpshard.core.temporary import temporary_name

    (d / temporary_name("config.json", pid=4242)).write_text("{")
    refuse_unrelated(d, False, ("config.json",), "an experiment directory")
    (d / ".config.json").write_text("")
    with pytest.raises(UserError, match=r"holds \.config\.json\)"):
        refuse_unrelated(d, False, ("config.json",), "an experiment directory")
