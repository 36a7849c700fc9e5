"""`dtpshard convert` on a tiny model: end to end, a SIGKILL in each stage resumed to the same
student, a changed setting refused, --plan without reading a weight."""
import importlib
import importlib.util
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import load_file

from dtpshard.cli import main
from dtpshard.training import convert as convert_mod
from test_distill import random_docs
from tiny import command_line, copy_owned

HOOKS = Path(__file__).parent / "hooks" / "sitecustomize.py"
STAGE_FILES = ("convert.json", "affinity.safetensors", "layout.json", "run", "student", "timings.json")


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    text = root / "docs.txt"
    text.write_text("\n\n".join(random_docs(200, 1)))
    return {"root": root, "model": tiny_dirs["llama"], "text": text}


def args_for(s, out, **over):
    opts = {"devices": 2, "steps": 4, "seq-len": 16, "micro-batch": 2, "grad-accum": 1, "lr": 1e-3, "warmup": 1,
            "eval-every": 2, "eval-blocks": 2, "blocks": 2, "checkpoint-every": 1, "text": s["text"],
            "eval-text": s["text"]}
    return command_line("convert", s["model"], out, opts, **over)


@pytest.fixture(scope="module")
def straight(setup):
    """One uninterrupted conversion (in process, through the CLI), and what it printed."""
    out = setup["root"] / "straight"
    assert main(args_for(setup, out) + ["--json"]) == 0
    return out


def _killed(args, point):
    """Run the command in a fork of this process (its modules already imported) with the test hook
    of `point` applied (hooks/sitecustomize.py): it must die there by SIGKILL."""
    pid = os.fork()
    if pid == 0:
        try:
            os.environ["DTPSHARD_TEST_CRASH"] = point
            spec = importlib.util.spec_from_file_location("_hooks", HOOKS)
            hooks = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(hooks)
            for name, patch in hooks.PATCHES.items():
                patch(importlib.import_module(name))
            main(args)
        finally:
            os._exit(99)  # it was not killed
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _weights(out):
    return load_file(str(out / "student" / "model.safetensors"))


def test_end_to_end(setup, straight, capsys):
    assert sorted(p.name for p in straight.iterdir()) == sorted((*STAGE_FILES, "dtpshard-dir.json"))
    assert main(args_for(setup, straight) + ["--json"]) == 0  # done: nothing is redone
    captured = capsys.readouterr()
    assert captured.err.count("done before") == 4
    summary = json.loads(captured.out)
    assert summary["student"] == str(straight / "student") and summary["devices"] == 2
    j = summary["J"]
    assert j["optimised"] >= j["contiguous"] and j["optimised"] >= j["random"]
    assert summary["kl"]["step_0"] > 0 and summary["kl"]["final_step"] == 4
    assert set(summary["seconds"]) == {"calibration", "layout", "distillation", "student"}
    assert "--tensor-parallel-size 2" in summary["serve"]["vllm"]
    from dtpshard.model.dtp import DTPModel

    student = DTPModel.from_pretrained(straight / "student")
    assert (student.devices, student.delay) == (2, 1)
    final = straight / "run" / "final" / "model.safetensors"
    assert os.path.samefile(final, straight / "student" / "model.safetensors")  # linked, not copied
    card = (straight / "student" / "README.md").read_text()
    assert "dtpshard convert" in card and "--tensor-parallel-size 2" in card
    assert main(args_for(setup, straight)) == 0  # text: the serving commands on one screen
    text = capsys.readouterr().out
    assert "trust_remote_code=True" in text and "dtpshard run" in text and len(text.splitlines()) < 24


def test_a_sigkill_in_each_stage_resumes_to_the_same_student(setup, straight, tmp_path, capfd):
    out = tmp_path / "killed"
    args = args_for(setup, out)
    expect = {  # where each kill leaves DIR
        "affinity": lambda: not (out / "affinity.safetensors").exists()
        and any(p.name.startswith(".affinity.safetensors.tmp-") for p in out.iterdir()),
        "layout": lambda: (out / "affinity.safetensors").is_file() and not (out / "layout.json").exists(),
        "checkpointed:2": lambda: torch.load(out / "run" / "checkpoint.pt", weights_only=False)["step"] == 2
        and not (out / "run" / "DONE").exists(),
        "final": lambda: (out / "run" / "final").is_dir() and not (out / "run" / "DONE").exists(),
        "student": lambda: not (out / "student").exists()
        and any(p.name.startswith(".student.tmp-") for p in out.iterdir()),
    }
    for point, left in expect.items():
        assert _killed(args, point), point
        assert left(), (point, sorted(p.name for p in out.iterdir()))
        if point == "final":  # the resume of the distillation went on from step 2's checkpoint
            assert "after step 2 of 4" in capfd.readouterr().err
    assert main(args) == 0  # the last resume in this process
    mine, theirs = _weights(out), _weights(straight)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("point", ["calibration", "summary"])
def test_sigterm_ends_it_in_one_line(setup, tmp_path, point):
    """The signal comes while convert waits for it at `point` (hooks: DTPSHARD_TEST_PAUSE), not after
    a guessed delay: on a loaded machine the fork used to be signalled once every stage was done,
    after convert's handler was gone (SystemExit out of main: exit 99 here)."""
    out = tmp_path / "stopped"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a fork of this process, its stderr the pipe
        try:
            os.dup2(write, 2)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            os.environ["DTPSHARD_TEST_PAUSE"] = point
            spec = importlib.util.spec_from_file_location("_hooks", HOOKS)
            hooks = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(hooks)
            for name in ("dtpshard.affinity.calibrate", "dtpshard.training.convert"):
                hooks.PATCHES[name](importlib.import_module(name))
            os._exit(main(args_for(setup, out)))
        finally:
            os._exit(99)
    os.close(write)
    with os.fdopen(read) as err:
        for line in err:  # stage 1 has started and waits
            if line.strip() == "paused":
                os.kill(pid, signal.SIGTERM)
                break
        rest = err.read().strip().splitlines()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 130, (status, rest)
    assert rest[-1:] == ["dtpshard convert: interrupted"], rest
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_a_changed_setting_is_refused_naming_it(setup, straight, tmp_path, capsys):
    out = tmp_path / "other"
    copy_owned(straight, out)
    assert main(args_for(setup, out, devices=4)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "devices 2 (now 4)" in err[0] and "--force" in err[0], err
    assert main(args_for(setup, out, steps=5)) == 2
    assert "steps 4 (now 5)" in capsys.readouterr().err
    assert json.loads((out / "convert.json").read_text())["layout"]["devices"] == 2  # untouched


def test_settings_of_a_stage_not_begun_may_change(setup, straight, tmp_path, capsys):
    """Only the calibration done: a rerun with other training settings goes on with them."""
    out = tmp_path / "partial"
    out.mkdir()
    for name in ("convert.json", "affinity.safetensors"):
        shutil.copy2(straight / name, out / name)
    assert main(args_for(setup, out, devices=4, blocks=3)) == 2  # the calibration's own setting
    assert "blocks 2 (now 3)" in capsys.readouterr().err
    record = json.loads((straight / "convert.json").read_text())
    from dtpshard.training.convert import Paths, check_record

    changed = json.loads(json.dumps(record))
    changed["distillation"]["steps"] = 9
    changed["layout"]["devices"] = 4
    check_record(Paths(out), changed)  # stage 2 and 3 have not begun: accepted


def test_other_directories_are_not_taken(setup, straight, tmp_path, capsys):
    for other, what in ((setup["model"], "is the teacher directory"),
                        (straight / "run", "is a dtpshard distill directory, not a dtpshard convert directory")):
        assert main(args_for(setup, other) + ["--force"]) == 2  # --force replaces only convert's own
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and what in err[0], err
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    assert main(args_for(setup, junk)) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(args_for(setup, tmp_path / "x", layout=straight / "layout.json")) == 2
    assert "--layout" in capsys.readouterr().err


def test_plan_reads_no_weight(setup, tmp_path, monkeypatch, capsys):
    def forbidden(*a, **k):
        raise AssertionError("a safetensors file was opened")

    monkeypatch.setattr(safetensors, "safe_open", forbidden)  # the one reader opens weights with it
    out = tmp_path / "planned"
    assert main(args_for(setup, out) + ["--plan"]) == 0
    text = capsys.readouterr().out
    for stage in convert_mod.STAGES:
        assert stage in text
    assert "memory per process" in text and ", about " in text
    assert main(args_for(setup, out) + ["--plan", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [p["stage"] for p in plans] == list(convert_mod.STAGES) and all(p["fits"] for p in plans)
    for extra in (["--plan"], []):  # a run that cannot fit is refused before any weight is read
        assert main(args_for(setup, out, **{"plan-memory": "1MB"}) + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "stage distillation" in err[0] and "--plan" in err[0], err
    assert not out.exists()


def test_partial_student_from_one_command(setup, tmp_path, capsys):
    """convert --delayed SHARE: the modules chosen by sensitivity under the optimised layout, the
    layout refined for them, the student recording the set; --plan says the share of syncs removed;
    a rerun with another set is refused naming it; a bad share is refused before stage 1."""
    out = tmp_path / "partial"
    assert main(args_for(setup, out, delayed="0.5") + ["--plan"]) == 0
    assert "syncs removed: 3 of 6 modules delayed, 50% of the all-reduces (chosen by sensitivity)" in \
        capsys.readouterr().out
    assert main(args_for(setup, out, delayed="0.5") + ["--plan", "--json"]) == 0
    layout_row = [p for p in json.loads(capsys.readouterr().out) if p["stage"] == "layout"][0]
    assert layout_row["syncs_removed"] == 0.5 and layout_row["delayed"] == 3
    assert main(args_for(setup, out, delayed="0.5") + ["--json"]) == 0
    capsys.readouterr()
    layout = json.loads((out / "layout.json").read_text())
    sens = layout["score"]["delayed"]["sensitivity"]["kl"]
    assert layout["delayed"] == sorted(sorted(range(6), key=lambda m: (sens[m], m))[:3])
    assert layout["score"]["contiguous_J"] <= layout["score"]["J"]
    block = json.loads((out / "student" / "config.json").read_text())["dtp"]
    assert block["delayed"] == layout["delayed"]
    for bad, why in ((dict(delayed="0.25"), "delayed"), (dict(delayed="1.5"), "(0, 1]"), (dict(delayed="7"), "7"),
                     ({"delayed": "1-3", "delayed-by": "upper"}, "--delayed-by upper: it chooses a share's")):
        assert main(args_for(setup, tmp_path / "other" if why != "delayed" else out, **bad)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err
