"""The built-in offline corpus: English prose from the docstrings of the Python standard library.

Every Python installation ships its standard library as source, so this corpus exists on a fresh
machine with no network and no data files (nothing is committed to the repository). It is built
at run time, deterministically:

- files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, sorted by relative path,
  skipping ``site-packages``/``dist-packages``, test suites (``test``, ``tests``, ``idle_test``)
  and ``__pycache__``;
- per file, the module docstring, then the docstrings of every class and function in source
  order (cleaned by ``ast.get_docstring``), keeping those of at least ``MIN_DOC_CHARS`` characters
  and dropping exact repeats seen earlier in the corpus (e.g. the generated codec modules);
- one document per file: its kept docstrings joined by blank lines.

About 600 documents and 1.7 M characters (~0.4 M tokens) on CPython 3.11. The content depends on
the Python version, so `corpus_source()` names it; a run records that name in its outputs.
Parsing takes a few seconds; the result is cached for the process and on disk (`cache_dir()`).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import platform
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

from dtpshard.core.cache import cache_dir
from dtpshard.core.errors import UserError
from dtpshard.core.io import read_bytes, read_json

MIN_DOC_CHARS = 40
CACHE_VERSION = 1
SOURCE_BYTES = 1 << 24  # one standard-library source file (the largest is ~1 MB)
CACHE_BYTES = 1 << 28  # the parsed corpus, cached (~20 MB)
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _source_files(root: Path) -> list[Path]:
    files = [p for p in root.rglob("*.py") if not (_SKIP_DIRS & set(p.relative_to(root).parts[:-1]))]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _walk_docstrings(body: list[ast.stmt]) -> Iterator[str]:
    """Docstrings of the classes/functions in `body` and below, in source order (statements only)."""
    for node in body:
        if isinstance(node, _DEFS):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc
        for field in ("body", "orelse", "finalbody", "handlers"):
            sub = getattr(node, field, None)
            if isinstance(sub, list) and sub and isinstance(sub[0], (ast.stmt, ast.excepthandler)):
                yield from _walk_docstrings(sub)  # type: ignore[arg-type]


def file_docstrings(path: Path) -> list[str]:
    """The module docstring then every class/function docstring of one file (>= MIN_DOC_CHARS)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarning for odd escapes in old modules
            tree = ast.parse(read_bytes(path, SOURCE_BYTES, "source file"), filename=str(path))
    except (SyntaxError, ValueError, OSError, UnicodeDecodeError, UserError):
        return []
    docs = [ast.get_docstring(tree, clean=True) or ""] + list(_walk_docstrings(tree.body))
    return [d.strip() for d in docs if len(d.strip()) >= MIN_DOC_CHARS]


def build_documents(root: Path) -> list[str]:
    """The corpus of the library under `root`: one document per file, repeats dropped."""
    seen: set[str] = set()
    docs = []
    for path in _source_files(root) if root.is_dir() else []:
        kept = []
        for d in file_docstrings(path):
            if d not in seen:
                seen.add(d)
                kept.append(d)
        if kept:
            docs.append("\n\n".join(kept))
    return docs


def _cache_file(root: Path) -> Path:
    h = hashlib.sha256(f"{CACHE_VERSION}|{platform.python_version()}|{root}|{MIN_DOC_CHARS}".encode())
    for p in _source_files(root) if root.is_dir() else []:
        st = p.stat()
        h.update(f"|{p.relative_to(root).as_posix()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_dir() / f"stdlib-corpus-{h.hexdigest()[:20]}.json"


@functools.lru_cache(maxsize=4)
def stdlib_documents(root: Path | None = None) -> tuple[str, ...]:
    """The corpus: one document (str) per standard-library source file, deterministic order.

    Parsed once per process; also cached on disk (`cache_dir()`, keyed by the Python version and
    the size and mtime of every source file), ignored when unwritable.
    """
    root = stdlib_root() if root is None else root
    cache = _cache_file(root)
    try:
        docs = read_json(cache, "corpus cache", CACHE_BYTES)
        if not (isinstance(docs, list) and all(isinstance(d, str) for d in docs)):
            raise ValueError(cache)  # not what this function writes: parsed again
    except (OSError, ValueError, UserError):
        docs = build_documents(root)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
            tmp.write_text(json.dumps(docs), encoding="utf-8")
            os.replace(tmp, cache)
        except OSError:
            pass
    if not docs:
        raise UserError(f"no Python standard-library sources under {root} for the offline corpus; "
                        "pass --text FILE or --dataset NAME")
    return tuple(docs)


def corpus_source() -> str:
    """A name for the corpus that pins what it contains (the Python version it was read from)."""
    return f"offline:python-stdlib-docstrings/{platform.python_version()}"
