"""vLLM's OpenAI server serves a DTP student as `dtpshard convert` prints the command: the same
tokens as DTPModel.generate, and a TP size other than the student's L refused at the command line
in one line. The server's shared-memory segments are removed after it (vLLM leaves them named)."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dtpshard.serve.env import runtime_env
from test_vllm import NEW, PYTHON, REFUSED, SERVED, make_student, prompts, pytestmark, reference  # noqa: F401
from vllm_driver import mapped_segments, own_sockets, remove


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@contextlib.contextmanager
def serving(line: str, log: Path):
    """The server started by the shell `line` (its output in `log`) -> (the process, the segments it
    mapped, filled at the end). Stopped at the end, and what vLLM leaves named removed: its
    shared-memory segments and its sockets (own_sockets)."""
    made: set[Path] = set()
    with own_sockets(os.environ) as env, log.open("w") as out:
        server = subprocess.Popen(["bash", "-c", line], stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            yield server, made
        finally:
            made |= mapped_segments(server.pid)
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
            remove(made)


def test_vllm_server_completions(tmp_path_factory):
    """The command `dtpshard convert` prints for vLLM's CPU build (model/student.py
    serving_commands), run as printed, in vLLM's default mode, serves /v1/completions on 127.0.0.1
    with DTPModel.generate's tokens for a batch of prompts."""
    from dtpshard.model.student import serving_commands

    root = tmp_path_factory.mktemp("vllm-server")
    student = make_student(root, SERVED)
    batch = prompts(4)
    port = free_port()
    command = serving_commands(student, SERVED[1], SERVED[3], python=sys.executable)["vllm_cpu"]
    line = f"exec env {command} --host 127.0.0.1 --port {port} --max-model-len 256"
    with serving(line, root / "server.log") as (server, made):
        deadline = time.monotonic() + 1200
        while True:
            assert server.poll() is None, (root / "server.log").read_text()[-6000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the vLLM server did not come up"
                time.sleep(3)
        answer = post(f"http://127.0.0.1:{port}/v1/completions",
                      {"model": str(student), "prompt": batch, "max_tokens": NEW, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True})
    assert made, "the server's shared-memory segments were not found (so none was removed)"
    got = [c["token_ids"] for c in sorted(answer["choices"], key=lambda c: c["index"])]
    assert got == reference(student, batch)[0]


@pytest.mark.parametrize("how", ["api_server", "vllm serve"])
def test_server_refuses_other_tp_in_one_line(tmp_path, how):
    """TP 1 for an L = 2 student, at the command line: exit code 2, one line saying why, no traceback
    (vLLM wraps the refusal in pydantic's; the plugin prints just its line). `vllm serve` runs in
    the CPU build's environment too (serve/env.py)."""
    student = make_student(tmp_path, REFUSED[0])
    cmd = ([str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(student)] if how == "api_server"
           else [str(PYTHON.parent / "vllm"), "serve", str(student)])
    with own_sockets(runtime_env()) as env:
        done = subprocess.run([*cmd, "--tensor-parallel-size", "1", "--dtype", "float32", "--port", str(free_port())],
                              env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-4000:]
    assert "Traceback" not in done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert line == ("error: this DTP student runs on L = 2 devices: serve it with --tensor-parallel-size 2 (not 1)")
