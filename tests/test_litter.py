"""A full disk, a kill, SIGTERM: one line naming the file, never a half-written output, no litter.

The full disk is a real one where the platform allows mounting a small tmpfs (root with
CAP_SYS_ADMIN); elsewhere the write is made to fail with ENOSPC in-process, which still tests
the message path but not the libraries' own reaction to a full disk.
"""
import errno
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dtpshard.cli import main
from dtpshard.core.errors import explain
from dtpshard.core.shape import UnitShape
from test_faults import DISTILL, ROOT, tree
from test_report import make_experiment


def _mount(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    try:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0


def _fill(d: Path) -> None:
    """Leave no free block on d's file system."""
    with open(d / "filler", "wb", buffering=0) as f:
        for size in (1 << 16, 1 << 12, 1 << 9, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass


def _no_space(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def disk(tmp_path, monkeypatch):
    """(directory, fill, make_room): fill() leaves no space there, make_room() leaves room for
    small files but not for a checkpoint. On a small tmpfs where it can be mounted; else
    simulated: every fsync and safetensors write, then every torch.save, raises ENOSPC."""
    d = tmp_path / "disk"
    if os.environ.get("DTPSHARD_TEST_NO_MOUNT") != "1" and _mount(d, "384k"):
        yield d, lambda: _fill(d), lambda: (d / "filler").unlink()
        subprocess.run(["umount", "-l", str(d)], check=False)
        return
    import safetensors.torch
    import torch

    def fill():
        monkeypatch.setattr(os, "fsync", _no_space)
        monkeypatch.setattr(safetensors.torch, "save_file", _no_space)

    def make_room():
        monkeypatch.undo()
        monkeypatch.setattr(torch, "save", _no_space)

    yield d, fill, make_room


def full_disk_refusal(capsys, argv, where: Path, named: Path):
    before = tree(where)
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()  # affinity says what its pass will do first
    assert "Traceback" not in err and [ln for ln in lines if "error:" in ln] == lines[-1:], err
    assert f"no space left on device writing {named}" in lines[-1], err
    assert tree(where) == before  # the old output (if any) intact, no temporary left
    assert not [p for p in where.rglob("*") if ".tmp-" in p.name]


def test_full_disk(disk, tiny_dirs, tmp_path, capsys):
    """layout, affinity, permute and report on a full disk; distill when a checkpoint no longer fits."""
    d, fill, make_room = disk
    model = tiny_dirs["llama"]
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(f"paragraph {i}: the model sums partials from every device." for i in range(400)))
    exp = make_experiment(d / "exp")
    lay = tmp_path / "l.json"
    assert main(["layout", str(model), "--out", str(lay), "--kind", "contiguous", "--devices", "2"]) == 0
    (d / "old.json").write_bytes(lay.read_bytes())  # a previous output (a layout: what layout replaces) stays
    fill()
    full_disk_refusal(capsys, ["layout", model, "--out", d / "old.json", "--kind", "random"], d, d / "old.json")
    full_disk_refusal(capsys, ["affinity", model, "--out", d / "a.st", "--text", text, "--blocks", "1",
                               "--seq-len", "8", "--device", "cpu", "--no-progress"], d, d / "a.st")
    full_disk_refusal(capsys, ["permute", model, lay, "--out", d / "perm", "--check-tokens", "8"], d, d / "perm")
    full_disk_refusal(capsys, ["report", exp], d, exp / "figures" / "curves.png")
    make_room()  # room for config.json and metrics, not for a checkpoint
    run = d / "run"
    argv = ["distill", str(model), "--out", str(run), "--text", str(text), "--eval-text", str(text), *DISTILL]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"no space left on device writing {run}" in err, err
    assert not (run / "checkpoint.pt").exists() and not [p for p in run.iterdir() if ".tmp-" in p.name]


def test_explain_names_the_file():
    cases = [(OSError(errno.ENOSPC, "x", "/o/.f.json.tmp-12"), "no space left on device writing /o/f.json"),
             (PermissionError(errno.EACCES, "x", "/o/f"), "permission denied on /o/f"),
             (OSError(errno.EROFS, "x", "/ro/.run.tmp-3-ab/model.safetensors"), "read-only file system writing "
              "/ro/run/model.safetensors"),
             (FileNotFoundError(errno.ENOENT, "x", "/n"), "no such file or directory: /n")]
    for exc, line in cases:
        assert explain(exc).startswith(line), explain(exc)
    import json

    import torch
    from safetensors import SafetensorError

    try:
        torch.nn.Linear(2, 3).load_state_dict({"weight": torch.zeros(3, 3), "bias": torch.zeros(3)})
    except RuntimeError as e:
        assert "tensor weight has shape [3, 3] in the weights but the config implies [3, 2]" in explain(e)
    assert "not a readable safetensors file" in explain(SafetensorError("Error while deserializing header"))
    assert "malformed JSON" in explain(json.JSONDecodeError("Expecting value", "{", 1))
    assert "not UTF-8" in explain(UnicodeDecodeError("utf-8", b"caf\xe9", 3, 4, "invalid"))
    assert explain(ValueError("a bug")) is None and explain(KeyError("k")) is None


def _writer(target: Path, kind: str) -> subprocess.Popen:
    # SIGINT and SIGTERM as an interactive user's process has them: a test run started in the
    # background (`cmd &` in a script) passes SIGINT on ignored, and the writer would never see it
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
            f"import time; from dtpshard.core.io import {kind}\n"
            f"with {kind}({str(target)!r}) as tmp:\n"
            "    (tmp / 'x' if tmp.is_dir() else tmp).write_text('half')\n"
            "    print('writing', flush=True); time.sleep(600)")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("kind", ["atomic_path", "atomic_dir"])
def test_no_litter_after_sigterm_sigint_or_sigkill(tmp_path, kind):
    target = tmp_path / ("out.json" if kind == "atomic_path" else "out")
    for sig in (signal.SIGTERM, signal.SIGINT):
        p = _writer(target, kind)
        assert p.stdout.readline().strip() == "writing"
        assert [x for x in tmp_path.iterdir() if ".tmp-" in x.name]
        p.send_signal(sig)
        p.wait(60)
        assert p.returncode != 0 and list(tmp_path.iterdir()) == [], (sig, p.stderr.read())
        if sig == signal.SIGTERM:
            assert p.returncode == 128 + signal.SIGTERM  # exits as SIGTERM's shell status, after the cleanup
    p = _writer(target, kind)
    assert p.stdout.readline().strip() == "writing"
    p.kill()
    p.wait()
    assert [x for x in tmp_path.iterdir() if ".tmp-" in x.name]  # SIGKILL: nothing could run...
    from dtpshard.core.temporary import temporary_name

    alive = tmp_path / temporary_name(target.name, pid=os.getppid())  # a live process's temporary is kept
    alive.write_text("busy")
    from dtpshard.core.io import atomic_path

    with atomic_path(tmp_path / "other.json") as tmp:
        tmp.write_text("{}")
    assert len([x for x in tmp_path.iterdir() if ".tmp-" in x.name]) == 2  # ...others' stale ones stay
    if kind == "atomic_path":
        with atomic_path(target) as tmp:  # ...until the next write of the same output
            tmp.write_text("{}")
    else:
        from dtpshard.core.io import atomic_dir

        with atomic_dir(target) as tmp:
            (tmp / "x").write_text("{}")
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted([alive.name, target.name, "other.json"])


def test_one_mode_for_every_output(tmp_path):
    """Affinity files (safetensors writes 0600) get the same mode as every other output."""
    import numpy as np

    from dtpshard.affinity.file import Affinity
    from dtpshard.core.io import atomic_write_text

    old = os.umask(0o022)
    try:
        Affinity(UnitShape(1, 1, 1, 2), 1,
                 {(0, 1): np.ones((1, 2))}).save(tmp_path / "a.safetensors")
        atomic_write_text(tmp_path / "b.json", "{}")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"a.safetensors": 0o644, "b.json": 0o644}
