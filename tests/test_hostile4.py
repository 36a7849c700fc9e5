"""Issue 60, the fourth hostile sweep, each class by the rule that covers it: a lock is the
command's own file or refused untouched (core/lock.py); the native kernels' cache is data checked
before it is trusted (transport/native.py); a directory's mark is proof only for the directory it
was written into, a checkpoint only for its run, a report only for a marked experiment, and a
temporary is recognised by its name's check, never by its pattern alone (core/owned.py, core/io.py).
Each refusal is one line, exit 2, with nothing touched."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtpshard.cli import main
from dtpshard.core import lock as lock_module
from dtpshard.core.errors import UserError
from dtpshard.core.lock import LOCK, locked, locked_output
from test_faults import DISTILL
from tiny import linked_victim

ROOT = Path(__file__).resolve().parents[1]


def one_line(capsys, *words):
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("[")]
    assert len(err) == 1 and "Traceback" not in err[0] and all(w in err[0] for w in words), (words, err)
    return err[0]


# -- 1. a lock is the command's own file ----------------------------------------------------------
def test_a_hard_linked_lock_is_never_written_or_removed(tmp_path):
    victim, run = linked_victim(tmp_path, LOCK)
    with pytest.raises(UserError, match="hard link"), locked(run):
        pass
    assert victim.read_text() == "precious" and (run / LOCK).exists()


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_a_users_lock_name_is_refused_untouched(tmp_path, kind):
    run = tmp_path / "run"
    run.mkdir()
    if kind == "fifo":
        os.mkfifo(run / LOCK)
    else:
        (run / LOCK).write_text("my notes")
    with pytest.raises(UserError, match=r"\.lock: is (not a lock dtpshard made|not a regular file)"), locked(run):
        pass
    assert os.path.lexists(run / LOCK)
    if kind == "file":
        assert (run / LOCK).read_text() == "my notes"


def test_a_users_name_lock_beside_a_file_output_is_refused_untouched(tmp_path):
    mine = tmp_path / ".layout.json.lock"
    mine.write_text("12\n")  # a bare number: not the signature
    with pytest.raises(UserError, match="not a lock dtpshard made"), locked_output(tmp_path / "layout.json"):
        pass
    assert mine.read_text() == "12\n"


def test_a_dead_holders_lock_is_taken_over_and_removed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK).write_text("dtpshard-lock 4000001\n")  # no process has that pid
    assert getattr(lock_module, "is_lock", lambda p: True)(run / LOCK)
    with locked(run):
        assert (run / LOCK).read_text() == f"dtpshard-lock {os.getpid()}\n"
    assert not os.path.lexists(run / LOCK)


def test_a_folder_holding_only_a_users_lock_is_not_empty(tiny_dirs, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("a b c d e f g h\n" * 200)
    out = tmp_path / "mine"
    out.mkdir()
    (out / LOCK).write_text("my notes")
    assert main(["distill", str(tiny_dirs["llama"]), "--out", str(out), "--text", str(text), "--devices", "2",
                 *DISTILL]) == 2
    one_line(capsys, ".lock")
    assert [p.name for p in out.iterdir()] == [LOCK] and (out / LOCK).read_text() == "my notes"


# -- 3. ownership: a mark, a checkpoint, a report, a temporary ------------------------------------
def test_a_mark_copied_into_a_folder_with_the_deleted_ones_inode_numbers_proves_nothing(tmp_path):
    import json
    import shutil

    from dtpshard.core.owned import MARK, is_ours, mark

    run = tmp_path / "run"
    (run / "config.json").parent.mkdir()
    (run / "config.json").write_text(json.dumps({"dir_id": mark(run, "distill")}))
    assert is_ours(run, "distill", "config.json")
    saved, record = json.loads((run / MARK).read_text()), (run / "config.json").read_text()
    shutil.rmtree(run)
    run.mkdir()
    (run / "metrics.jsonl").write_text("the user's\n")
    (run / "config.json").write_text(record)
    saved.update(dir=os.lstat(run).st_ino)  # ext4 gives a new folder a deleted one's numbers at once:
    (run / MARK).write_text("")  # as if reused, exactly
    saved.update(ino=os.lstat(run / MARK).st_ino)
    (run / MARK).write_text(json.dumps(saved))
    assert not is_ours(run, "distill", "config.json")


def test_a_checkpoint_without_its_runs_id_is_refused():
    from dtpshard.training import rundir
    from dtpshard.training.settings import compared_keys

    config = {k: None for k in compared_keys()} | {"dir_id": "abc"}
    state = {"step": 1, "wall": 0.0, "metrics_bytes": 0, "rng": {}, "scheduler": {},
             "config": {k: v for k, v in config.items() if k != "dir_id"}}
    with pytest.raises(UserError, match="no directory id"):
        rundir.check_state(Path("RUN/checkpoint.pt"), state, config, 2)


def test_report_never_overwrites_a_users_report_in_an_unmarked_folder(tmp_path, capsys):
    from test_report import make_experiment

    d = make_experiment(tmp_path / "mine")
    (d / "dtpshard-dir.json").unlink()  # a folder of the user's that holds runs/*/metrics.jsonl
    (d / "report.md").write_text("my report")
    (d / "figures").mkdir()
    (d / "figures" / "curves.png").write_bytes(b"mine")
    assert main(["report", str(d)]) == 2
    one_line(capsys, "report.md", "not an experiment directory dtpshard marked")
    assert (d / "report.md").read_text() == "my report" and (d / "figures" / "curves.png").read_bytes() == b"mine"


@pytest.mark.parametrize("name", [".config.json.tmp-4000000", ".config.json.tmp-4000000-abc"])
def test_a_users_file_named_like_a_temporary_is_never_removed(tmp_path, name):
    from dtpshard.core.io import atomic_write_text, remove_stale_temporaries
    from dtpshard.core.owned import is_leftover

    mine = tmp_path / name
    mine.write_text("mine")
    assert not is_leftover(name, ["config.json"])
    remove_stale_temporaries(tmp_path / "config.json")
    atomic_write_text(tmp_path / "config.json", "{}")
    assert mine.read_text() == "mine"


def test_a_stale_temporary_of_a_dead_process_is_removed(tmp_path):
    from dtpshard.core.io import remove_stale_temporaries
    from dtpshard.core.temporary import temporary_name

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    stale = tmp_path / temporary_name("config.json", pid=dead)
    stale.write_text("{")
    remove_stale_temporaries(tmp_path / "config.json")
    assert not stale.exists()


# -- 2. the native kernels' cache is data, checked before it is trusted ---------------------------
def test_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path):
    from dtpshard.core.cache import cache_dir

    monkeypatch.delenv("DTPSHARD_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", ".cache")
    monkeypatch.chdir(tmp_path)
    assert cache_dir() == Path.home() / ".cache" / "dtpshard"


def _native():
    from dtpshard.transport import native
    from test_native import _probe

    where = Path("cache") / "native"
    return _probe, where, f"ring-{native._key(native.SOURCE.read_bytes())}.so"


def _script(tmp_path, body: str) -> Path:
    path = tmp_path / "cxx"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("kind", ["hard link", "fifo"])
def test_the_native_cache_lock_is_never_written_through(tmp_path, kind):
    probe, where, _ = _native()
    (tmp_path / where).mkdir(parents=True, mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    if kind == "fifo":
        os.mkfifo(tmp_path / where / LOCK)
    else:
        os.link(victim, tmp_path / where / LOCK)
    said = probe(tmp_path, CXX="false")["said"]
    assert "Python kernels" in said and ".lock" in said, said
    assert victim.read_text() == "precious" and os.path.lexists(tmp_path / where / LOCK)


def test_a_damaged_library_in_the_cache_is_never_loaded(tmp_path):
    probe, where, name = _native()
    (tmp_path / where).mkdir(parents=True, mode=0o700)
    (tmp_path / where / name).write_bytes(b"\x7fELF\x02\x01\x01")  # truncated: dlopen would crash or fail
    said = probe(tmp_path, CXX="false")["said"]
    assert said.endswith("false failed: no output)"), said  # built again, not loaded


def test_a_cache_others_may_write_is_not_run_from(tmp_path):
    probe, where, _ = _native()
    (tmp_path / where).mkdir(parents=True)
    (tmp_path / where).chmod(0o777)
    said = probe(tmp_path, CXX="false")["said"]
    assert "not safe to run code from" in said and "may be written by other users" in said, said


def test_a_compiler_that_never_returns_is_bounded_and_killed(tmp_path):
    probe, _, _ = _native()
    pid_file = tmp_path / "pid"
    cxx = _script(tmp_path, f"echo $$ > {pid_file}\nexec sleep 1000\n")
    said = probe(tmp_path, CXX=str(cxx), PROBE_TIMEOUT="6")["said"]  # a build gets a third: 2 s
    assert "did not finish within 2 s" in said, said
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_compiler_printing_non_utf8_still_falls_back(tmp_path):
    probe, _, _ = _native()
    cxx = _script(tmp_path, "printf 'error: \\377\\376 bad\\n' >&2\nexit 1\n")
    said = probe(tmp_path, CXX=str(cxx))["said"]
    assert "Python kernels" in said and "failed: error:" in said, said


def test_a_killed_builds_folder_is_removed_by_the_next(tmp_path):
    from dtpshard.core.temporary import temporary_name

    probe, where, name = _native()
    (tmp_path / where).mkdir(parents=True, mode=0o700)
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    stale = tmp_path / where / temporary_name(name, "-abc123", pid=dead)
    stale.mkdir()
    (stale / "ring.so").write_bytes(b"half")
    probe(tmp_path, CXX="false")
    assert not stale.exists()
