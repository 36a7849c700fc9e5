"""An output never touches an input (core/guard.py), for every command that writes: an --out that
is an input, lies inside one, contains one, or reaches one through a symlink is refused in one
line, with or without --force, before any work; the inputs are unchanged byte for byte and
nothing is left behind. --force replaces only the command's own output. Two writers of one new
output: one wins, the other is refused, nothing is replaced silently."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtpshard.cli import main
from test_experiment import config_text, corpus

ROOT = Path(__file__).resolve().parents[1]


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root (links as where they lead, files with their bytes)."""
    out = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        out[key] = ("link:" + os.readlink(p)).encode() if p.is_symlink() else p.read_bytes() if p.is_file() else None
    return out


@pytest.fixture
def world(tmp_path, tiny_dirs):
    """parent/ holding the model, a text file, a layout and a study: everything an input."""
    parent = tmp_path / "parent"
    parent.mkdir()
    model = parent / "model"
    shutil.copytree(tiny_dirs["llama"], model)
    text = corpus(parent / "t.txt")
    assert main(["layout", str(model), "--kind", "contiguous", "--devices", "2", "--out", str(parent / "l.json")]) == 0
    (parent / "study.toml").write_text(config_text(model, text))
    os.symlink(model, tmp_path / "model-link")
    return tmp_path


def argv(command, w: Path, out: Path, model: Path | None = None):
    m, p = str(model or w / "parent" / "model"), w / "parent"
    text = str(p / "t.txt")
    return {
        "layout": ["layout", m, "--kind", "contiguous", "--devices", "2"],
        "affinity": ["affinity", m, "--text", text, "--blocks", "1", "--seq-len", "8", "--no-progress"],
        "permute": ["permute", m, str(p / "l.json")],
        "distill": ["distill", m, "--text", text, "--steps", "1", "--devices", "2", "--seq-len", "8", "--no-progress"],
        "teacher-cache": ["teacher-cache", m, "--text", text, "--steps", "1", "--seq-len", "8", "--no-progress"],
        "experiment": ["experiment", str(p / "study.toml")],
        "demo": ["demo"],
    }[command] + ["--out", str(out)]


FORCE = {"permute", "distill", "teacher-cache", "experiment", "demo"}  # the commands with a --force
WHERE = {  # out, relative to the test's directory, and the words of the refusal
    "is": ("parent/model", " is "),
    "inside": ("parent/model/new", " is inside "),
    "a weight file": ("parent/model/model.safetensors", " is inside "),
    "contains": ("parent", " contains "),
    "symlink to it": ("model-link", "resolves to"),
    "inside its symlink": ("model-link/new", "resolves to"),
    "the text file": ("parent/t.txt", " is the "),
}


@pytest.mark.parametrize("force", [False, True], ids=["", "force"])
@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize("command", ["layout", "affinity", "permute", "distill", "teacher-cache", "experiment",
                                     "demo"])
def test_an_output_never_touches_an_input(world, capsys, monkeypatch, command, where, force):
    if force and command not in FORCE:
        pytest.skip(f"{command} has no --force")
    if where == "the text file" and command in ("layout", "permute", "demo"):
        pytest.skip(f"{command} reads no text file")
    # the demo's model is the dequantised SmolLM2; here the tiny one stands in (same code path after)
    monkeypatch.setattr("dtpshard.studies.smollm2.smollm2_checkpoint", lambda *a: world / "parent" / "model")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # what the demo sets for itself
    rel, words = WHERE[where]
    before = tree(world)
    assert main(argv(command, world, world / rel) + (["--force"] if force else [])) == 2
    err = capsys.readouterr().err.strip()
    linked = "symlink" in where and "is a symbolic link" in err  # a file output's lock comes first:
    # no name is written through a link either (core/io.py's refuse_links), the same place refused sooner
    assert len(err.splitlines()) == 1 and (linked or "an input of this command" in err and words in err), err
    assert tree(world) == before  # every input byte for byte, nothing written, no temporary left


def test_an_input_reached_through_a_symlink(world, capsys):
    """The model given as a link, the output inside the real directory: the same place."""
    before = tree(world)
    for command in ("layout", "permute", "distill"):
        out = world / "parent" / "model" / "new"
        assert main(argv(command, world, out, model=world / "model-link")) == 2
        err = capsys.readouterr().err
        assert " is inside the " in err and "model-link" in err, err
    assert tree(world) == before


def test_a_bind_or_hard_link_of_an_input_is_the_input(world, capsys):
    """Identity, not only names: a hard link to the text file is the text file."""
    os.link(world / "parent" / "t.txt", world / "t-hard.txt")
    before = tree(world)
    assert main(argv("distill", world, world / "t-hard.txt")) == 2
    assert " is the training text " in capsys.readouterr().err
    assert tree(world) == before


def test_report_never_writes_over_what_it_reads(tmp_path, capsys):
    from test_report import make_experiment

    d = make_experiment(tmp_path / "exp")
    os.symlink(d / "runs", d / "figures")  # the figures would land among the runs
    before = tree(tmp_path)
    assert main(["report", str(d)]) == 2
    err = capsys.readouterr().err
    assert "figures" in err and "an input of this command" in err, err
    assert tree(tmp_path) == before


@pytest.mark.parametrize("command", ["permute", "teacher-cache"])
def test_force_replaces_only_the_commands_own_output(world, capsys, command):
    other = world / "other"
    other.mkdir()
    (other / "mine.txt").write_text("keep")
    before = tree(world)
    assert main(argv(command, world, other) + ["--force"]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a " in err and "the only thing --force replaces" in err, err
    assert tree(world) == before


@pytest.mark.parametrize("command", ["layout", "affinity"])
def test_a_file_output_replaces_only_its_own_kind(world, capsys, command):
    notes = world / "notes.json"
    notes.write_text('{"mine": 1}')
    assert main(argv(command, world, notes)) == 2
    assert "exists and is not a" in capsys.readouterr().err and notes.read_text() == '{"mine": 1}'
    out = world / "own"
    assert main(argv(command, world, out)) == 0
    first = out.read_bytes()
    assert main(argv(command, world, out)) == 0 and out.exists()  # its own kind: replaced as before
    assert len(first) > 0


# -- two writers of one new output --------------------------------------------------------------
HOLD = """
import sys, time
from pathlib import Path
import dtpshard.core.rename as rename
publish, flag = rename.publish_new, Path(sys.argv[1])
def held(src, dst):
    # A has passed every check and written its result; it waits here until B has been answered
    flag.with_suffix(".at").touch()
    while not flag.with_suffix(".go").exists():
        time.sleep(0.05)
    return publish(src, dst)
rename.publish_new = held
import dtpshard.core.io as io
io.publish_new = held
from dtpshard.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("command", ["layout", "permute", "affinity"])
def test_a_second_writer_of_one_output_is_refused_before_its_work(world, command):
    """Issue 54 (6c): while one process writes --out, a second given the same --out is refused at
    once by name (core/lock.py: .NAME.lock beside it), not after its own work at the rename."""
    out, flag = world / f"new-{command}", world / f"gate-{command}"
    args = argv(command, world, out)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(flag), *args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not flag.with_suffix(".at").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flag.with_suffix(".at").exists(), first.communicate()
        second = subprocess.run([sys.executable, "-m", "dtpshard", *args], env=env, capture_output=True, text=True,
                                timeout=120)
    finally:
        flag.with_suffix(".go").touch()
    assert second.returncode == 2 and second.stderr.count("\n") == 1 and "is in use by process" in second.stderr, \
        second.stderr
    assert first.wait(120) == 0, first.stderr.read()
    assert os.path.lexists(out) and not [p for p in world.iterdir() if ".tmp-" in p.name or p.name.endswith(".lock")]


def test_a_second_teacher_cache_builder_is_refused(world, capsys):
    from dtpshard.training.rundir import locked

    out = world / "cache"
    with locked(out):
        assert main(argv("teacher-cache", world, out)) == 2
    assert "is in use by process" in capsys.readouterr().err
