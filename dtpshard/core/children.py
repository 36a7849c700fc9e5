"""The programs dtpshard starts for long work (the native kernels' compiler, the vLLM environment's
ensurepip and pip), ended whole, however their caller ends.

A child runs under a small supervisor (this module's `supervise`, in a session of its own) with
three things in its environment: TMPDIR, a folder of the caller's (gcc's /tmp/cc* files and pip's
wheel folders land there and go with it), a token that every descendant inherits, and the
caller's pid. The caller waits for the supervisor's exit, which is the program's own, never for
its pipes (a descendant that keeps stderr open no longer holds a build up). Whatever way the work
ends (done, past its bound, an interrupt, SIGTERM), every process carrying the token is sent
SIGTERM, given GRACE seconds to clean up after itself (gcc removes its temporaries on SIGTERM,
not on SIGKILL), then SIGKILL: the token finds a descendant that left the session (setsid) too.
The supervisor has a parent-death signal, so a caller killed outright (SIGKILL: no `finally`
runs) still ends everything it started: `cc1plus` no longer compiles on after its rank died.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

TOKEN, PARENT = "DTPSHARD_CHILD", "DTPSHARD_CHILD_PARENT"
GRACE = 2.0  # seconds between SIGTERM and SIGKILL
NOT_RUN = 127  # the program could not be started (its output says why), as a shell says it


def _marked(token: str) -> list[int]:
    """The pids of this user's processes whose environment carries `token` (this one aside)."""
    found, needle = [], f"{TOKEN}={token}".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in Path(entry.path, "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


def sweep(token: str, grace: float = GRACE) -> None:
    """SIGTERM to every process carrying `token`, then SIGKILL to those still there after `grace`."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        pids = _marked(token)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = _marked(token)
        if not pids:
            return


def supervise() -> None:
    """The supervisor's body (argv: the program): run it, end everything on SIGTERM or the caller's death."""
    import ctypes

    token = os.environ[TOKEN]
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(os.environ[PARENT]):  # the caller died before the line above
        sys.exit(143)

    started: list[subprocess.Popen] = []

    def end(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sweep(token)
        deadline = time.monotonic() + 1  # reaped here, not left a zombie to an init that may never reap it
        for child in started:  # (os.waitpid: Popen.wait's lock is held by the wait this handler interrupts)
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(child.pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
                    time.sleep(0.02)
        os._exit(143)

    signal.signal(signal.SIGTERM, end)
    signal.signal(signal.SIGINT, end)
    try:
        started.append(subprocess.Popen(sys.argv[1:]))
    except OSError as e:
        print(e.strerror or e, file=sys.stderr)
        sys.exit(NOT_RUN)
    sys.exit(started[0].wait())


def run(cmd: list[str], seconds: float | None, folder: Path, *, stderr: Path | None = None,
        on_line: Callable[[str], None] | None = None, cwd: str | None = None) -> int | None:
    """Run `cmd` (TMPDIR: `folder`, which must exist) -> its exit code, or None past `seconds`.
    stdout and stderr go to the file `stderr` (default: discarded), or line by line to `on_line`."""
    token = uuid.uuid4().hex
    env = {**os.environ, "TMPDIR": str(folder), TOKEN: token, PARENT: str(os.getpid())}
    sink = open(stderr, "wb") if stderr is not None else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    out = subprocess.PIPE if on_line is not None else sink
    supervisor = [sys.executable, "-c", "from dtpshard.core.children import supervise; supervise()"]
    reader = None
    try:
        proc = subprocess.Popen([*supervisor, *cmd], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT if on_line is not None else sink, env=env, cwd=cwd,
                                start_new_session=True, text=on_line is not None)
        if on_line is not None:  # a thread reads: the wait below is for the program, not its pipe
            reader = threading.Thread(target=lambda: [on_line(line.rstrip("\n")) for line in proc.stdout],
                                      daemon=True)
            reader.start()
        try:
            return proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if proc.poll() is None:
                proc.terminate()  # the supervisor's own sweep: SIGTERM, the grace, SIGKILL
                try:
                    proc.wait(timeout=GRACE + 5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            sweep(token)  # what left the session, or outlived the supervisor
            if reader is not None:
                reader.join(timeout=5)
    finally:
        if stderr is not None:
            sink.close()
