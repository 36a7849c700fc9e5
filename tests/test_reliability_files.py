"""Only regular files are read, and only up to their cap: a --config (every command), a study file,
a --text file, a tokenizer file and a file `permute` copies that is a FIFO, a link to /dev/zero, a
directory or a file over its cap is refused in one line naming it, exit 2, nothing written. YAML
aliases are bounded (a billion laughs is refused); a refusal quotes a few hundred characters of a value at
most; a command-line word that is not UTF-8 is refused in one line naming it.

The commands run in a child process with a timeout and limits on memory and file size: a read
that blocks (a FIFO) or never ends (/dev/zero) fails the test instead of hanging it or filling
the machine's memory or disk."""
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dtpshard.cli import COMMANDS
from dtpshard.core.errors import QUOTE_CHARS
from dtpshard.core.reading import STUDY_BYTES
from dtpshard.data.local import TEXT_BYTES
from dtpshard.layouts.permute import OTHER_BYTES
from dtpshard.model.checkpoint import TOKENIZER_BYTES
from test_experiment import config_text, corpus

TIMEOUT = 300  # seconds for one child: several commands, each importing torch, on a busy CPU
MEMORY = 8 << 30  # address space of a child: /dev/zero read to the end would pass it within seconds
WRITE = 64 << 20  # the largest file a child may write: /dev/zero copied would fill the disk
# the child: each command line in turn through the CLI's main, its exit code and stderr as a JSON line
DRIVER = r"""
import contextlib, io, json, sys
from dtpshard.cli import main
for argv in json.loads(sys.argv[1]):
    print(json.dumps({"started": argv}), flush=True)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    print(json.dumps({"rc": rc, "err": err.getvalue()}), flush=True)
"""
KINDS = {"fifo": "is a FIFO", "dev-zero": "is a character device (it resolves to /dev/zero)",
         "directory": "is a directory", "over-cap": "bytes, more than a"}


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    resource.setrlimit(resource.RLIMIT_FSIZE, (WRITE, WRITE))


def run_cli(*argvs: list[str], stdin: str = "") -> list[tuple[int, str]]:
    """(exit code, stderr) of each command line, run in one child process (`stdin`: what it may read)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    try:
        p = subprocess.run([sys.executable, "-c", DRIVER, json.dumps([[str(a) for a in v] for v in argvs])],
                           capture_output=True, text=True, timeout=TIMEOUT, env=env, preexec_fn=_limit, input=stdin)
    except subprocess.TimeoutExpired as e:
        said = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        pytest.fail(f"no answer within {TIMEOUT} s (a read that blocks?); the last command line: "
                    f"{said.strip().splitlines()[-1:]}")
    results = [json.loads(line) for line in p.stdout.splitlines() if line.startswith('{"rc"')]
    assert p.returncode == 0 and len(results) == len(argvs), p.stderr[-3000:]
    return [(r["rc"], r["err"]) for r in results]


def make(kind: str, path: Path, cap: int) -> Path:
    """A `kind` of thing at `path` that is not a regular file of at most `cap` bytes."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    elif kind == "directory":
        path.mkdir()
    else:  # sparse: the size is in the inode, no disk is used
        with open(path, "wb") as f:
            f.truncate(cap + 1)
    return path


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def refused(result: tuple[int, str], path: Path | str, kind: str, words: str | None = None) -> None:
    rc, err = result
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and str(path) in lines[0] and (words or KINDS[kind]) in lines[0], err


@pytest.fixture
def world(tmp_path, tiny_dirs):
    model = tmp_path / "model"
    shutil.copytree(tiny_dirs["llama"], model)
    text = corpus(tmp_path / "t.txt")
    return {"root": tmp_path, "model": model, "text": text}


def command_line(command: str, w: dict, out: Path, text: Path | None = None, model: Path | None = None) -> list:
    """A command line of `command` that reads `text` (or the good one) and `model`'s tokenizer."""
    m, t = model or w["model"], text or w["text"]
    short = ["--seq-len", "8", "--no-progress", "--device", "cpu"]
    return {
        "generate": ["generate", m, "--prompt", "hi", "--max-new-tokens", "1", "--device", "cpu"],
        "run": ["run", m, "--prompt", "hi", "--max-new-tokens", "1", "--device", "cpu", "--nproc", "2"],
        "affinity": ["affinity", m, "--text", t, "--blocks", "1", "--out", out, *short],
        "eval": ["eval", m, "--text", t, "--blocks", "1", "--devices", "2", "--seq-len", "8", "--device", "cpu"],
        "distill": ["distill", m, "--text", t, "--eval-text", t, "--steps", "1", "--devices", "2", "--out", out,
                    *short],
        "teacher-cache": ["teacher-cache", m, "--text", t, "--steps", "1", "--out", out, *short],
        "convert": ["convert", m, "--text", t, "--eval-text", t, "--steps", "1", "--devices", "2", "--blocks", "1",
                    "--out", out, *short],
    }[command]


def study(w: dict, name: str, text: Path | None = None, model: Path | None = None) -> Path:
    path = w["root"] / f"study-{name}.toml"
    path.write_text(config_text(model or w["model"], text or w["text"]))
    return path


# -- --config: every command, read before anything else ------------------------------------------
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_config_that_is_not_a_regular_file_is_refused(tmp_path, command):
    cases = {kind: make(kind, tmp_path / f"{kind}.yaml", STUDY_BYTES) for kind in KINDS}
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "s.yaml"))  # a socket cannot even be opened: said all the same
    before = tree(tmp_path)
    argvs = [[command, "--config", p, "--out", tmp_path / "out"] for p in [*cases.values(), tmp_path / "s.yaml"]]
    results = run_cli(*argvs)
    sock.close()
    for (kind, path), result in zip(cases.items(), results):
        refused(result, path, kind)
    assert results[-1][0] == 2 and "s.yaml: is a socket, not a regular file" in results[-1][1], results[-1]
    assert tree(tmp_path) == before


# -- study files: experiment STUDY, study --study ---------------------------------------------------
def test_a_study_file_that_is_not_a_regular_file_is_refused(tmp_path):
    cases = {kind: make(kind, tmp_path / f"{kind}.toml", STUDY_BYTES) for kind in KINDS}
    before = tree(tmp_path)
    argvs = [a for p in cases.values() for a in (["experiment", p, "--out", tmp_path / "e"],
                                                  ["study", "--study", p, "--out", tmp_path / "s"])]
    results = run_cli(*argvs)
    for i, (kind, path) in enumerate(cases.items()):
        refused(results[2 * i], path, kind)
        refused(results[2 * i + 1], path, kind)
    assert tree(tmp_path) == before


# -- --text files: every command that reads them, and a study's text keys --------------------------
TEXT_COMMANDS = ["affinity", "eval", "distill", "teacher-cache", "convert"]


def test_a_text_file_that_is_not_a_regular_file_is_refused(world):
    root = world["root"]
    cases = {kind: make(kind, root / f"{kind}.txt", TEXT_BYTES) for kind in KINDS if kind != "directory"}
    # a --text directory is read whole: a FIFO in it is refused by name, not skipped or waited for
    (root / "docs").mkdir()
    cases["directory"] = make("fifo", root / "docs" / "a.txt", 0)
    given = {kind: root / "docs" if kind == "directory" else path for kind, path in cases.items()}
    argvs = [a for k in cases for a in [*(command_line(c, world, root / "out", text=given[k]) for c in TEXT_COMMANDS),
                                        ["experiment", study(world, k, text=given[k]), "--out", root / "e"]]]
    before = tree(root)
    results = iter(run_cli(*argvs))
    for kind, path in cases.items():
        for _ in [*TEXT_COMMANDS, "experiment"]:
            refused(next(results), path, "fifo" if kind == "directory" else kind)
    assert tree(root) == before


# -- tokenizer files: every command that loads a tokenizer ------------------------------------------
TOKENIZER_COMMANDS = ["generate", "run", "affinity", "eval", "distill", "teacher-cache", "convert"]


def test_a_tokenizer_file_that_is_not_a_regular_file_is_refused(world):
    root, models = world["root"], {}
    for kind in KINDS:
        models[kind] = root / f"model-{kind}"
        shutil.copytree(world["model"], models[kind])
        (models[kind] / "tokenizer.json").unlink()
        make(kind, models[kind] / "tokenizer.json", TOKENIZER_BYTES)
    argvs = [a for k in KINDS for a in [*(command_line(c, world, root / "out", model=models[k])
                                          for c in TOKENIZER_COMMANDS),
                                        ["experiment", study(world, k, model=models[k]), "--out", root / "e"]]]
    before = tree(root)
    results = iter(run_cli(*argvs))
    for kind in KINDS:
        for _ in [*TOKENIZER_COMMANDS, "experiment"]:
            refused(next(results), models[kind] / "tokenizer.json", kind)
    assert tree(root) == before


# -- permute: the files it copies beside the weights ------------------------------------------------
def test_permute_copies_only_regular_files(world):
    root = world["root"]
    lay = root / "l.json"
    assert run_cli(["layout", world["model"], "--kind", "random", "--devices", "2", "--out", lay])[0][0] == 0
    models = {}
    for kind in KINDS:
        models[kind] = root / f"model-{kind}"
        shutil.copytree(world["model"], models[kind])
        # a directory beside the weights is copied as one (its files checked the same way)
        where = models[kind] / "extra" / "README.md" if kind == "directory" else models[kind] / "README.md"
        where.parent.mkdir(exist_ok=True)
        make("fifo" if kind == "directory" else kind, where, OTHER_BYTES)
        models[kind] = (models[kind], where.relative_to(models[kind]))
    before = tree(root)
    results = run_cli(*[["permute", m, lay, "--out", root / f"out-{k}"] for k, (m, _) in models.items()])
    for (kind, (model, rel)), result in zip(models.items(), results):
        refused(result, f"{model}: {rel}", "fifo" if kind == "directory" else kind)
    assert tree(root) == before


# -- YAML aliases, long values ----------------------------------------------------------------------
def billion_laughs(key: str) -> str:
    """Nine levels of nine aliases under `key`: 9**9 strings when expanded."""
    lines, prev = [f"{key}:", '  - &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]'], "a"
    for name in "bcdefghi":
        lines.append(f"  - &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
        prev = name
    return "\n".join(lines) + "\n"


def test_yaml_alias_bombs_are_refused(world):
    root = world["root"]
    (root / "bomb.yaml").write_text(billion_laughs("kind"))
    (root / "study.yaml").write_text(f"model: {world['model']}\ndevices: 2\n" + billion_laughs("arms"))
    (root / "long.yaml").write_text(f"kind: {'x' * (STUDY_BYTES // 2)}\n")
    long_study = study(world, "long")
    long_study.write_text(long_study.read_text().replace("devices = 2", f"devices = '{'x' * (STUDY_BYTES // 2)}'"))
    before = tree(root)
    bomb, exp, long, long_exp = run_cli(
        ["layout", world["model"], "--config", root / "bomb.yaml", "--out", root / "l"],
        ["experiment", root / "study.yaml", "--out", root / "e"],
        ["layout", world["model"], "--config", root / "long.yaml", "--out", root / "l"],
        ["experiment", long_study, "--out", root / "e"])
    for (rc, err), path in ((bomb, "bomb.yaml"), (exp, "study.yaml")):
        assert rc == 2 and err.count("\n") == 1 and f"{path}: its YAML aliases expand to more than" in err, err
    assert len(bomb[1]) < 300 and len(exp[1]) < 300
    for (rc, err), said in ((long, "--kind xxx"), (long_exp, "devices = 'xxx")):  # half a MiB, quoted briefly
        assert rc == 2 and err.count("\n") == 1 and said in err and len(err) < QUOTE_CHARS + 300, err[:500]
    assert tree(root) == before


def test_yaml_aliases_within_bounds_still_load(tmp_path):
    """yaml.safe_dump writes a value used twice as an anchor and an alias: that loads; a value
    inside itself does not."""
    from dtpshard.core.errors import UserError
    from dtpshard.core.reading import read_options

    (tmp_path / "c.yaml").write_text("kind: &k random\ndevices: 2\nlayers: &l [1, 2]\nalso: *l\n")
    assert read_options(tmp_path / "c.yaml") == {"kind": "random", "devices": 2, "layers": [1, 2], "also": [1, 2]}
    (tmp_path / "c.yaml").write_text("kind: &k [1, *k]\n")
    with pytest.raises(UserError, match="c.yaml: line 1: a YAML alias inside its own anchor"):
        read_options(tmp_path / "c.yaml")


# -- the command line -------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, named", [
    ([b"generate", b"MODEL", b"--prompt", b"\xff\xfe"], b"--prompt: \\xff\\xfe is not UTF-8"),
    ([b"run", b"MODEL", b"--prompt=ok\xff"], b"--prompt: ok\\xff is not UTF-8"),
    ([b"layout", b"MODEL\xff", b"--kind", b"random"], b"argument 2: MODEL\\xff is not UTF-8"),
    ([b"\xff"], b"argument 1: \\xff is not UTF-8"),
])
def test_a_command_line_word_that_is_not_utf8_is_refused(tmp_path, argv, named):
    model = tmp_path / "model"
    model.mkdir()  # refused before any work: the command never looks here
    argv, named = [a.replace(b"MODEL", bytes(model)) for a in argv], named.replace(b"MODEL", bytes(model))
    p = subprocess.run([sys.executable, "-m", "dtpshard", *argv], capture_output=True, timeout=TIMEOUT,
                       cwd=tmp_path, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert p.returncode == 2 and p.stderr.count(b"\n") == 1 and named in p.stderr, p.stderr[-2000:]
    assert b"Traceback" not in p.stderr and tree(tmp_path) == ["model"]
