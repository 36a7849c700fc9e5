"""Writing weights as Hugging Face safetensors shards, one tensor at a time.

A checkpoint of a large model is several files (`model-00001-of-0000K.safetensors` ...) and an
index (`model.safetensors.index.json`), split at `max_shard_size` as transformers' save_pretrained
splits them (huggingface_hub's splitter, the same spellings: "5GB", "500MB", "2GiB" or bytes).
Every tensor's name, shape and dtype are known before any of its bytes are, so each file's
header is written first and the tensors are appended as they come: the writer holds one tensor
at a time, whatever the model's size. A sharded student is saved this way by gathering each
tensor in turn on every rank (a collective) while rank 0 writes (training/strategy.py).
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.serialization import split_state_dict_into_shards_factory

from dtpshard.core.errors import UserError
from dtpshard.core.io import dumps, share

INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def parse_size(size: int | str, flag: str = "--max-shard-size") -> int:
    """Bytes of "5GB", "500MB", "2GiB", "1000" (transformers' spellings), refused in one line otherwise."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        n = int(size) if isinstance(size, int) or str(size).strip().isdigit() else convert_file_size_to_int(str(size))
    except ValueError:
        raise UserError(f"{flag} {size!r}: not a size (write e.g. 5GB, 500MB, 2GIB or a number of bytes)") from None
    if n < 1:
        raise UserError(f"{flag} {size!r}: must be at least one byte")
    return n


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def shard_plan(specs: list[TensorSpec], max_shard_size: int) -> dict[str, list[TensorSpec]]:
    """file name -> its tensors, in order: "model.safetensors" alone, or model-0000i-of-0000K files."""
    split = split_state_dict_into_shards_factory({s.name: s for s in specs}, get_storage_size=lambda s: s.nbytes,
                                                 filename_pattern="model{suffix}.safetensors",
                                                 max_shard_size=max_shard_size)
    by_name = {s.name: s for s in specs}
    return {f: [by_name[n] for n in names] for f, names in split.filename_to_tensors.items()}


def _header(specs: list[TensorSpec]) -> bytes:
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for s in specs:
        if s.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{s.name}: dtype {s.dtype} has no safetensors name")
        entries[s.name] = {"dtype": SAFETENSORS_DTYPES[s.dtype], "shape": list(s.shape),
                           "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    head = json.dumps(entries, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(head).to_bytes(8, "little") + head


def write_weights(out_dir: Path, specs: list[TensorSpec], produce: Callable[[TensorSpec], torch.Tensor],
                  max_shard_size: int, write: bool = True) -> list[str]:
    """Write `specs` into out_dir as safetensors shards (+ the index when there are several), each
    tensor asked for with produce(spec) in order and converted to spec.dtype. With write=False the
    tensors are asked for all the same (collectives on the other ranks) and nothing is written.
    Returns the file names."""
    plan = shard_plan(specs, max_shard_size)
    for name, part in plan.items():
        f = open(out_dir / name, "wb") if write else None  # closed below
        try:
            if f is not None:
                f.write(_header(part))
            for s in part:
                t = produce(s)
                if tuple(t.shape) != s.shape:
                    raise ValueError(f"{s.name}: produced shape {list(t.shape)}, expected {list(s.shape)}")
                if f is not None:
                    f.write(t.detach().to("cpu", s.dtype).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                del t
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
        finally:
            if f is not None:
                f.close()
        if write:
            share(out_dir / name, 0o666)
    if write and len(plan) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                 "weight_map": {s.name: name for name, part in plan.items() for s in part}}
        (out_dir / INDEX).write_text(dumps(index, indent=2) + "\n", encoding="utf-8")
    return list(plan)


@dataclass
class Weights:
    """What a checkpoint's weight files hold: each tensor's spec, and how to get it when its turn comes."""

    specs: list[TensorSpec]
    produce: Callable[[TensorSpec], torch.Tensor]

    @classmethod
    def of(cls, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> Weights:
        """A state dict's tensors, floating ones saved in `dtype` (None: as they are)."""
        specs = [TensorSpec(k, tuple(v.shape), dtype if dtype is not None and v.is_floating_point() else v.dtype)
                 for k, v in state_dict.items()]
        return cls(specs, lambda s: state_dict[s.name])

    def without(self, names: set[str]) -> Weights:
        return Weights([s for s in self.specs if s.name not in names], self.produce)
