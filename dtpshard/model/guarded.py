"""A tokenizer is data, even when it misbehaves: a panic of the tokenizers library (Rust's, raised
in Python as pyo3's PanicException, a BaseException that no `except Exception` catches; a
normalizer regex that backtracks past Oniguruma's retry limit is one) becomes one line naming
the tokenizer file. Rust's panic hook also writes the panic and a backtrace straight to file
descriptor 2; that is kept out of the one line, and whatever else a call writes there is passed on.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from dtpshard.core.errors import UserError, first_line, quote

GUARDED = ("__call__", "encode", "decode", "batch_decode")  # where a tokenizer runs the Rust code on text
_CLASSES: dict[type, type] = {}


@contextlib.contextmanager
def panics_named(where: str) -> Iterator[None]:
    """A panic inside the block is one UserError naming `where`."""
    sys.stderr.flush()
    saved = os.dup(2)
    panicked = False
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException as e:
            if type(e).__name__ != "PanicException":
                raise
            panicked = True
            raise UserError(f"{where}: the tokenizers library failed on this text ({quote(first_line(e), False)}); "
                            "the tokenizer's rules break on it (a normalizer or pre-tokenizer regex that "
                            "backtracks?)") from None
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not panicked:  # what the call said there (a warning) is not ours to drop
                held.seek(0)
                said = held.read()
                if said:
                    sys.stderr.write(said.decode("utf-8", "replace"))


def _guard(method: Any) -> Any:
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with panics_named(self.dtpshard_source):
            return method(self, *args, **kwargs)
    return call


def guard(tok: Any, where: str) -> Any:
    """`tok`, its text methods (GUARDED) turning a panic into one line naming `where`; still an
    instance of its own class (a subclass of the same name, so save_pretrained records it)."""
    cls = type(tok)
    if cls not in _CLASSES:
        methods = {name: _guard(getattr(cls, name)) for name in GUARDED if hasattr(cls, name)}
        _CLASSES[cls] = type(cls.__name__, (cls,), {**methods, "__module__": cls.__module__})
    tok.__class__ = _CLASSES[cls]
    tok.dtpshard_source = where
    return tok
