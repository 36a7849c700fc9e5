"""The affinity pass when the model or its calibration states do not fit in memory.

The pass visits the modules in order. At module b it needs the weights of b's layer
(`StreamedDense` reads one layer at a time from the checkpoint, see model/dense.py), and for each
edge (a, b) the source's output weight (o_proj or down_proj) and its outputs on every
calibration token, kept since a ran (at most ⌈δ⌉ + 1 sources at once), plus the residual stream
of every calibration token. `HiddenStates` holds those [blocks, ...] arrays: in memory while
they fit a byte budget, the rest in anonymous temporary files, read and written a micro-batch at
a time. `plan` decides from the shapes alone whether to stream the model and how many bytes the
hidden states may keep in memory.
"""
from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from dtpshard.core.memory import size_text
from dtpshard.core.shape import ModelShape

DEFAULT_BUDGET_FRACTION = 0.8  # of the memory available when the pass starts


class MemoryArray:
    """A [B, ...] array in memory; `read` gives views, so `write` of a view of itself is free."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.t = torch.empty(shape, dtype=dtype, device=device)
        self.nbytes = self.t.numel() * self.t.element_size()

    def read(self, b0: int, b1: int) -> torch.Tensor:
        return self.t[b0:b1]

    def write(self, b0: int, x: torch.Tensor) -> None:
        dst = self.t[b0:b0 + x.shape[0]]
        if dst.data_ptr() != x.data_ptr():
            dst.copy_(x)

    def close(self) -> None:
        del self.t


class DiskArray:
    """A [B, ...] array in an anonymous temporary file (gone when closed, or when the process dies).

    Explicit reads and writes rather than a memory map: mapped pages count as the process's
    resident memory until the kernel chooses to evict them, which is the memory this avoids.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, directory: Path | None):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.row = math.prod(shape[1:]) * dtype.itemsize
        self.nbytes = shape[0] * self.row
        self.file = tempfile.TemporaryFile(dir=directory)

    def read(self, b0: int, b1: int) -> torch.Tensor:
        b1 = min(b1, self.shape[0])
        out = torch.empty((b1 - b0,) + self.shape[1:], dtype=self.dtype)
        buf, done = _bytes(out), 0
        while done < len(buf):
            got = os.preadv(self.file.fileno(), [buf[done:]], b0 * self.row + done)
            if got <= 0:
                raise OSError(f"spilled hidden states: short read at block {b0}")
            done += got
        return out.to(self.device)

    def write(self, b0: int, x: torch.Tensor) -> None:
        buf, done = _bytes(x.detach().to("cpu").contiguous()), 0
        while done < len(buf):
            done += os.pwrite(self.file.fileno(), buf[done:], b0 * self.row + done)

    def close(self) -> None:
        self.file.close()


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(-1).view(torch.uint8).numpy())


class HiddenStates:
    """Allocates the pass's [blocks, ...] arrays: in memory up to `budget` bytes, then on disk."""

    def __init__(self, budget: float = math.inf, spill_dir: Path | None = None):
        self.budget, self.spill_dir = budget, spill_dir
        self.in_memory = 0  # bytes held in memory now
        self.spilled = 0  # bytes ever written to disk

    def new(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> MemoryArray | DiskArray:
        nbytes = math.prod(shape) * dtype.itemsize
        if self.in_memory + nbytes <= self.budget:
            self.in_memory += nbytes
            return MemoryArray(shape, dtype, device)
        self.spilled += nbytes
        return DiskArray(shape, dtype, device, self.spill_dir)

    def free(self, array: MemoryArray | DiskArray) -> None:
        if isinstance(array, MemoryArray):
            self.in_memory -= array.nbytes
        array.close()


def layer_params(s: ModelShape) -> int:
    attention = s.hidden * (s.heads + 2 * s.kv_groups) * s.head_dim + s.heads * s.head_dim * s.hidden
    return attention + 3 * s.neurons * s.hidden


@dataclass(frozen=True)
class Plan:
    """Bytes, estimated from the shapes: the estimates the decision was made on, for the log line."""

    offload: bool
    budget: int
    weights: int  # the whole model in the compute dtype (the in-memory pass)
    window: int  # what the streamed pass holds of the weights at once
    hidden: int  # the calibration hidden states at their peak
    hidden_budget: int  # of which may stay in memory; the rest is spilled to disk

    def describe(self) -> str:
        how = f"one layer at a time (about {size_text(self.window)} of weights)" if self.offload \
            else f"whole model in memory ({size_text(self.weights)})"
        spill = "in memory" if self.hidden <= self.hidden_budget else \
            f"{size_text(self.hidden - self.hidden_budget)} of {size_text(self.hidden)} spilled to disk"
        return f"{how}; calibration hidden states {spill}; budget {size_text(self.budget)}"


def plan(s: ModelShape, tokens: int, delay: float, dtype: torch.dtype, budget: int,
         offload: bool | None = None) -> Plan:
    """Stream the model (offload None: only when the in-memory pass would not fit `budget` bytes)."""
    size = dtype.itemsize
    layer = layer_params(s) * size
    weights = (s.layers * layer_params(s) + s.vocab * s.hidden * (1 if s.tied else 2)) * size
    kept = math.ceil(delay) + 1  # source outputs alive at once: those of b-δ..b-1 and b's own
    hidden = tokens * (s.hidden + kept * max(s.heads * s.head_dim, s.neurons)) * size
    # streamed: the layer being read and its float copy, the scorers' folded weights (about one
    # more layer) and the output weights of the ⌈δ⌉ modules before
    window = 3 * layer + math.ceil(delay) * s.hidden * max(s.heads * s.head_dim, s.neurons) * size
    if offload is None:
        offload = weights + layer + hidden > budget
    hidden_budget = max(0, budget - (window if offload else weights + layer))
    return Plan(offload, budget, weights, window, hidden, hidden_budget)


def default_budget(device: str) -> int:
    """DEFAULT_BUDGET_FRACTION of the memory available now: the GPU's free memory, or the RAM's."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(DEFAULT_BUDGET_FRACTION * free)
    return int(DEFAULT_BUDGET_FRACTION * psutil.virtual_memory().available)
