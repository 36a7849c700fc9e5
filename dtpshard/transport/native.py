"""The shared-memory ring's hot path as native code (transport/ring.cpp), built on first use.

The ring's two ops run once each per sum, and a decode step of a small model is a few ms: the
Python kernels (73-95 µs a sum through the dispatcher, profiled in vLLM) cost more than tensor
parallelism's whole all-reduce (23-35 µs); the native ones cost 7-10 µs. ring.cpp implements
the same two ops against the same shared words, and calls back into transport/shared.py for
everything rare, so the ring's rules stay written once.

It is compiled against the running torch by the system's C++ compiler into dtpshard's cache,
once per torch version and source, under the cache's lock (core/lock.py: ranks starting together
build it once). The cache is data, checked before it is trusted as a checkpoint is: its folder
must be this user's, absolute and written by no one else (core/cache.py `private_dir`), and a library
is loaded only when its SHA-256 and its inode's identity are the ones recorded beside it
(`ring-KEY.so.sha256`) when this code built it: a folder copied in, record and all, brings other
inodes (core/identity.py). Anything else is built again. A build is bounded in time (a third of the run's
`--timeout`, at most BUILD_SECONDS) and its compiler runs under core/children.py: its temporaries
in the build's own folder, and it and everything it started ended (SIGTERM, then SIGKILL) on a
timeout, an interrupt or the rank's death; the build folder is named and removed as every other
temporary (core/temporary.py). Where the kernels cannot be built or loaded (no
compiler, a failed or timed-out build, `DTPSHARD_NATIVE=0`, a cache folder others may write), the
Python ring serves and `why_not()` says why: the transport line every engine prints carries it.
torch.utils.cpp_extension's builder is not used: it bounds no build in time and loads what its
cache holds without a check.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import torch

from dtpshard.core import children
from dtpshard.core.cache import cache_dir, private_dir
from dtpshard.core.errors import UserError
from dtpshard.core.identity import identity, same
from dtpshard.core.io import atomic_write_text, file_sha256, remove_stale_temporaries
from dtpshard.core.lock import LOCK, acquire, release
from dtpshard.core.reading import read_bytes
from dtpshard.core.signals import exit_on_sigterm
from dtpshard.core.temporary import temporary_name

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


BUILD_SECONDS = 300.0  # a build's bound when the run's own timeout is longer (a cold build takes ~40 s)
OPS = ("exchange_attach", "exchange_detach")  # defined by ring.cpp alone (transport/ops.py defines the others)


def _build(cxx: str, out: Path, seconds: float) -> str:
    """Compile ring.cpp into `out` within `seconds` -> "" or why not (the compiler's first error line).
    The compiler runs under core/children.py: its temporaries in out's folder (the build's own), and
    it and everything it started ended, SIGTERM first, however the build ends."""
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [cxx, "-shared", "-fPIC", "-O2", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           *(f"-I{p}" for p in include_paths()), str(SOURCE), "-o", str(out),
           *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu"]
    log = out.with_name("compiler.log")
    code = children.run(cmd, seconds, out.parent, stderr=log)
    if code is None:
        return f"{cxx} did not finish within {seconds:.3g} s (the build is bounded by the run's --timeout)"
    err = read_bytes(log, 1 << 20, "the compiler's output") if log.is_file() else b""
    text = err.decode("utf-8", errors="replace")  # a compiler's messages in any encoding are still a reason
    if code == children.NOT_RUN:
        return f"{cxx} did not run ({text.strip()[:200]})"
    if code:
        lines = [x for x in text.splitlines() if "error" in x] or text.splitlines() or ["no output"]
        return f"{cxx} failed: {lines[0][:200]}"
    return ""


def _digest(lib: Path) -> str:
    """The SHA-256 of the regular file `lib` (no link followed, no FIFO waited on)."""
    return file_sha256(lib)


def _record(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _verified(lib: Path) -> bool:
    """Whether `lib` is what this code built: a regular file of this user with one link, whose
    SHA-256 and identity (inode, birth time, generation: core/identity.py) are the ones recorded
    beside it after the build. The identity is what a copied folder cannot bring: a library shipped
    with a record of its own bytes is another inode than the one the record names."""
    try:
        st = os.lstat(lib)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
            return False
        want = json.loads(read_bytes(_record(lib), 1024, "the native library's record"))
        return isinstance(want, dict) and same(want.get("lib"), lib) and want.get("sha256") == _digest(lib)
    except (OSError, UserError, ValueError):
        return False


def wanted() -> bool:
    """Whether the native kernels are wanted: DTPSHARD_NATIVE 1 (the default) or 0; else one line."""
    setting = os.environ.get(VARIABLE, "1").strip() or "1"
    if setting not in ("0", "1"):
        raise UserError(f"environment variable {VARIABLE}={setting[:40]!r}: give 1 (the default) or 0")
    return setting == "1"


def _forget_old_lock(path: Path) -> None:
    """dtpshard before core/lock.py's rule left an empty `.lock` in this folder, which is its own
    (private_dir checked it): that one, empty, of this user, with one link, is removed so the lock
    can be made anew; anything else at the name is left to core/lock.py to refuse."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_size == 0 and st.st_nlink == 1 and st.st_uid == os.geteuid():
            os.unlink(path)


_LOADED: list[str] = []  # the one answer of this process (a library is loaded once)


def why_not(timeout: float = BUILD_SECONDS * 3) -> str:
    """Load the native ops into this process -> "" if they serve, else why the Python ring does.
    `timeout`: the run's own; a build (and a wait for another process's) takes at most a third."""
    if not _LOADED:
        _LOADED.append(_load(min(BUILD_SECONDS, max(1.0, timeout / 3))))
    return _LOADED[0]


def _load(seconds: float) -> str:
    if not wanted():
        return f"{VARIABLE}=0"
    if sys.platform != "linux":
        return f"built for Linux only, this is {sys.platform}"
    cxx = _compiler()
    source = read_bytes(SOURCE, 1 << 20, "the native ring's source")
    try:
        where = cache_dir() / "native"
    except UserError as e:  # the CLI refuses it before any work; an engine's rank (vLLM) says it here
        return str(e)
    lib = where / f"ring-{_key(source)}.so"
    unsafe = private_dir(where)
    if unsafe:
        return f"the cache is not safe to run code from: {unsafe}"
    if _verified(lib):  # built before: loaded without the lock, which only a build needs (its wait is bounded)
        return _register(lib, forget=True)
    _forget_old_lock(where / LOCK)
    try:
        fd = acquire(where / LOCK, where, wait=seconds)
    except UserError as e:
        return str(e)
    try:
        if not _verified(lib):
            if os.path.lexists(lib) and not os.path.isfile(lib) or os.path.islink(lib):
                return f"{lib} is not a regular file; remove it to build the native kernels"
            if cxx is None:
                return (f"CXX={os.environ['CXX'].strip()[:60]!r} not found" if os.environ.get("CXX", "").strip()
                        else "no C++ compiler found (set CXX)")
            remove_stale_temporaries(lib)  # the build folders of builds killed outright
            with exit_on_sigterm():
                tmp = Path(tempfile.mkdtemp(prefix=temporary_name(lib.name, "-"), dir=where))
                try:
                    why = _build(cxx, tmp / "ring.so", seconds)
                    if why:
                        return why
                    os.replace(tmp / "ring.so", lib)  # a rename keeps the inode the record names
                    atomic_write_text(_record(lib), json.dumps({"sha256": _digest(lib), "lib": identity(lib)}) + "\n")
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
            if not _verified(lib):
                return f"{lib} is not what was just built (changed meanwhile)"
    except OSError as e:
        return f"could not build {lib} ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})"
    finally:
        release(where / LOCK, fd)
    return _register(lib)


def _register(lib: Path, forget: bool = False) -> str:
    """Load the verified library's ops into this process -> "" if they serve, else why not. A library
    that registers no ops is this code's own build gone wrong: with `forget`, it and its record are
    removed, so the next process builds it again (this one cannot: a path once loaded stays loaded)."""
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as e:  # RuntimeError: torch refused the library's registrations
        return f"could not load {lib} ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})"
    missing = [op for op in OPS if not hasattr(torch.ops.dtpshard, op)]
    missing += [op for op in ("exchange_start", "exchange_value")
                if not torch._C._dispatch_has_kernel_for_dispatch_key(f"dtpshard::{op}", "CompositeExplicitAutograd")]
    if missing:
        if forget:
            for p in (_record(lib), lib):
                with contextlib.suppress(OSError):
                    p.unlink()
        return (f"{lib} loaded but registers no {missing[0]} op (a library of another source?)"
                + ("; removed, the next run builds it again" if forget else ""))
    return ""
