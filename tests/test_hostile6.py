"""Issue 66, the sixth hostile sweep, each class by the rule that covers it:
1. nothing runs from a folder the user did not choose as the cache: a relative DTPSHARD_CACHE is
   refused, a native library is trusted only as the very inode dtpshard built (core/identity.py),
   and the cache's ancestors are checked as the cache is;
2. a lock never exists unsigned (core/lock.py), so a contended lock is waited for, never refused;
3. a mark binds only where its file system can tell a reused inode from the one it was written on
   (birth time or generation number); where it can tell neither, nothing is resumed or cleared.
Each refusal is one line, exit 2, with nothing touched."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dtpshard.core import identity as ident
from dtpshard.core.errors import UserError


def _dtpshard(args, cwd, **env):
    run_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-m", "dtpshard", *args], capture_output=True, text=True, cwd=cwd,
                          env=run_env, timeout=120)


# -- 1. the cache is a folder the user chose, and a library is the inode dtpshard built -----------
@pytest.mark.parametrize("setting, said", [(".cache", "is a relative path"), ("cache/x", "is a relative path"),
                                           ("~nouser-dtpshard/c", "names a user that does not exist")])
def test_a_relative_or_unknown_users_cache_is_refused_in_one_line(tmp_path, setting, said):
    out = _dtpshard(["generate", str(tmp_path / "model"), "--prompt", "hi"], tmp_path, DTPSHARD_CACHE=setting)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "DTPSHARD_CACHE" in out.stderr and said in out.stderr, out.stderr
    assert sorted(os.listdir(tmp_path)) == []


def test_the_engine_path_says_why_instead_of_reading_a_relative_cache(tmp_path, monkeypatch):
    from dtpshard.transport import native

    monkeypatch.setenv("DTPSHARD_CACHE", ".cache")
    monkeypatch.chdir(tmp_path)
    assert "relative path" in native._load(5.0)
    assert not (tmp_path / ".cache").exists()


def _built(where: Path) -> Path:
    """A library as transport/native.py records one it built (any bytes: it is never loaded here)."""
    from dtpshard.transport import native

    where.mkdir(parents=True, mode=0o700)
    lib = where / "ring-0123456789abcdef.so"
    lib.write_bytes(b"\x7fELF not really")
    native._record(lib).write_text(json.dumps({"sha256": native._digest(lib), "lib": ident.identity(lib)}))
    return lib


def test_a_library_shipped_with_its_record_is_not_dtpshards(tmp_path):
    from dtpshard.transport import native

    lib = _built(tmp_path / "mine" / "native")
    assert native._verified(lib)  # the one dtpshard built, where it built it
    copy = Path(shutil.copytree(tmp_path / "mine", tmp_path / "shipped" / ".cache")) / "native" / lib.name
    assert copy.read_bytes() == lib.read_bytes()
    assert native._record(copy).read_bytes() == native._record(lib).read_bytes()
    assert not native._verified(copy)  # bytes and record whole, but another inode than the record names
    old = tmp_path / "old" / "native"  # a record of the bytes alone (dtpshard before this rule) proves nothing
    old.mkdir(parents=True)
    (old / lib.name).write_bytes(lib.read_bytes())
    native._record(old / lib.name).write_text(native._digest(lib) + "\n")
    assert not native._verified(old / lib.name)


def test_a_reused_inode_is_not_the_library_the_record_names(tmp_path):
    from dtpshard.transport import native

    lib = _built(tmp_path / "native")
    record = json.loads(native._record(lib).read_text())
    lib.unlink()
    lib.write_bytes(b"\x7fELF not really")  # the same bytes at a new inode (ext4 may even give the same number)
    record["lib"]["ino"] = os.lstat(lib).st_ino
    native._record(lib).write_text(json.dumps(record))
    assert not native._verified(lib)


def test_a_cache_under_a_folder_others_may_write_is_not_run_from(tmp_path):
    from dtpshard.core.cache import private_dir

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could swap `cache` for a folder of theirs
    assert "a folder on the way" in private_dir(shared / "cache" / "native")
    shared.chmod(0o1777)  # sticky, as /tmp: nobody else may rename what is ours
    assert private_dir(shared / "cache" / "native") == ""


# -- 2. a lock never exists unsigned ---------------------------------------------------------------
RACE = textwrap.dedent("""
    import sys
    from pathlib import Path
    from dtpshard.core.errors import UserError
    from dtpshard.core.lock import acquire, release
    d = Path(sys.argv[1])
    refused = 0
    for _ in range(int(sys.argv[2])):
        try:
            fd = acquire(d / ".lock", d, wait=30)
        except UserError as e:
            refused += 1
            print(e, file=sys.stderr)
            continue
        release(d / ".lock", fd)
    print(refused)
""")


@pytest.mark.parametrize("fallback", [False, True])
def test_a_fresh_lock_contended_by_two_processes_is_waited_for(tmp_path, fallback):
    script = tmp_path / "race.py"
    script.write_text(RACE if not fallback else
                      "import os\nos.O_TMPFILE = os.O_DIRECTORY | 0o40000000  # O_DIRECTORY alone: EISDIR\n" + RACE)
    d = tmp_path / "d"
    d.mkdir()
    procs = [subprocess.Popen([sys.executable, str(script), str(d), "200"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [int(o.strip()) for o, _ in outs] == [0, 0], outs  # 12 of 200 were refused as "not a lock" before
    assert os.listdir(d) == []


def test_a_lock_is_never_seen_unsigned(tmp_path, monkeypatch):
    """The name appears only on a written, held file: seen from the moment it has a name."""
    import fcntl

    from dtpshard.core import lock

    seen = []
    real = lock._call

    def watch(name, *args):
        real(name, *args)
        path = args[3]
        with open(path, "rb") as f:
            held = False
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                held = True
            seen.append((f.read(), held, os.stat(path).st_nlink))

    monkeypatch.setattr(lock, "_call", watch)
    fd = lock.acquire(tmp_path / ".lock", tmp_path)
    lock.release(tmp_path / ".lock", fd)
    assert seen == [(f"dtpshard-lock {os.getpid()}\n".encode(), True, 1)]


def test_a_dead_holders_lock_is_made_anew_and_never_seen_empty(tmp_path):
    from dtpshard.core.lock import acquire, release

    (tmp_path / ".lock").write_text("dtpshard-lock 4000000\n")  # its holder died: nobody holds it
    stale = os.lstat(tmp_path / ".lock").st_ino
    fd = acquire(tmp_path / ".lock", tmp_path)
    assert (tmp_path / ".lock").read_text() == f"dtpshard-lock {os.getpid()}\n"
    assert os.fstat(fd).st_ino != stale or os.lstat(tmp_path / ".lock").st_ino == os.fstat(fd).st_ino
    release(tmp_path / ".lock", fd)
    assert os.listdir(tmp_path) == []


# -- 3. marks bind only where a reused inode can be told apart ---------------------------------------
def _run(tmp_path: Path) -> tuple[Path, str]:
    from dtpshard.core.owned import mark

    run = tmp_path / "run"
    run.mkdir()
    record = json.dumps({"dir_id": mark(run, "distill")})
    (run / "config.json").write_text(record)
    return run, record


def test_without_birth_times_the_generation_number_binds_a_mark(tmp_path, monkeypatch):
    from dtpshard.core.owned import MARK, is_ours

    monkeypatch.setattr(ident, "birth_ns", lambda path: None)  # ext4 made with 128-byte inodes
    run, record = _run(tmp_path)
    if ident.generation(run) is None:
        pytest.skip("this file system keeps no generation numbers")
    assert is_ours(run, "distill", "config.json")
    saved = json.loads((run / MARK).read_text())
    shutil.rmtree(run)
    run.mkdir()  # the user's folder, given the deleted run's inode numbers (as ext4 does at once)
    (run / "metrics.jsonl").write_text("the user's\n")
    (run / "config.json").write_text(record)
    (run / MARK).write_text("")
    saved["dir"]["ino"], saved["self"]["ino"] = os.lstat(run).st_ino, os.lstat(run / MARK).st_ino
    (run / MARK).write_text(json.dumps(saved))
    assert not is_ours(run, "distill", "config.json")


def test_a_file_system_that_tells_no_inode_apart_binds_nothing(tmp_path, monkeypatch):
    from dtpshard.core.owned import claim, is_ours

    monkeypatch.setattr(ident, "birth_ns", lambda path: None)
    monkeypatch.setattr(ident, "generation", lambda path: None)
    run, _ = _run(tmp_path)
    (run / "metrics.jsonl").write_text("the user's\n")
    assert not is_ours(run, "distill", "config.json")
    for force in (False, True):
        with pytest.raises(UserError, match="neither birth times nor generation numbers") as e:
            claim(run, "distill", ("config.json", "metrics.jsonl"), "config.json", force=force)
        assert "\n" not in str(e.value)
    assert (run / "metrics.jsonl").read_text() == "the user's\n"


# -- 4. a permuted checkpoint is read by one reader: its shared count and delayed set alike ---------
@pytest.fixture(scope="module")
def partial(tiny_dirs, tmp_path_factory):
    """A partial layout (half the modules delayed) and the checkpoint `permute` made with it."""
    from dtpshard.core.layout import Layout
    from dtpshard.model.checkpoint import open_checkpoint

    root = tmp_path_factory.mktemp("partial-permute")
    model = tiny_dirs["llama"]
    shape = open_checkpoint(model).shape
    lay = Layout.random(shape, devices=2, delay=1, seed=4)
    lay.delayed = tuple(range(0, shape.modules, 2))
    lay.save(root / "half.json")
    assert _main(["permute", str(model), str(root / "half.json"), "--out", str(root / "p")]) == 0
    return {"model": model, "layout": root / "half.json", "permuted": root / "p", "root": root, "lay": lay}


def _main(args):
    from dtpshard.cli import main

    return main(args)


def test_a_permuted_partial_checkpoint_runs_its_layouts_delayed_set(partial):
    import torch

    from dtpshard.model.dtp import DTPModel

    ids = torch.randint(0, 384, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = DTPModel.from_pretrained(partial["model"], layout=partial["layout"])
        got = DTPModel.from_pretrained(partial["permuted"])
        assert got.settings == want.settings and got.settings.delayed == partial["lay"].delayed
        assert (got(ids).logits - want(ids).logits).abs().max() <= 1e-4
        again = DTPModel.from_pretrained(partial["permuted"], layout=partial["layout"])  # never applied twice
        assert (again(ids).logits - want(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("kind", ["permuted", "student"])
def test_permute_refuses_what_is_not_a_dense_model(partial, tmp_path, capsys, kind):
    model = partial["permuted"]
    if kind == "student":
        from dtpshard.model.dtp import DTPModel

        model = tmp_path / "student"
        DTPModel.from_pretrained(partial["model"], layout=partial["layout"]).save_pretrained(model,
                                                                                             source=partial["model"])
    assert _main(["permute", str(model), str(partial["layout"]), "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert ("DTP student" if kind == "student" else "dtpshard permute wrote") in err and err.count("\n") == 1, err
    assert not (tmp_path / "again").exists()


def test_sensitivity_is_never_measured_on_a_permuted_checkpoint(partial, tmp_path, capsys):
    from test_distill import random_docs

    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(random_docs(20, 1)))
    affinity = partial["root"] / "a.safetensors"
    if not affinity.exists():
        assert _main(["affinity", str(partial["model"]), "--out", str(affinity), "--text", str(text), "--blocks", "2",
                      "--seq-len", "16"]) == 0
    capsys.readouterr()
    assert _main(["layout", str(affinity), "--devices", "2", "--out", str(tmp_path / "l.json"), "--delayed", "0.5",
                  "--model", str(partial["permuted"]), "--text", str(text), "--blocks", "2", "--seq-len", "16"]) == 2
    err = capsys.readouterr().err
    assert "dtpshard permute wrote" in err and err.count("\n") == 1, err
    assert not (tmp_path / "l.json").exists()


# -- 6. a layout's co-located fractions are checked as what they measure ------------------------------
@pytest.mark.parametrize("where, bad", [("edge", 1e308), ("edge", -1e308), ("up", 1e308), ("up", 1.5),
                                        ("ratio", 1e308), ("ratio", -0.5)])
def test_a_layouts_fractions_out_of_range_are_one_line(tmp_path, capsys, where, bad):
    from dtpshard.cli import main
    from test_report import make_experiment

    d = make_experiment(tmp_path / "exp")
    path = d / "layouts" / "optimised.json"
    layout = json.loads(path.read_text())
    score = layout["score"]
    if where == "edge":
        score["edges"] = [{"src": 0, "dst": 1, "colocated": bad}]
    elif where == "up":
        score["layers"][0]["up"] = bad
    else:
        score["ratio_to_random"] = bad
    path.write_text(json.dumps(layout))
    assert main(["report", str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optimised.json" in err[0] and "Traceback" not in err[0], err


# -- 5. nothing the native build started outlives it, or leaves its temporaries behind ----------------
def _cxx(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "cxx"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def _gone(pid: int, within: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                if "\nState:\tZ" in f.read():
                    return True  # dead, waiting for its reaper
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_compiler_gets_sigterm_first_and_its_temporaries_stay_in_the_build(tmp_path):
    from test_native import _probe

    seen = tmp_path / "seen"
    cxx = _cxx(tmp_path, f"echo $TMPDIR > {seen}\ntouch $TMPDIR/ccAbc.s\n"
                         f"trap 'echo term >> {seen}; rm -f $TMPDIR/ccAbc.s; exit 1' TERM\nsleep 1000 & wait\n")
    said = _probe(tmp_path, CXX=str(cxx), PROBE_TIMEOUT="6")["said"]
    assert "did not finish within 2 s" in said, said
    tmpdir, *rest = seen.read_text().split()
    assert rest == ["term"]  # it was asked to end, and could clean up after itself
    assert Path(tmpdir).parent == tmp_path / "cache" / "native" and not Path(tmpdir).exists()


def test_a_descendant_holding_stderr_in_a_session_of_its_own_neither_holds_the_build_nor_survives(tmp_path):
    import time

    from test_native import _probe

    pid = tmp_path / "pid"
    cxx = _cxx(tmp_path, f"setsid sh -c 'echo $$ > {pid}; exec sleep 1000' &\n"
                         "sleep 0.5\necho 'error: no' >&2\nexit 1\n")
    t0 = time.monotonic()
    said = _probe(tmp_path, CXX=str(cxx), PROBE_TIMEOUT="300")["said"]  # a bound of 100 s
    assert "failed: error: no" in said and time.monotonic() - t0 < 50, said  # not the bound: half of it, at load 6
    assert _gone(int(pid.read_text()))


def test_a_rank_killed_outright_ends_its_compiler_and_the_compilers_children(tmp_path):
    import signal
    import time

    from test_native import PROBE

    pids = tmp_path / "pids"
    cxx = _cxx(tmp_path, f"sleep 1000 &\necho $$ $! > {pids}\nwait\n")
    env = {**{k: v for k, v in os.environ.items() if k != "DTPSHARD_NATIVE"},
           "DTPSHARD_CACHE": str(tmp_path / "cache"), "CXX": str(cxx)}
    probe = subprocess.Popen([sys.executable, "-c", PROBE], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (pids.is_file() and len(pids.read_text().split()) == 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    probe.send_signal(signal.SIGKILL)
    probe.wait()
    assert all(_gone(int(p)) for p in pids.read_text().split())


def test_serve_env_runs_pip_as_a_child_that_ends_with_it(tmp_path, monkeypatch):
    from dtpshard.core import children
    from dtpshard.serve import env as serve_env

    calls = []
    monkeypatch.setattr(children, "run", lambda cmd, seconds, folder, **kw: calls.append((cmd, folder)) or 0)
    serve_env._pip(Path(sys.executable), "--version", folder=tmp_path)
    assert calls and calls[0][1] == tmp_path and calls[0][0][:3] == [sys.executable, "-m", "pip"]


# -- 7. the small ones -----------------------------------------------------------------------------
def _student_listing(partial, tmp_path: Path, delayed: list[int]) -> Path:
    from dtpshard.model.dtp import DTPModel

    student = tmp_path / "student"
    DTPModel.from_pretrained(partial["model"], layout=partial["layout"]).save_pretrained(student,
                                                                                         source=partial["model"])
    config = json.loads((student / "config.json").read_text())
    config["dtp"]["delayed"] = delayed
    (student / "config.json").write_text(json.dumps(config))
    return student


def test_a_student_listing_every_module_computes_its_own_function(partial, tmp_path, caplog):
    from dtpshard.model.checkpoint import open_checkpoint
    from dtpshard.model.dtp import DTPModel

    modules = open_checkpoint(partial["model"]).shape.modules
    student = _student_listing(partial, tmp_path, list(range(modules)))
    with caplog.at_level("WARNING"):
        model = DTPModel.from_pretrained(student)
    assert model.settings.delayed is None and "another function" not in caplog.text


def test_an_out_of_range_delayed_set_names_the_students_config(partial, tmp_path):
    from dtpshard.model.checkpoint import open_checkpoint
    from dtpshard.model.dtp import DTPModel

    modules = open_checkpoint(partial["model"]).shape.modules
    student = _student_listing(partial, tmp_path, [0, modules + 3])
    with pytest.raises(UserError, match=r"student/config\.json: dtp\.delayed: delayed module \d+ is outside") as e:
        DTPModel.from_pretrained(student)
    assert "\n" not in str(e.value)


def test_a_lock_this_user_may_not_write_is_called_so(tmp_path, monkeypatch):
    from dtpshard.core import lock

    (tmp_path / ".lock").write_text("dtpshard-lock 4000000\n")
    (tmp_path / ".lock").chmod(0o444)
    monkeypatch.setattr(lock.os, "access", lambda *a, **k: False)  # as a user who is not root sees it
    assert "a file this user may not write (mode 444)" in str(lock.not_a_lock(tmp_path / ".lock", tmp_path))


def test_a_recorded_library_without_the_ops_is_built_again_by_the_next_run(tmp_path):
    from dtpshard.transport import native, ops  # noqa: F401 (ops: the schemas the kernels register under)

    if native._compiler() is None:
        pytest.skip("no C++ compiler")
    where = tmp_path / "native"
    where.mkdir(mode=0o700)
    lib = where / "ring-0000000000000000.so"
    (tmp_path / "empty.cpp").write_text("extern \"C\" int nothing() { return 0; }\n")
    subprocess.run([native._compiler(), "-shared", "-fPIC", str(tmp_path / "empty.cpp"), "-o", str(lib)], check=True)
    native._record(lib).write_text(json.dumps({"sha256": native._digest(lib), "lib": ident.identity(lib)}))
    assert native._verified(lib)
    said = native._register(lib, forget=True)
    assert "registers no" in said and "the next run builds it again" in said
    assert not lib.exists() and not native._record(lib).exists()


def test_a_run_records_the_layout_as_it_ran_its_set_included(partial, tmp_path):
    import dataclasses

    from dtpshard.core.layout import Layout
    from test_distill import random_docs

    (tmp_path / "docs.txt").write_text("\n\n".join(random_docs(30, 2)))
    whole = Layout.load(partial["layout"])
    every = dataclasses.replace(whole, delayed=None)
    every.save(tmp_path / "every.json")
    args = ["distill", str(partial["model"]), "--layout", str(tmp_path / "every.json"), "--delayed", "0", "1", "2", "3",
            "--out", str(tmp_path / "run"), "--steps", "1", "--seq-len", "16", "--eval-blocks", "1",
            "--micro-batch", "1", "--grad-accum", "1", "--warmup", "1", "--text", str(tmp_path / "docs.txt"),
            "--eval-text", str(tmp_path / "docs.txt"), "--no-progress", "--device", "cpu"]
    assert _main(args) == 0
    record = json.loads((tmp_path / "run" / "final" / "config.json").read_text())["dtp"]
    assert record["delayed"] == [0, 1, 2, 3]
    assert record["layout_sha256"] == dataclasses.replace(every, delayed=(0, 1, 2, 3)).content_sha256()
    assert record["layout_sha256"] != every.content_sha256()


def test_a_sensitivity_file_a_module_short_names_the_file_and_the_count(partial, tmp_path):
    from dtpshard.core.layout import Layout
    from dtpshard.studies.delayed import study_sensitivity
    from dtpshard.studies.provenance import SENSITIVITY

    lay = Layout.load(partial["layout"])
    modules = lay.model.modules
    entry = {"kl": [0.1] * (modules - 1), "layout_sha256": lay.content_sha256()}
    (tmp_path / SENSITIVITY).write_text(json.dumps({"optimised": entry}))
    with pytest.raises(UserError, match=rf"sensitivity\.json: optimised's 'kl' lists {modules - 1} modules, the "
                                        rf"model has {modules}") as e:
        study_sensitivity(None, partial["model"], tmp_path, "optimised", lay, print)
    assert "\n" not in str(e.value)


def test_a_resume_with_other_steps_says_steps_not_that_the_corpus_changed(partial, tmp_path, capsys):
    from test_distill import random_docs

    (tmp_path / "docs.txt").write_text("\n\n".join(random_docs(30, 2)))

    def args(steps):
        return ["distill", str(partial["model"]), "--out", str(tmp_path / "run"), "--steps", str(steps), "--seq-len",
                "16", "--eval-blocks", "1", "--micro-batch", "1", "--grad-accum", "1", "--warmup", "1", "--text",
                str(tmp_path / "docs.txt"), "--eval-text", str(tmp_path / "docs.txt"), "--no-progress", "--device",
                "cpu"]

    assert _main(args(2)) == 0
    capsys.readouterr()
    code = _main(args(3))
    err = capsys.readouterr().err
    assert code == 2 and "steps 2 (now 3)" in err and "content changed" not in err and "train_data" not in err, err
