"""The launch and the end of a multi-process run: every rank's process group ends in order (no gloo
thread left for the interpreter's teardown), a launch exits 0 run after run (torchrun and
--nproc), SIGTERM/SIGINT to the launcher end every rank with one line, a rank that cannot start
ends the others at once, and --threads is bounded by the cores."""
import atexit
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from dtpshard import cli
from dtpshard.core.errors import UserError
from dtpshard.core.launch import (
    RankExit,
    check_threads,
    cores,
    launch_local,
    process_group,
    root_cause,
    set_threads,
)
from dtpshard.core.layout import Layout
from dtpshard.model.dtp import DTPModel
from test_distill import args_for, random_docs

ROOT = Path(__file__).resolve().parents[1]
GLOO_THREADS = {"gloo_tcp_loop", "pt_gloo_runloop"}
PROMPT = "import torch"
TORCH_LOG = re.compile(r"(\[rank\d+\]:)?[DIWE]\d{4} \d\d:\d\d:\d\d")  # [rank0]:W1201 23:38:32.296000 ...
TRANSPORT = "dtpshard run: the partials travel over "


def signal_said(err: str) -> list[str]:
    """What a launch printed because of a signal: torch's log lines (a rank compiling as the signal
    came) and the ranks' transport line (printed as generation starts, before or after the signal
    by chance) are the run's own output."""
    return [ln for ln in err.strip().splitlines() if not TORCH_LOG.match(ln) and not ln.startswith(TRANSPORT)]


def _threads() -> list[str]:
    return [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]


def _ended_in_order(model, out, delay, latency):
    """One rank: a forward, then a transfer posted and never taken, left for the end to take."""
    from dtpshard.core.settings import resolve_dtp
    from dtpshard.runtime.ranks import RankModel, check_world

    torch.set_num_threads(1)
    with process_group(timeout=60) as (rank, world):
        ckpt, _ = check_world(model, world)
        net = RankModel(ckpt, rank, resolve_dtp(ckpt.shape, devices=world, delay=delay), timeout=60, latency=latency)
        net(torch.zeros(1, 5, dtype=torch.long))
        net.link.start(torch.ones(4))
        inside = _threads()
    Path(out, f"rank{rank}.txt").write_text(f"{' '.join(inside)}\n{' '.join(_threads())}\n{len(net.link.posted)}")
    return 0


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names from /proc")
@pytest.mark.parametrize("delay, latency", [(0, 0), (1.5, 0.002)])
def test_the_group_ends_with_no_gloo_thread_left(tiny_dirs, tmp_path, delay, latency, monkeypatch):
    monkeypatch.setenv("DTPSHARD_EXCHANGE", "collective")  # the Link's gloo transfers (the ring posts none)
    exits = launch_local(2, _ended_in_order, (str(tiny_dirs["llama"]), str(tmp_path), delay, latency), deadline=120)
    assert [e.code for e in exits] == [0, 0], root_cause(exits)
    for r in range(2):
        inside, after, pending = (tmp_path / f"rank{r}.txt").read_text().split("\n")
        assert GLOO_THREADS <= set(inside.split())  # the names are right: gloo's threads ran inside
        assert not GLOO_THREADS & set(after.split()), after  # and were joined by the end of the group
        assert pending == "0"  # the posted transfer was taken, its work object released


# -- exit 0, run after run -------------------------------------------------------------------------
def _env(tmp: Path | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    if tmp is not None:  # the launcher's temporary directory goes here, where the test can look
        tmp.mkdir(exist_ok=True)
        env["TMPDIR"] = str(short(tmp))
    return env


def short(tmp: Path) -> Path:
    """`tmp` by a short name (a link in /tmp): the forkserver's socket lives under TMPDIR, and a unix
    socket's path holds at most 107 bytes, which pytest-xdist's deeper tmp_path can exceed."""
    import hashlib

    link = Path("/tmp") / f"dtp-{hashlib.sha256(str(tmp).encode()).hexdigest()[:10]}"
    if not link.is_symlink():
        link.symlink_to(tmp)
        atexit.register(link.unlink, missing_ok=True)  # this test process's own link, gone with it
    return link


def _torchrun(model, world):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
            "-m", "dtpshard", "run", str(model), "--delay", "0", "--prompt", PROMPT, "--max-new-tokens", "8"]


def _nproc(model, world):
    return [sys.executable, "-m", "dtpshard", "run", str(model), "--delay", "0", "--prompt", PROMPT,
            "--max-new-tokens", "8", "--nproc", str(world)]


def clean_exits(argv, runs):
    """Run argv `runs` times: each must exit 0, print one line, and abort nothing."""
    t, failed = time.monotonic(), []
    for i in range(runs):
        p = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=300, env=_env())
        lines = p.stdout.strip().splitlines()
        if p.returncode != 0 or len(lines) != 1 or not lines[0].startswith(PROMPT) or "terminate" in p.stderr:
            failed.append((i, p.returncode, p.stderr[-2000:]))
    took = time.monotonic() - t
    print(f"{runs} runs of {' '.join(argv[1:4])}: {runs - len(failed)} exited 0 in {took:.0f} s", file=sys.stderr)
    assert not failed, failed


@pytest.mark.slow  # a soak: five torchrun launches of four ranks each
def test_torchrun_exits_0_run_after_run(tiny_dirs):
    clean_exits(_torchrun(tiny_dirs["llama"], 4), 5)


@pytest.mark.slow
@pytest.mark.parametrize("how", [_torchrun, _nproc])
def test_thirty_launches_exit_0(tiny_dirs, how):
    clean_exits(how(tiny_dirs["llama"], 4), 30)


# -- signals ---------------------------------------------------------------------------------------
def _start(argv, tmp):
    # SIGINT as an interactive shell leaves it: a test run in the background passes it on ignored
    code = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"sys.argv = ['dtpshard', *{[str(a) for a in argv]!r}]; runpy.run_module('dtpshard', run_name='__main__')")
    err = (tmp.parent / "stderr.txt").open("w+")  # a file: what came before the signal can be told apart
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err, text=True,
                            env=_env(tmp), start_new_session=True)


def family(pid, recursive=True):
    """The processes `pid` has started (recursive: theirs too), as they are now: one that ends while
    it is listed or asked about (psutil.NoSuchProcess, ZombieProcess) is left out, as ended."""
    try:
        return psutil.Process(pid).children(recursive=recursive)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []


def cmdline(proc):
    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ""


def ended(proc):
    """Whether proc has ended (a zombie has ended: only its parent's wait is left)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return True


def forkserver_children(pid):
    """The processes the forkserver of launcher `pid` has forked: its ranks."""
    return [c for fs in family(pid, recursive=False) if "forkserver" in cmdline(fs) for c in family(fs.pid, False)]


def _ranks_joined(p, tmp, world, ready, timeout=180):
    """The rank processes, once every rank has joined its process group and ready() holds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert p.poll() is None, p.communicate()
        if len(list(tmp.glob("dtpshard-ranks-*/rank*.joined"))) == world and ready():
            ranks = forkserver_children(p.pid)
            assert len(ranks) == world
            return ranks
        time.sleep(0.1)
    raise AssertionError("the ranks did not join")


def _gone(procs, timeout):
    """Seconds until every process in procs has ended."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if all(ended(q) for q in procs):
            return time.monotonic() - t
        time.sleep(0.02)
    raise AssertionError(f"still running {timeout} s after the signal: {[q.pid for q in procs if not ended(q)]}")


def interrupted(argv, tmp, world, sig, group, ready=lambda: True):
    """Signal the launcher (or, as Ctrl-C does, its whole process group) once its ranks run."""
    p = _start(argv, tmp)
    try:
        ranks = _ranks_joined(p, tmp, world, ready)
        started = family(p.pid)  # the forkserver, the ranks, ...
        before = (tmp.parent / "stderr.txt").stat().st_size  # torch's warnings while training, say
        os.killpg(p.pid, sig) if group else p.send_signal(sig)
        took = _gone(ranks, 60)  # liveness bounds, not speed: they hold at load 6
        p.communicate(timeout=60)
        with (tmp.parent / "stderr.txt").open() as f:
            f.seek(before)
            err = f.read()
    finally:
        if p.poll() is None:
            p.kill()
    print(f"{signal.Signals(sig).name} to the {'group' if group else 'launcher'}: ranks gone in {took:.2f} s",
          file=sys.stderr)
    assert took < 60
    _gone(started, 60)  # nothing the launch started outlives it
    assert not list(tmp.glob("dtpshard-ranks-*"))
    lines = signal_said(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    return p.returncode, lines[0]


# SIGTERM to the launcher alone: also test_reliability_launch's test_sigterm_at_any_moment (by default)
@pytest.mark.parametrize("sig, group", [pytest.param(signal.SIGTERM, False, marks=pytest.mark.slow),
                                        (signal.SIGINT, True)])
def test_run_nproc_ends_every_rank_on_a_signal(tiny_dirs, tmp_path, sig, group):
    argv = ["run", tiny_dirs["llama"], "--prompt", PROMPT, "--nproc", "2", "--latency-ms", "300",
            "--max-new-tokens", "60"]  # a minute of transfers: the signal comes mid-generation
    rc, line = interrupted(argv, tmp_path / "tmp", 2, sig, group)
    assert (rc, line) == ((143, "dtpshard run: terminated") if sig == signal.SIGTERM else
                          (130, "dtpshard run: interrupted"))


@pytest.fixture(scope="module")
def ddp_setup(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("launch_ddp")
    (root / "docs.txt").write_text("\n\n".join(random_docs(300, 1)))
    model = tiny_dirs["qwen3"]
    Layout.random(DTPModel.from_pretrained(model, 1, 0).shape, 2, 1, seed=4).save(root / "layout.json")
    return {"root": root, "model": model, "text": root / "docs.txt", "layout": root / "layout.json"}


@pytest.mark.parametrize("sig, group", [(signal.SIGINT, True),
                                        pytest.param(signal.SIGTERM, False, marks=pytest.mark.slow)])
def test_distill_nproc_ends_every_rank_on_a_signal(ddp_setup, tmp_path, sig, group):
    run = tmp_path / "run"
    argv = args_for(ddp_setup, run, steps=10000, **{"micro-batch": 1, "grad-accum": 1, "checkpoint-every": 2})
    metrics = run / "metrics.jsonl"  # mid-run: the first evaluation written, the first steps compiling
    rc, line = interrupted(argv + ["--nproc", "2"], tmp_path / "tmp", 2, sig, group,
                           lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1)
    assert (rc, line) == ((143, "dtpshard distill: terminated") if sig == signal.SIGTERM else
                          (130, "dtpshard distill: interrupted"))
    assert not (run / ".lock").exists()  # the launcher's lock released
    assert not [x for x in run.iterdir() if ".tmp-" in x.name]  # a checkpoint being written: removed


# -- failures --------------------------------------------------------------------------------------
def _cannot_start(how):
    """Rank 1 fails before it joins; rank 0 would wait 600 s for it in the rendezvous."""
    if os.environ["RANK"] == "1":
        if how == "user":
            raise UserError("rank 1 cannot read its input")
        os._exit(3)
    with process_group(timeout=600):
        pass
    return 0


@pytest.mark.parametrize("how, said", [("user", "rank 1 of 2 failed: rank 1 cannot read its input"),
                                       ("died", "rank 1 of 2 died (exit code 3)")])
def test_a_rank_that_cannot_start_ends_the_others_at_once(how, said, capfd):
    t = time.monotonic()
    exits = launch_local(2, _cannot_start, (how,), grace=600)
    assert time.monotonic() - t < 30
    assert exits[0].stopped and not exits[1].stopped
    assert root_cause(exits) == said
    assert capfd.readouterr().err == ""  # the root cause is the caller's one line; nothing else said


def test_under_torchrun_a_rank_that_cannot_start_does_not_hang(tmp_path):
    script = tmp_path / "cannot_start.py"
    script.write_text("import os, sys\nfrom dtpshard.core.launch import process_group\n"
                      "if os.environ['RANK'] == '1':\n    sys.exit(3)\n"
                      "with process_group(timeout=600):\n    pass\n")
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script)], check=False, capture_output=True, text=True, timeout=300, env=_env())
    assert p.returncode != 0 and time.monotonic() - t < 60, p.stderr[-2000:]


def test_root_cause_skips_the_ranks_the_launcher_stopped():
    exits = [RankExit(0, 143, stopped=True), RankExit(1, 3)]
    assert root_cause(exits) == "rank 1 of 2 died (exit code 3)"
    assert root_cause([RankExit(0, 0), RankExit(1, -9, stopped=True)]) == "rank 1 of 2 died (exit code -9)"


# -- threads ---------------------------------------------------------------------------------------
def test_threads_beyond_the_cores_are_refused(tiny_dirs, capfd):
    limit = 4 * cores()
    check_threads(limit)
    with pytest.raises(UserError, match=rf"--threads {limit + 1}: more than 4 per core"):
        set_threads(limit + 1)
    t = time.monotonic()
    assert cli.main(["run", str(tiny_dirs["llama"]), "--prompt", PROMPT, "--nproc", "2", "--threads", "100000"]) == 2
    err = capfd.readouterr().err.strip()
    assert time.monotonic() - t < 60
    assert len(err.splitlines()) == 1 and re.search(r"--threads 100000: more than 4 per core \(\d+ cores", err), err
