"""A run's training blocks, made when a step needs them.

A distillation trains on blocks 0 .. n-1 of `iter_blocks` (shuffled, repeated: a pure function of
the text, the tokenizer, the block length and the seed), n = steps × global batch. `BlockStream`
makes a step's window of them when the step asks, never the whole run first: a run of any length
holds one step's blocks, and a run resumed at step t walks the same stream to block t·G, so it
trains on exactly the blocks the uninterrupted run would (the stream's order does not depend on
where it starts).

The run records the data by `fingerprint`: the SHA-256 of the first FINGERPRINT_BLOCKS blocks (all
of them in a run of at most that many, the same hash as of the whole tensor before this module),
which is bounded work whatever --steps says.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import Any

import torch

from dtpshard.core.errors import UserError
from dtpshard.core.io import short_sha256
from dtpshard.data.blocks import Texts, iter_blocks

FINGERPRINT_BLOCKS = 1 << 12  # blocks hashed into a run's record (a published run has at most 1000)


class BlockStream:
    """Blocks 0 .. n-1 of `iter_blocks(tokenizer, texts, seq_len, seed, shuffle=True, repeat=True)`,
    made a window at a time (`window`); `check` sees every window made (the vocabulary's check)."""

    def __init__(self, tokenizer: Any, texts: Texts, seq_len: int, n: int, seed: int,
                 check: Callable[[torch.Tensor], None] | None = None):
        if n < 1:
            raise UserError(f"blocks={n}: must be at least 1")
        self.n, self.seq_len, self.source = n, seq_len, texts.source
        self._make = lambda: iter_blocks(tokenizer, texts, seq_len, seed, True, True)
        self._check = check
        self._it: Iterator[torch.Tensor] | None = None
        self._pos = 0

    def __len__(self) -> int:
        return self.n

    def window(self, start: int, stop: int) -> torch.Tensor:
        """Blocks start .. stop-1: LongTensor [stop - start, seq_len]. Asked in order (a run's steps),
        each window costs only its own blocks; an earlier one starts the stream again."""
        if not 0 <= start < stop <= self.n:
            raise IndexError(f"blocks {start}..{stop} of {self.n}")
        if self._it is None or start < self._pos:
            self._it, self._pos = self._make(), 0
        self._pos += sum(1 for _ in islice(self._it, start - self._pos))
        got = list(islice(self._it, stop - start))
        self._pos += len(got)
        if self._pos < stop:
            if self._pos == 0:
                raise UserError(f"{self.source}: text is shorter than one block of {self.seq_len} tokens")
            raise UserError(f"{self.source}: only {self._pos} blocks of {self.seq_len} tokens, {stop} needed "
                            "(give more text, fewer blocks or a shorter sequence length)")
        blocks = torch.stack(got)
        if self._check is not None:
            self._check(blocks)
        return blocks

    def windows(self, starts: list[int], size: int) -> Windows:
        """The windows [s, s + size) for s in `starts` (increasing), each made when it is read."""
        return Windows(self, starts, size)

    def chunks(self, size: int = 1024, stop: int | None = None) -> Iterator[torch.Tensor]:
        """Blocks 0 .. stop-1 (default all), `size` at a time."""
        stop = self.n if stop is None else min(stop, self.n)
        for start in range(0, stop, size):
            yield self.window(start, min(start + size, stop))

    def fingerprint(self) -> str:
        """The short SHA-256 (core/io.py) of the first FINGERPRINT_BLOCKS blocks' int64 bytes, in order."""
        h = hashlib.sha256()
        for blocks in self.chunks(stop=FINGERPRINT_BLOCKS):
            h.update(blocks.numpy().tobytes())
        return short_sha256(h)


class Windows(Sequence[torch.Tensor]):
    """A step's micro-batches (`BlockStream.windows`): one micro-batch's blocks held at a time, so a
    step of many micro-batches never holds them all."""

    def __init__(self, stream: BlockStream, starts: list[int], size: int):
        self.stream, self.starts, self.size = stream, starts, size

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
        return self.stream.window(self.starts[i], self.starts[i] + self.size)
