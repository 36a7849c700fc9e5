"""The shared-memory ring's hot path as native code (transport/ring.cpp), built on first use.

The ring's two ops run once each per sum, and a decode step of a small model is a few ms: the
Python kernels (73-95 µs a sum through the dispatcher, profiled in vLLM) cost more than tensor
parallelism's whole all-reduce (23-35 µs); the native ones cost 7-10 µs. ring.cpp implements
the same two ops against the same shared words, and calls back into transport/shared.py for
everything rare, so the ring's rules stay written once.

It is compiled against the running torch by the system's C++ compiler into dtpshard's cache,
once per torch version and source, under a lock (ranks starting together build it once). Where
it cannot be built or loaded (no compiler, a failed build, `DTPSHARD_NATIVE=0`), the Python ring
serves and `why_not()` says why: the transport line every engine prints carries it.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dtpshard.core.errors import UserError
from dtpshard.core.io import cache_dir
from dtpshard.core.reading import read_bytes

SOURCE = Path(__file__).with_name("ring.cpp")
VARIABLE = "DTPSHARD_NATIVE"


def _compiler() -> str | None:
    """$CXX if set (and only it), else the first of c++, g++ and clang++ on the path."""
    if os.environ.get("CXX", "").strip():
        return shutil.which(os.environ["CXX"].split()[0])
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _key(source: bytes) -> str:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return hashlib.sha256(b"|".join([source, torch.__version__.encode(), str(abi).encode(),
                                     sys.version.split()[0].encode()])).hexdigest()[:16]


def _build(cxx: str, out: Path) -> str:
    """Compile ring.cpp into `out` -> "" or the compiler's first error line."""
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [cxx, "-shared", "-fPIC", "-O2", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           *(f"-I{p}" for p in include_paths()), str(SOURCE), "-o", str(out),
           *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{cxx} did not run ({e})"
    if done.returncode:
        lines = [x for x in done.stderr.splitlines() if "error" in x] or done.stderr.splitlines() or ["no output"]
        return f"{cxx} failed: {lines[0][:200]}"
    return ""


def wanted() -> bool:
    """Whether the native kernels are wanted: DTPSHARD_NATIVE 1 (the default) or 0; else one line."""
    setting = os.environ.get(VARIABLE, "1").strip() or "1"
    if setting not in ("0", "1"):
        raise UserError(f"environment variable {VARIABLE}={setting[:40]!r}: give 1 (the default) or 0")
    return setting == "1"


@functools.cache
def why_not() -> str:
    """Load the native ops into this process -> "" if they serve, else why the Python ring does."""
    if not wanted():
        return f"{VARIABLE}=0"
    if sys.platform != "linux":
        return f"built for Linux only, this is {sys.platform}"
    cxx = _compiler()
    source = read_bytes(SOURCE, 1 << 20, "the native ring's source")
    where = cache_dir() / "native"
    lib = where / f"ring-{_key(source)}.so"
    try:
        where.mkdir(parents=True, exist_ok=True)
        with open(where / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released by the OS however this process ends
            if not lib.exists():
                if cxx is None:
                    return (f"CXX={os.environ['CXX'].strip()[:60]!r} not found" if os.environ.get("CXX", "").strip()
                            else "no C++ compiler found (set CXX)")
                with tempfile.TemporaryDirectory(dir=where) as tmp:
                    why = _build(cxx, Path(tmp) / "ring.so")
                    if why:
                        return why
                    os.replace(Path(tmp) / "ring.so", lib)
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as e:  # RuntimeError: torch refused the library's registrations
        return f"could not build or load {lib} ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})"
    return ""
