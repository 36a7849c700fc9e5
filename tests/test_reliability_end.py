"""Issue 41's rule that every process ends: a rank whose peer died never blocks in its teardown (the
DDP reducer's gloo group, destroyed there, joins a thread that waits for the interpreter lock), and
no rank outlives its launcher, even one killed outright. The tests wait on what the processes say
(a file, a pid), never on a guessed delay."""
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from dtpshard.core.launch import launch_local, root_cause
from test_launch import _env, cmdline, ended, family


class _Teardown:
    """Stands for a failed run's DDP reducer: destroying it never returns (its gloo thread waits for
    the interpreter lock held by the thread that destroys it)."""

    def __del__(self):
        threading.Event().wait()


def _peer_died(out: str) -> int:
    from dtpshard.core.launch import joined

    joined()  # as a rank in its process group: the launcher gives it its grace, and does not stop it
    Path(out, f"rank{os.environ['RANK']}").touch()
    if os.environ["RANK"] == "1":
        while not Path(out, "rank0").exists():
            time.sleep(0.01)
        os._exit(3)  # dies without a word, as a killed rank does
    while not Path(out, "rank1").exists():  # both ranks in the group, as when a peer dies mid-run (else the
        time.sleep(0.01)  # launcher stops a rank that has not joined yet, which a loaded machine made likely)
    reducer = _Teardown()  # noqa: F841 (held by this frame, as a run's objects are when it fails)
    raise RuntimeError("Connection closed by peer")  # what gloo says to the rank left behind


def test_a_rank_whose_peer_died_ends_without_its_teardown(tmp_path):
    t = time.monotonic()
    exits = launch_local(2, _peer_died, (str(tmp_path),), grace=600, deadline=120)
    took = time.monotonic() - t
    assert took < 60, f"the launcher waited {took:.0f} s for a rank stuck in its teardown"
    assert not exits[0].stopped and exits[0].code == 1, exits  # it ended by itself, with its traceback
    assert root_cause(exits) == "rank 1 of 2 died (exit code 3)"


LAUNCHER = """
import os, sys, time
from pathlib import Path
from dtpshard.core.launch import launch_local

def rank(out):
    Path(out, f"rank{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(300)
    return 0

if __name__ == "__main__":
    launch_local(2, rank, (sys.argv[1],), deadline=600)
"""


def test_no_rank_outlives_a_launcher_killed_outright(tmp_path):
    script = tmp_path / "launch.py"
    script.write_text(LAUNCHER)
    # the launch's temporary directory, which a launcher killed outright cannot remove: under tmp_path
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path)], start_new_session=True,
                         env=_env(tmp_path / "tmp"))
    started = []
    try:
        end = time.monotonic() + 180
        while len(list(tmp_path.glob("rank?"))) < 2:  # both ranks run their body
            assert p.poll() is None and time.monotonic() < end, "the ranks did not start"
            time.sleep(0.05)
        ranks = [psutil.Process(int(f.read_text())) for f in sorted(tmp_path.glob("rank?"))]
        started += family(p.pid)  # the forkserver and the ranks
        p.send_signal(signal.SIGKILL)  # no handler, no cleanup: only the kernel can end the ranks now
        p.wait()
        end = time.monotonic() + 60  # a liveness bound, held at load 6
        while not all(ended(q) for q in started) and time.monotonic() < end:
            time.sleep(0.05)
        assert all(ended(r) for r in ranks), [r.pid for r in ranks if not ended(r)]
        assert all(ended(q) for q in started), [cmdline(q)[:80] for q in started if not ended(q)]
    finally:  # nothing this test started outlives it, whatever the code under test does
        for q in started:
            with contextlib.suppress(psutil.Error):
                q.kill()
        if p.poll() is None:
            p.kill()
