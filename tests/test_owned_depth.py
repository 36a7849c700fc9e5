"""Issue 54, data loss: a command removes only what it wrote, at every depth (a sealed directory's
mark lists its files); a mark is bound to the directory it marks, so a copy proves nothing; no
name a command writes, locks or appends to is reached through a symbolic link; a directory
another command marked is never taken. Every refusal is one line, and nothing is touched."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from dtpshard.cli import main
from dtpshard.core.owned import MARK, read_mark
from test_convert import args_for as convert_args
from test_distill import random_docs
from test_experiment import config_text
from test_faults import DISTILL, tree


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("depth")
    text = root / "docs.txt"
    text.write_text("\n\n".join(random_docs(200, 1)))
    return {"root": root, "model": tiny_dirs["llama"], "text": text}


def refused(capsys, argv, *words):
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("[")]
    assert len(err) == 1 and all(w in err[0] for w in words), (words, err)
    return err[0]


def distill_args(setup, out):
    return ["distill", str(setup["model"]), "--out", str(out), "--text", str(setup["text"]), "--devices", "2",
            *DISTILL]


@pytest.fixture(scope="module")
def run(setup):
    out = setup["root"] / "run"
    assert main(distill_args(setup, out)) == 0
    return out


@pytest.fixture
def fresh_run(setup, tmp_path, capsys):
    """A finished run of its own (a copy would carry no bound mark)."""
    out = tmp_path / "run"
    assert main(distill_args(setup, out)) == 0
    capsys.readouterr()
    return out


# -- 1: --force at every depth -------------------------------------------------------------------
@pytest.mark.parametrize(("where", "named"), [("final/NOTES.md", "final/NOTES.md"), ("final/sub/NOTES.md", "final/sub"),
                                              ("adapters/mine.txt", "adapters")])  # no adapters here: unsealed
def test_distill_force_keeps_a_users_file_inside_a_folder_it_owns(setup, fresh_run, capsys, where, named):
    target = fresh_run / where
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("mine")
    before = tree(fresh_run)
    refused(capsys, distill_args(setup, fresh_run) + ["--force"], "nothing was removed", f"{fresh_run / named}:")
    assert tree(fresh_run) == before


def test_a_sealed_student_lists_what_it_holds(fresh_run):
    mark = read_mark(fresh_run / "final", "distill")
    assert mark is not None and "config.json" in mark["names"] and MARK not in mark["names"]
    assert sorted(mark["names"]) == sorted(p.relative_to(fresh_run / "final").as_posix()
                                           for p in (fresh_run / "final").rglob("*") if p.is_file() and p.name != MARK)


def test_convert_force_keeps_a_users_file_in_student_and_run(setup, tmp_path, capsys):
    out = tmp_path / "conv"
    assert main(convert_args(setup, out)) == 0
    capsys.readouterr()
    for where in ("student/NOTES.md", "run/NOTES.md", "run/final/NOTES.md"):
        (out / where).write_text("mine")
        before = tree(out)
        refused(capsys, convert_args(setup, out) + ["--force"], str(out / where), "nothing was removed")
        assert tree(out) == before
        (out / where).unlink()
    assert main(convert_args(setup, out) + ["--force"]) == 0  # its own files alone: started over


def test_experiment_force_keeps_a_users_notes_two_folders_down(setup, tmp_path, capsys):
    study = tmp_path / "study.toml"
    study.write_text(config_text(setup["model"], setup["text"]))
    out = tmp_path / "exp"
    assert main(["experiment", str(study), "--out", str(out)]) == 0
    capsys.readouterr()
    notes = next((out / "runs").iterdir()) / "final" / "NOTES.md"
    notes.write_text("mine")
    before = tree(out)
    refused(capsys, ["experiment", str(study), "--out", str(out), "--force"], str(notes), "nothing was removed")
    assert tree(out) == before


# -- 2: a copied mark is no proof ------------------------------------------------------------------
def test_a_copied_mark_and_record_are_not_resumed(setup, run, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in (MARK, "config.json"):
        shutil.copy2(run / name, mine / name)
    (mine / "metrics.jsonl").write_text("my measurements\n")
    before = tree(mine)
    refused(capsys, distill_args(setup, mine), "nothing was touched")
    refused(capsys, distill_args(setup, mine) + ["--force"], "nothing was removed")
    assert tree(mine) == before


def test_a_moved_run_is_still_its_own(setup, fresh_run, tmp_path, capsys):
    moved = tmp_path / "moved"
    os.rename(fresh_run, moved)  # a rename keeps the inodes the mark is bound to
    assert main(distill_args(setup, moved)) == 0
    assert "finished" in capsys.readouterr().err or (moved / "DONE").is_file()


# -- 3, 3b: symbolic links are never followed or replaced -------------------------------------------
def test_permute_force_never_replaces_a_link(setup, tmp_path, capsys):
    layout = tmp_path / "layout.json"
    assert main(["layout", str(_affinity(setup, tmp_path)), "--devices", "2", "--kind", "contiguous",
                 "--out", str(layout)]) == 0
    real = tmp_path / "permuted"
    assert main(["permute", str(setup["model"]), str(layout), "--out", str(real)]) == 0
    link = tmp_path / "link"
    link.symlink_to(real)
    capsys.readouterr()
    before = tree(real)
    refused(capsys, ["permute", str(setup["model"]), str(layout), "--out", str(link), "--force"], "symbolic link")
    assert link.is_symlink() and tree(real) == before


def _affinity(setup, tmp_path):
    out = tmp_path / "aff.safetensors"
    assert main(["affinity", str(setup["model"]), "--out", str(out), "--text", str(setup["text"]), "--blocks", "2",
                 "--seq-len", "16", "--no-progress"]) == 0
    return out


def test_a_lock_link_is_never_opened(setup, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for argv in (distill_args(setup, tmp_path / "d"), convert_args(setup, tmp_path / "c")):
        out = tmp_path / ("d" if argv[0] == "distill" else "c")
        out.mkdir()
        (out / ".lock").symlink_to(victim)
        refused(capsys, argv, ".lock", "symbolic link")
        assert victim.read_text() == "precious" and [p.name for p in out.iterdir()] == [".lock"]


def test_a_dangling_lock_link_creates_nothing(setup, tmp_path, capsys):
    out = tmp_path / "cache"
    out.mkdir()
    (out / ".lock").symlink_to(tmp_path / "elsewhere")
    refused(capsys, ["teacher-cache", str(setup["model"]), "--out", str(out), "--text", str(setup["text"]),
                     "--steps", "1", "--seq-len", "8", "--no-progress"], ".lock", "symbolic link")
    assert not os.path.lexists(tmp_path / "elsewhere")


def test_serve_env_never_truncates_through_its_lock(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    env = tmp_path / "env"
    env.mkdir()
    (env / ".lock").symlink_to(victim)
    out = subprocess.run([sys.executable, "-m", "dtpshard.serve.env", "--dir", str(env)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "symbolic link" in out.stderr, out.stderr
    assert victim.read_text() == "precious"


def test_a_resume_never_appends_through_a_metrics_link(setup, fresh_run, tmp_path, capsys):
    (fresh_run / "DONE").unlink()  # a run to resume (its checkpoint went with DONE: from the start)
    victim = tmp_path / "victim.jsonl"
    victim.write_text("mine\n")
    (fresh_run / "metrics.jsonl").unlink()
    (fresh_run / "metrics.jsonl").symlink_to(victim)
    refused(capsys, distill_args(setup, fresh_run), "metrics.jsonl", "symbolic link")
    assert victim.read_text() == "mine\n"


def test_report_never_writes_through_a_figures_link(setup, tmp_path, capsys):
    study = tmp_path / "study.toml"
    study.write_text(config_text(setup["model"], setup["text"]))
    out = tmp_path / "exp"
    assert main(["experiment", str(study), "--out", str(out)]) == 0
    shutil.rmtree(out / "figures")
    mine = tmp_path / "my-figures"
    mine.mkdir()
    (mine / "curves.png").write_bytes(b"mine")
    (out / "figures").symlink_to(mine)
    capsys.readouterr()
    refused(capsys, ["report", str(out)], "figures", "symbolic link")
    assert [p.name for p in mine.iterdir()] == ["curves.png"] and (mine / "curves.png").read_bytes() == b"mine"


def test_experiment_never_writes_layouts_through_a_link(setup, tmp_path, capsys):
    study = tmp_path / "study.toml"
    study.write_text(config_text(setup["model"], setup["text"]))
    out = tmp_path / "exp"
    assert main(["experiment", str(study), "--out", str(out)]) == 0
    capsys.readouterr()
    mine = tmp_path / "my-layouts"
    mine.mkdir()
    shutil.rmtree(out / "layouts")
    (out / "layouts").symlink_to(mine)
    for force in ([], ["--force"]):
        refused(capsys, ["experiment", str(study), "--out", str(out), *force], "layouts", "symbolic link")
        assert list(mine.iterdir()) == []


# -- 4: commands never take each other's folders --------------------------------------------------
def test_distill_never_takes_a_convert_folder_or_a_teacher_cache(setup, tmp_path, capsys):
    conv = tmp_path / "conv"
    assert main(convert_args(setup, conv)) == 0
    cache = tmp_path / "cache"
    assert main(["teacher-cache", str(setup["model"]), "--out", str(cache), "--text", str(setup["text"]),
                 "--steps", "1", "--seq-len", "8", "--no-progress"]) == 0
    capsys.readouterr()
    for other, command in ((conv, "convert"), (cache, "teacher-cache")):
        before = tree(other)
        for force in ([], ["--force"]):
            refused(capsys, distill_args(setup, other) + force, f"a dtpshard {command} directory, not a dtpshard")
        assert tree(other) == before
    assert main(convert_args(setup, conv)) == 0  # still convert's own
    assert main(["teacher-cache", str(setup["model"]), "--out", str(cache), "--text", str(setup["text"]),
                 "--steps", "1", "--seq-len", "8", "--no-progress"]) == 0


# -- 10: a planted temporary with an impossible pid -------------------------------------------------
def test_a_planted_temporary_with_a_huge_pid_is_left_alone(setup, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    planted = out / ".config.json.tmp-99999999999999999999"
    planted.write_text("mine")
    assert main(distill_args(setup, out) + ["--force"]) == 0
    assert planted.read_text() == "mine"
    from dtpshard.core.io import pid_alive

    assert pid_alive(10 ** 20) and pid_alive(-1)  # no process has it: what it names is left alone
    assert json.loads((out / "DONE").read_text())["steps"] == 2
