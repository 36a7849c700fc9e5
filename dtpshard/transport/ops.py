"""The shared-memory exchange's torch custom ops (transport/shared.py's ring): what a compiled forward
holds, and the registry of this process's live rings the ops find by key.

Their kernels are the native ones (transport/ring.cpp) where transport/native.py loaded them, else
the ring's Python methods, registered here by `python_kernels`.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

RINGS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()  # key -> this process's live SharedRing

# Defined with torch.library's schema API: a Python kernel costs a few µs less than behind
# torch.library.custom_op's wrapper, and a decode step makes two calls per sum.
# exchange_start is declared to mutate p, which it only reads: what reads p afterwards, the own-
# partial update right behind the module, then runs after the start, so Inductor cannot sink the
# start down to its landing (its locality pass moves a producer to its first user; c10d's in-place
# all_reduce_ is kept in place the same way).
# The *_py ops are transport/shared.py's Python kernels, which the native ones call back for what is rare.
_LIB = torch.library.Library("dtpshard", "DEF")
_LIB.define("exchange_start(Tensor(a!) p, str key) -> Tensor")
_LIB.define("exchange_value(Tensor token, Tensor p, str key) -> Tensor")
_LIB.define("exchange_start_py(Tensor(a!) p, str key) -> Tensor")
_LIB.define("exchange_value_py(Tensor token, Tensor p, str key) -> Tensor")
_LIB.define("exchange_wait_py(str key, int index, int target, int peer, str what) -> ()")


def _start(p: torch.Tensor, key: str) -> torch.Tensor:
    """Publish this rank's partial p to the ring registered as `key` -> the sum's token."""
    return torch.tensor([RINGS[key]._start(p)], dtype=torch.int64)


def _value(token: torch.Tensor, p: torch.Tensor, key: str) -> torch.Tensor:
    """Σ over the ranks of the partials published under `token` (p: this rank's, for shape and dtype)."""
    return RINGS[key]._value(int(token), p)


def _wait(key: str, index: int, target: int, peer: int, what: str) -> None:
    RINGS[key]._wait(index, target, peer, what, profiled=False)


_LIB.impl("exchange_start_py", _start, "CompositeExplicitAutograd")
_LIB.impl("exchange_value_py", _value, "CompositeExplicitAutograd")
_LIB.impl("exchange_wait_py", _wait, "CompositeExplicitAutograd")


@functools.cache
def python_kernels() -> None:
    """Serve the two ops from the Python kernels (where the native kernels are not loaded: transport/native.py)."""
    _LIB.impl("exchange_start", _start, "CompositeExplicitAutograd")
    _LIB.impl("exchange_value", _value, "CompositeExplicitAutograd")


@torch.library.register_fake("dtpshard::exchange_start", lib=_LIB)
def _(p: torch.Tensor, key: str) -> torch.Tensor:
    return p.new_empty((1,), dtype=torch.int64, device="cpu")


@torch.library.register_fake("dtpshard::exchange_value", lib=_LIB)
def _(token: torch.Tensor, p: torch.Tensor, key: str) -> torch.Tensor:
    return torch.empty_like(p)
