"""Issue 46, class "deleted or overwrote a user's files": a directory is dtpshard's only if
dtpshard marked it when it made it (core/owned.py), --force removes only the names the command
writes and only there, and `serve.env --dir` clears only an environment's own names, one build
at a time. Every refusal is one line naming the first file it would have touched."""
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dtpshard.cli import main
from dtpshard.core.lock import locked
from test_convert import args_for as convert_args
from test_distill import random_docs
from test_experiment import config_text
from test_faults import DISTILL, tree


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("owned")
    text = root / "docs.txt"
    text.write_text("\n\n".join(random_docs(200, 1)))
    return {"root": root, "model": tiny_dirs["llama"], "text": text}


def refused(capsys, argv, *words):
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("[convert]")]
    assert len(err) == 1 and all(w in err[0] for w in words), (words, err)


def distill_args(setup, out):
    return ["distill", str(setup["model"]), "--out", str(out), "--text", str(setup["text"]), "--devices", "2",
            *DISTILL]


def test_distill_force_never_deletes_a_users_config_json(setup, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("[section]\nkey = value\n")  # INI text, not dtpshard's
    (mine / "metrics.jsonl").write_text("my measurements\n")
    before = tree(mine)
    refused(capsys, distill_args(setup, mine) + ["--force"], f"{mine / 'config.json'}: is not a file dtpshard made",
            "nothing was removed")
    assert tree(mine) == before


def test_a_folder_of_step_names_is_not_a_sharded_checkpoint(setup, tmp_path, capsys):
    mine = tmp_path / "mine"
    (mine / "checkpoint.dcp" / "step-1").mkdir(parents=True)
    (mine / "checkpoint.dcp" / "step-1" / "thesis.tex").write_text("mine")
    before = tree(mine)
    refused(capsys, distill_args(setup, mine) + ["--force"], f"{mine / 'checkpoint.dcp'}: is not a directory "
                                                             "dtpshard made")
    assert tree(mine) == before


def test_a_copied_run_record_is_not_resumed(setup, tmp_path, capsys):
    """A distill config.json copied into another folder (no mark agrees with it) is not a run to
    resume and write into."""
    run = tmp_path / "run"
    assert main(distill_args(setup, run)) == 0
    capsys.readouterr()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_bytes((run / "config.json").read_bytes())
    (mine / "metrics.jsonl").write_text("my measurements\n")
    before = tree(mine)
    refused(capsys, distill_args(setup, mine), f"{mine / 'config.json'}: was not written by dtpshard distill")
    refused(capsys, distill_args(setup, mine) + ["--force"], "is not a file dtpshard made", "nothing was removed")
    assert tree(mine) == before
    # the run's own directory: --force starts it over, and keeps a file of the user's beside it
    (run / "notes.txt").write_text("mine")
    assert main(distill_args(setup, run) + ["--force"]) == 0
    assert (run / "notes.txt").read_text() == "mine" and (run / "DONE").is_file()


def test_convert_force_never_overwrites_a_users_layout_and_timings(setup, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "layout.json").write_text('{"my": "layout"}')
    (mine / "timings.json").write_text('{"my": "timings"}')
    before = tree(mine)
    for force in ([], ["--force"]):
        refused(capsys, convert_args(setup, mine) + force, f"{mine / 'layout.json'}: ", "dtpshard")
        assert tree(mine) == before


def test_experiment_force_never_removes_a_users_report(setup, tmp_path, capsys):
    study = tmp_path / "study.toml"
    study.write_text(config_text(setup["model"], setup["text"]))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text(json.dumps({"format": "dtpshard.experiment/1"}))  # a record, no mark
    (mine / "report.md").write_text("my report")
    before = tree(mine)
    refused(capsys, ["experiment", str(study), "--out", str(mine), "--force"],
            f"{mine / 'report.md'}: is not a file dtpshard made", "nothing was removed")
    assert tree(mine) == before


def test_teacher_cache_force_never_removes_a_forged_plan(setup, tmp_path, capsys):
    from dtpshard.training.teacher_cache import FORMAT

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "plan.json").write_text(json.dumps({"format": FORMAT}))  # passes as a cache by its format alone
    (mine / "notes.txt").write_text("mine")
    before = tree(mine)
    refused(capsys, ["teacher-cache", str(setup["model"]), "--out", str(mine), "--text", str(setup["text"]),
                     "--steps", "1", "--seq-len", "8", "--no-progress", "--force"],
            f"{mine / 'plan.json'}: is not a file dtpshard made")
    assert tree(mine) == before


# -- serve.env --dir --------------------------------------------------------------------------------
def _env(args, **kw):
    return subprocess.run([sys.executable, "-m", "dtpshard.serve.env", *args], capture_output=True, text=True,
                          timeout=120, **kw)


def test_env_never_clears_a_folder_holding_a_forged_marker(tmp_path):
    from dtpshard.serve import env as serve_env

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / serve_env.MARKER).write_text(json.dumps({"made_by": "dtpshard.serve.env", "ready": False}))
    (mine / "thesis.tex").write_text("mine")
    before = tree(mine)
    out = _env(["--dir", str(mine)])
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "thesis.tex" in out.stderr and "did not make" in out.stderr
    assert tree(mine) == before


def test_env_never_clears_its_own_names_without_its_mark(tmp_path):
    from dtpshard.serve import env as serve_env

    mine = tmp_path / "mine"
    (mine / "bin").mkdir(parents=True)
    (mine / "bin" / "my-tool").write_text("mine")
    (mine / serve_env.MARKER).write_text(json.dumps({"made_by": "dtpshard.serve.env", "ready": False}))
    before = tree(mine)
    out = _env(["--dir", str(mine)])
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "holds bin" in out.stderr, out.stderr
    assert tree(mine) == before


def test_a_second_env_build_is_refused_for_the_right_reason(tmp_path):
    env = tmp_path / "env"
    ready, release = threading.Event(), threading.Event()

    def hold():
        with locked(env, "--dir"):
            ready.set()
            release.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert ready.wait(30)
        out = _env(["--dir", str(env)])
    finally:
        release.set()
        t.join()
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "is in use by process" in out.stderr and str(env) in out.stderr
    assert not Path(env).exists() or list(Path(env).iterdir()) == []
