"""Issue 41's rules for a directory dtpshard made and is asked to resume or clear: nothing deletes
what it did not create (--force follows no symbolic link and clears no directory without dtpshard's
marker); a resume trusts only what it checks (the teacher's weights and the layout file, recorded by
content and compared by distill and convert; a stage skipped or published only over output checked
whole); flags before work (convert refuses before stage 1 what its flags, the teacher's config.json
and headers and the evaluation text tell); the same command gives the same numbers."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from dtpshard.cli import main
from test_convert import args_for as convert_args
from test_distill import random_docs
from test_experiment import config_text
from tiny import command_line, copy_owned


def one_line(capsys, *words):
    """The command's one line (convert's progress lines aside), with every one of `words`."""
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("[convert]")]
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert all(w in err[0] for w in words), (words, err[0])
    return err[0]


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    text = root / "docs.txt"
    text.write_text("\n\n".join(random_docs(200, 1)))
    return {"root": root, "model": tiny_dirs["llama"], "text": text}


@pytest.fixture(scope="module")
def converted(setup):
    """A finished convert directory (copied by each test that changes it)."""
    out = setup["root"] / "done"
    assert main(convert_args(setup, out)) == 0
    return out


@pytest.fixture
def teacher(setup, tmp_path):
    """A copy of the teacher, whose weights a test may change."""
    return Path(shutil.copytree(setup["model"], tmp_path / "teacher"))


def _changed_weights(model: Path) -> None:
    sd = load_file(model / "model.safetensors")
    sd["model.layers.0.mlp.up_proj.weight"] *= 1.5
    save_file(sd, model / "model.safetensors", metadata={"format": "pt"})


def _run(args, crash=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"DTPSHARD_TEST_CRASH": crash} if crash else {})}
    return subprocess.run([sys.executable, "-m", "dtpshard", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=600)


# -- nothing deletes what it did not create ------------------------------------------------------------
def test_force_clears_only_what_dtpshard_made(setup, converted, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    linked = Path(copy_owned(converted, tmp_path / "linked"))
    shutil.rmtree(linked / "run")
    (linked / "run").symlink_to(mine)
    foreign = tmp_path / "foreign"
    shutil.copytree(mine, foreign / "run")  # a directory of the user's that has convert's name
    run = tmp_path / "distill-run"
    distill = command_line("distill", setup["model"], run, {"steps": 1, "seq-len": 16, "micro-batch": 1,
                                                            "grad-accum": 1, "eval-blocks": 1, "text": setup["text"],
                                                            "eval-text": setup["text"], "devices": 2})
    assert main(distill) == 0
    shutil.rmtree(run / "final")
    (run / "final").symlink_to(mine)
    exp = tmp_path / "exp"  # an experiment's directory (its record) whose runs/ is a link to the user's
    exp.mkdir()
    (exp / "config.json").write_text(json.dumps({"format": "dtpshard.experiment/1"}))
    (exp / "runs").symlink_to(mine)
    (tmp_path / "study.toml").write_text(config_text(setup["model"], setup["text"]))
    capsys.readouterr()
    for out, argv, named, what in (
            (linked, convert_args(setup, linked), linked / "run", "is a symbolic link"),
            (foreign, convert_args(setup, foreign), foreign / "run", "is not a directory dtpshard made"),
            (run, distill, run / "final", "is a symbolic link"),
            (exp, ["experiment", str(tmp_path / "study.toml"), "--out", str(exp)], exp / "runs",
             "is a symbolic link")):
        before = sorted(p.name for p in out.iterdir())
        assert main(argv + ["--force"]) == 2
        one_line(capsys, f"{named}: {what}", "nothing was removed")
        assert sorted(p.name for p in out.iterdir()) == before, out
        assert (mine / "notes.txt").read_text() == "mine"


# -- a resume trusts only what it checks -----------------------------------------------------------------
def test_a_resume_refuses_a_teacher_whose_weights_changed(setup, teacher, tmp_path):
    """distill and convert, stopped mid-distillation: the rerun compares the teacher's weights."""
    run, out = tmp_path / "run", tmp_path / "cv"
    distill = command_line("distill", teacher, run, {"steps": 4, "seq-len": 16, "micro-batch": 1, "grad-accum": 1,
                                                     "eval-every": 2, "eval-blocks": 1, "checkpoint-every": 1,
                                                     "text": setup["text"], "eval-text": setup["text"], "devices": 2})
    convert = convert_args({**setup, "model": teacher}, out)
    for argv in (distill, convert):
        assert _run(argv, "step:2").returncode == 17  # killed after step 2, a checkpoint behind it
    original = (teacher / "model.safetensors").read_bytes()
    _changed_weights(teacher)
    for argv, where in ((distill, run), (convert, out)):
        p = _run(argv)
        lines = [ln for ln in p.stderr.strip().splitlines() if not ln.startswith("[convert]")]
        assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
        assert f"the teacher's weight file {teacher / 'model.safetensors'} changed since {where}" in lines[0]
    (teacher / "model.safetensors").write_bytes(original)  # the same bytes again (a new ctime): trusted
    assert _run(distill).returncode == 0


def test_an_edited_layout_is_not_republished(setup, converted, tmp_path, capsys):
    """units swapped and J rewritten by hand in DIR/layout.json, the student removed: the rerun
    would publish the run's old layout hash beside the new J."""
    out = Path(copy_owned(converted, tmp_path / "edited"))
    layout = json.loads((out / "layout.json").read_text())
    kv = layout["layers"][0]["kv_perm"]
    kv[0], kv[-1] = kv[-1], kv[0]
    layout["score"]["J"] += 1.0
    (out / "layout.json").write_text(json.dumps(layout))
    shutil.rmtree(out / "student")
    assert main(convert_args(setup, out)) == 2
    one_line(capsys, f"{out / 'layout.json'} changed since {out}", "--force")
    assert not (out / "student").exists()


def test_a_stage_is_skipped_or_published_only_over_whole_output(setup, converted, tmp_path, capsys):
    """The issue's case: student/ and run/final's weights removed, then rerun; and a student whose
    weights went missing."""
    out = Path(copy_owned(converted, tmp_path / "halved"))
    shutil.rmtree(out / "student")
    (out / "run" / "final" / "model.safetensors").unlink()
    assert main(convert_args(setup, out)) == 2
    one_line(capsys, f"{out / 'run'}: marked finished (DONE), but its student is damaged", "--force")
    assert not (out / "student").exists()
    out = Path(copy_owned(converted, tmp_path / "student-only"))
    (out / "student" / "model.safetensors").unlink()
    assert main(convert_args(setup, out)) == 2
    one_line(capsys, f"{out / 'student'}: is damaged", "--force")


# -- flags before work -------------------------------------------------------------------------------------
def test_convert_refuses_before_stage_1_what_it_can_know(setup, tmp_path, monkeypatch, capsys):
    import importlib.machinery
    import importlib.util

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cases = {"teacher cache": ({"teacher-cache": tmp_path / "no-cache"}, "no-cache: no cache there"),
             "eval text": ({"eval-text": empty}, str(empty)),
             "seq len": ({"seq-len": 512}, "--seq-len 512: beyond the model's context of 256 positions")}
    for name, (over, words) in cases.items():
        out = tmp_path / name.replace(" ", "-")
        assert main(convert_args(setup, out, **over)) == 2, name
        one_line(capsys, words)
        assert not out.exists(), name  # no stage ran, nothing was written
    real = importlib.util.find_spec  # a directory named tensorboard where Python looks: a namespace package
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: importlib.machinery.ModuleSpec(name, None)
                        if name == "tensorboard" else real(name, *a))
    out = tmp_path / "tb"
    assert main(convert_args(setup, out, tensorboard=tmp_path / "events")) == 2
    one_line(capsys, "--tensorboard needs the tensorboard package")
    assert not out.exists()
    assert main(command_line("distill", setup["model"], tmp_path / "run", {"seq-len": 512, "devices": 2})) == 2
    one_line(capsys, "--seq-len 512: beyond the model's context")
    assert not (tmp_path / "run").exists()


# -- the same command gives the same numbers ---------------------------------------------------------------
def test_the_same_run_gives_the_same_numbers(setup, tmp_path):
    """Two processes, two hash seeds, one command: the same metrics to the last bit, and the thread
    count they were computed with (the one thing that changes a sum's rounding) recorded."""
    runs = []
    for seed in ("1", "2"):
        run = tmp_path / f"run{seed}"
        argv = command_line("distill", setup["model"], run, {"steps": 4, "seq-len": 32, "micro-batch": 2,
                                                             "grad-accum": 2, "eval-every": 2, "eval-blocks": 2,
                                                             "text": setup["text"], "eval-text": setup["text"],
                                                             "devices": 2})
        env = {**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "2"}
        p = subprocess.run([sys.executable, "-m", "dtpshard", *argv], env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(run)
    rows = [[{k: v for k, v in json.loads(ln).items() if k != "wall"} for ln in (r / "metrics.jsonl").open()]
            for r in runs]
    assert rows[0] == rows[1]
    assert [json.loads((r / "config.json").read_text())["threads"] for r in runs] == [2, 2]
