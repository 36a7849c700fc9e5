"""A launch's inputs and its end (issue 32): torchrun's environment, --timeout and --nproc are
refused in one line before any work, for every command that takes them; a signal at any moment
of a `--nproc` launch ends it in one line with nothing left behind; and a torchrun launch exits 0
with its result printed, run after run, on a loaded machine."""
import os
import signal
import subprocess
import sys
import time

import pytest

from dtpshard import cli
from dtpshard.core import launch_checks
from dtpshard.core.errors import UserError
from dtpshard.core.launch import launch_local, process_group
from dtpshard.core.launch_checks import PROCS_PER_CORE, RANK_BYTES, check_nproc, cores
from test_launch import PROMPT, _env, cmdline, ended, family, signal_said
from tiny import command_line, save_tiny

TORCHRUN = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return tiny_dirs["llama"]


@pytest.fixture
def docs(tmp_path):
    from test_distill import random_docs

    (tmp_path / "docs.txt").write_text("\n\n".join(random_docs(40, 1)))
    return tmp_path / "docs.txt"


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def commands(model, docs, out):
    """Every command a launch flag reaches: run (as a torchrun rank and with --nproc), distill (and
    its --plan) and convert."""
    train = {"steps": 2, "seq-len": 16, "micro-batch": 1, "grad-accum": 1, "eval-every": 1, "eval-blocks": 1,
             "text": docs, "eval-text": docs}
    return {"run": ["run", str(model), "--prompt", PROMPT],
            "distill": command_line("distill", model, out, train),
            "distill --plan": command_line("distill", model, out, train) + ["--plan"],
            "convert": command_line("convert", model, out, {**train, "devices": 2, "blocks": 1})}


def refused(argv, capfd, *words):
    """argv exits 2 with one line holding every one of `words`, no traceback, and starts nothing."""
    t = time.monotonic()
    assert cli.main([str(a) for a in argv]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    assert time.monotonic() - t < 60
    return err


@pytest.fixture
def nothing_spawned(monkeypatch):
    import dtpshard.core.launch as launch

    monkeypatch.setattr(launch, "forkserver_context", lambda: pytest.fail("the launcher started"))


# -- torchrun's environment ------------------------------------------------------------------------
BAD_ENV = [({"WORLD_SIZE": "zz"}, "WORLD_SIZE='zz' is not an integer"),
           ({"RANK": "zz", "WORLD_SIZE": "2"}, "RANK='zz' is not an integer"),
           ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0': must be >= 1"),
           ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1': must be >= 0"),
           ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is outside WORLD_SIZE=2"),
           ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
           ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not"),
           ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE='x' is not an integer"),
           ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3 is more than WORLD_SIZE=2"),
           ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            "LOCAL_RANK=2 is outside LOCAL_WORLD_SIZE=2"),
           ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "one"}, "LOCAL_RANK='one' is not an integer"),
           ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "99999"}, "MASTER_PORT='99999': must be 1 to 65535"),
           ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": " "}, "MASTER_ADDR is empty")]


@pytest.mark.parametrize("env, said", BAD_ENV, ids=[s.split(" ")[0].split("=")[0] + str(i) for i, (_, s) in
                                                    enumerate(BAD_ENV)])
def test_the_torchrun_environment_is_checked_in_one_place(model, docs, tmp_path, capfd, no_torchrun, nothing_spawned,
                                                          env, said):
    for name, value in env.items():
        no_torchrun.setenv(name, value)
    for argv in commands(model, docs, tmp_path / "out").values():
        refused(argv, capfd, said)
        assert not (tmp_path / "out").exists()  # refused before anything was written


def test_the_environment_reaches_a_rank_in_one_line(model, tmp_path):
    """The issue's case, as a user meets it: a process of its own, not a traceback."""
    env = {**_env(), "WORLD_SIZE": "zz"}
    p = subprocess.run([sys.executable, "-m", "dtpshard", "run", str(model), "--prompt", PROMPT], env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert (p.returncode, p.stderr.strip()) == (2, "dtpshard run: error: environment variable WORLD_SIZE='zz' is "
                                                   "not an integer (the number of ranks)")


def test_a_valid_environment_passes(no_torchrun):
    launch_checks.torchrun_env()  # none set: not a rank
    for name, value in {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        no_torchrun.setenv(name, value)
    assert launch_checks.world_from_env() == (1, 4)


# -- --timeout ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("timeout", ["1e-9", "0.5"])
def test_a_timeout_below_a_second_is_refused_before_any_work(model, docs, tmp_path, capfd, no_torchrun,
                                                             nothing_spawned, timeout):
    runs = commands(model, docs, tmp_path / "out")
    for name, argv in runs.items():
        refused(argv + ["--timeout", timeout] + (["--nproc", "2"] if name == "run" else []), capfd,
                f"--timeout {float(timeout):g}: must be at least 1 s")
        assert not (tmp_path / "out").exists()
    no_torchrun.setenv("RANK", "0")  # a torchrun rank too, before it joins
    no_torchrun.setenv("WORLD_SIZE", "2")
    refused(runs["run"] + ["--timeout", timeout], capfd, "--timeout")
    with pytest.raises(UserError, match="must be at least 1 s"):  # and the process group, for any caller
        with process_group(float(timeout)):
            pass
    assert cli.main(runs["distill --plan"] + ["--timeout", "1"]) == 0  # a second is enough


# -- --nproc -------------------------------------------------------------------------------------------
def test_more_processes_than_the_cores_run_are_refused(model, docs, tmp_path, capfd, no_torchrun, nothing_spawned):
    limit = PROCS_PER_CORE * cores()
    check_nproc(limit)  # the limit itself passes (the memory for it is there)
    for argv in commands(model, docs, tmp_path / "out").values():
        for n in (limit + 1, 1000):
            refused(argv + ["--nproc", str(n)], capfd,
                    f"--nproc {n}: more than {PROCS_PER_CORE} processes per core ({cores()} cores here")
        assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="processes per core"):  # the launcher's own check, for any caller
        launch_local(limit + 1, print)


def test_more_processes_than_the_memory_holds_are_refused(model, docs, tmp_path, capfd, no_torchrun, nothing_spawned):
    no_torchrun.setattr(launch_checks, "available_memory", lambda: RANK_BYTES)  # room for one rank
    for argv in commands(model, docs, tmp_path / "out").values():
        refused(argv + ["--nproc", "2"], capfd, "--nproc 2: 2 x 128.0 MiB per process is more than the 128.0 MiB "
                                                "of memory available (at most 1 processes)")
        assert not (tmp_path / "out").exists()
    # run counts each rank's shard of the weights on top: room for two bare ranks is not enough
    no_torchrun.setattr(launch_checks, "available_memory", lambda: 2 * RANK_BYTES)
    check_nproc(2)
    err = refused(["run", model, "--prompt", PROMPT, "--nproc", "2"], capfd, "--nproc 2: 2 x ")
    assert "x 128.0 MiB per process" not in err  # more than the bare rank


# -- signals -------------------------------------------------------------------------------------------
def _launch(argv, tmp):
    tmp.mkdir(exist_ok=True)
    code = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"sys.argv = ['dtpshard', *{[str(a) for a in argv]!r}]; runpy.run_module('dtpshard', run_name='__main__')")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=_env(tmp), start_new_session=True)


def _forkserver_up(p):
    end = time.monotonic() + 120
    while time.monotonic() < end and p.poll() is None:
        if any("forkserver" in cmdline(c) for c in family(p.pid, recursive=False)):
            return
        time.sleep(0.01)
    err = p.communicate(timeout=60)[1] if p.poll() is not None else ""
    raise AssertionError(f"no forkserver started (the launch ended with {p.returncode}: {err[-2000:]})")


def stopped(model, tmp, sig, group, when):
    """Signal a `run --nproc 2` launch `when` seconds after it starts, or (when="forkserver") as
    soon as its forkserver exists, still importing torch for the ranks -> (exit code, stderr)."""
    argv = ["run", model, "--prompt", PROMPT, "--nproc", "2", "--latency-ms", "300", "--max-new-tokens", "60"]
    p = _launch(argv, tmp)
    seen = []
    try:
        if when == "forkserver":
            _forkserver_up(p)
        else:
            time.sleep(when)
        seen = family(p.pid)
        os.killpg(p.pid, sig) if group else p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    end = time.monotonic() + 30
    while time.monotonic() < end and not all(ended(q) for q in seen):
        time.sleep(0.05)
    assert all(ended(q) for q in seen), [cmdline(q) for q in seen if not ended(q)]  # nothing outlives the launch
    assert not list(tmp.glob("dtpshard-ranks-*"))
    return p.returncode, "\n".join(signal_said(err))


WHEN = [0.1, 0.5, 1, 2, 4, "forkserver"]


@pytest.mark.parametrize("group", [False, True], ids=["launcher", "group"])
@pytest.mark.parametrize("when", WHEN, ids=[str(w) for w in WHEN])
def test_sigterm_at_any_moment_ends_a_launch_in_one_line(model, tmp_path, no_torchrun, when, group):
    rc, err = stopped(model, tmp_path / "tmp", signal.SIGTERM, group, when)
    print(f"SIGTERM {when} to the {'group' if group else 'launcher'}: exit {rc}, {err!r}", file=sys.stderr)
    if rc == -signal.SIGTERM:  # before the CLI runs (the interpreter starting): the default, nothing said
        assert err == "" and when != "forkserver"
    else:
        assert (rc, err) == (143, "dtpshard run: terminated")


@pytest.mark.parametrize("group", [False, True], ids=["launcher", "group"])
def test_sigint_while_the_ranks_start_ends_a_launch_in_one_line(model, tmp_path, no_torchrun, group):
    assert stopped(model, tmp_path / "tmp", signal.SIGINT, group, "forkserver") == (130, "dtpshard run: interrupted")


SIGNAL_IN_TORCHS_IMPORT = """
import importlib.abc, os, signal, sys
from dtpshard.cli import main

class SignalInAutograd(importlib.abc.MetaPathFinder):  # the moment one launch aborted at (std::terminate)
    def find_spec(self, name, path=None, target=None):
        if name == "torch.autograd":
            os.kill(os.getpid(), int(sys.argv[1]))
            print("pending" if int(sys.argv[1]) in signal.sigpending() else "delivered", flush=True)

signal.signal(signal.SIGINT, signal.default_int_handler)  # as a shell's command has it (a test worker ignores it)
sys.meta_path.insert(0, SignalInAutograd())
sys.exit(main(["score", "no-such-model", "no-such-layout"]))
"""


@pytest.mark.parametrize(("sig", "said"), [(signal.SIGTERM, (143, "terminated")),
                                           (signal.SIGINT, (130, "interrupted"))])
def test_a_signal_while_torch_is_imported_waits_for_the_import(sig, said):
    """A signal inside torch's import would be raised inside C++ (autograd's init imports Python
    modules) and abort the process: it waits, pending, until the import is over, and is one line."""
    p = subprocess.run([sys.executable, "-c", SIGNAL_IN_TORCHS_IMPORT, str(int(sig))], capture_output=True,
                       text=True, timeout=120, env=_env())
    assert p.stdout.split() == ["pending"], p.stdout + p.stderr[-2000:]
    assert (p.returncode, p.stderr.strip()) == (said[0], f"dtpshard score: {said[1]}")


# -- the end of a torchrun rank ------------------------------------------------------------------------
def test_a_torchrun_rank_ends_past_the_interpreters_teardown(model, tmp_path):
    """Each rank prints (rank 0), ends its group, and leaves by os._exit after flushing: its
    atexit handlers, run in the teardown where torch aborted, never run; its result is there."""
    script = tmp_path / "rank.py"
    script.write_text("import atexit, os, sys\nfrom pathlib import Path\n"
                      "atexit.register(lambda: Path(sys.argv[2], 'teardown' + os.environ['RANK']).touch())\n"
                      "from dtpshard.cli import main\n"
                      f"sys.exit(main(['run', sys.argv[1], '--prompt', {PROMPT!r}, '--max-new-tokens', '4']))\n")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script), str(model), str(tmp_path)], check=False, capture_output=True, text=True,
                       timeout=300, env=_env())
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 0 and len(lines) == 1 and lines[0].startswith(PROMPT), p.stderr[-2000:]
    assert not list(tmp_path.glob("teardown*"))


def test_a_process_without_a_group_is_not_ended_early():
    from dtpshard.core import launch

    launch.leave(0)  # returns: this test process ended no process group (else pytest itself would end here)


# -- exit 0 under load ---------------------------------------------------------------------------------
def _hog():
    return subprocess.Popen(["nice", "-n", "5", sys.executable, "-c", "while 1: pass"])


@pytest.mark.slow
def test_torchrun_launches_exit_0_on_a_loaded_machine(tiny_dirs, tmp_path):
    """20 torchrun runtime launches (L = 2..4, δ 0 and 1) while two processes load every core: each
    exits 0 with its result printed and aborts nothing (none dies in torch's teardown)."""
    models = {2: tiny_dirs["llama"], 4: tiny_dirs["llama"],
              3: save_tiny(tmp_path / "qwen3", "qwen3", num_key_value_heads=3, num_attention_heads=6,
                           intermediate_size=96)}
    hogs = [_hog() for _ in range(2)]
    failed, runs = [], 20
    try:
        for i in range(runs):
            world, delay = (2, 3, 4)[i % 3], i % 2
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                    "-m", "dtpshard", "run", str(models[world]), "--delay", str(delay), "--prompt", PROMPT,
                    "--max-new-tokens", "8"]
            p = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=600, env=_env())
            lines = p.stdout.strip().splitlines()
            if p.returncode != 0 or len(lines) != 1 or not lines[0].startswith(PROMPT) or "terminate" in p.stderr:
                failed.append((i, world, delay, p.returncode, p.stderr[-3000:]))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    print(f"{runs - len(failed)}/{runs} torchrun launches exited 0 with their result under load", file=sys.stderr)
    assert not failed, failed
