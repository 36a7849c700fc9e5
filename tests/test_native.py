"""The ring's native kernels (transport/native.py, ring.cpp) are optional: where they cannot be
built the Python kernels serve, and the transport line says why. What they compute is tested in
tests/test_shared_exchange.py, under both kernels."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, sys
TIMEOUT = float(os.environ.get("PROBE_TIMEOUT", "300"))
import torch.distributed as dist
from dtpshard.model.delay import schedule
from dtpshard.transport.choose import choose
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    reduce, said = choose(dist.group.WORLD, "probe", schedule(4, 1, 1, "sqrt"), 64, TIMEOUT,
                          collective=lambda: None)
    print(json.dumps({"said": said}))
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
finally:  # a group left to the interpreter's exit can abort it (gloo's threads: SIGABRT)
    dist.destroy_process_group()
# and so, once in about six full runs, could the teardown after it ("terminate called without an
# active exception"): the probe ends as dtpshard's ranks do, flushed, past the interpreter's teardown
sys.stdout.flush()
os._exit(0)
"""


def _probe(tmp_path, **env) -> dict:
    run_env = {k: v for k, v in os.environ.items() if k not in ("CXX", "DTPSHARD_NATIVE")}
    run_env.update(DTPSHARD_CACHE=str(tmp_path / "cache"), **env)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=run_env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cache(tmp_path) -> list[str]:
    where = tmp_path / "cache" / "native"
    return sorted(p.name for p in where.iterdir()) if where.is_dir() else []


def test_without_a_compiler_the_python_kernels_serve_and_say_why(tmp_path):
    res = _probe(tmp_path, PATH=str(tmp_path / "empty"))  # no c++ on the path, no CXX
    assert res["said"].startswith("shared memory"), res
    assert res["said"].endswith("Python kernels: no C++ compiler found (set CXX))"), res
    assert _cache(tmp_path) == []  # its lock removed with the build


def test_a_failed_build_leaves_nothing_and_says_so(tmp_path):
    res = _probe(tmp_path, CXX="false")  # a "compiler" that fails
    assert res["said"].endswith("false failed: no output)"), res
    assert _cache(tmp_path) == []  # no half-written library, no build folder, no lock


def test_the_kernels_are_built_once_and_then_loaded(tmp_path):
    from dtpshard.transport import native

    if native._compiler() is None:
        pytest.skip("no C++ compiler here")
    first = _probe(tmp_path)
    assert first["said"].endswith("native kernels)"), first
    (lib,) = [n for n in _cache(tmp_path) if n.endswith(".so")]
    mtime = (tmp_path / "cache" / "native" / lib).stat().st_mtime_ns
    assert _probe(tmp_path)["said"] == first["said"]
    assert (tmp_path / "cache" / "native" / lib).stat().st_mtime_ns == mtime  # loaded, not rebuilt


@pytest.mark.parametrize("value, said", [("0", "Python kernels: DTPSHARD_NATIVE=0)"),
                                         ("yes", "DTPSHARD_NATIVE='yes': give 1 (the default) or 0")])
def test_the_setting(tmp_path, value, said):
    res = _probe(tmp_path, DTPSHARD_NATIVE=value)
    assert said in json.dumps(res, ensure_ascii=False), res
