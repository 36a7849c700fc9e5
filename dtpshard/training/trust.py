"""What a resume trusts: nothing in a run directory is unpickled into arbitrary objects.

A run directory can come from someone else (a copied experiment, a shared filesystem), and
`torch.load(weights_only=False)` or `pickle.load` on its files would run whatever code they name.
So every file a resume reads is opened by one of the loaders below:

- RUN/checkpoint.pt and the FSDP step's run.pt: `torch.load(weights_only=True)`, which builds
  only tensors, numbers, strings and containers. The RNG state is stored in those types
  (`rng_state` in training/recipe.py: numpy's Mersenne Twister key as a tensor, not an ndarray).
- A sharded checkpoint's .metadata (torch.distributed.checkpoint pickles it): `pickle` restricted
  to the dataclasses and enums of torch.distributed.checkpoint's metadata, torch.Size, dtypes and memory formats,
  and builtin containers (`_MetadataUnpickler`); anything else is refused by name.
- Its byte items (the optimizer's non-tensor state): `torch.load(weights_only=True)` instead of
  the default planner's `weights_only=False` (`SafeLoadPlanner`).

A file that fails any of these is refused in one line naming it (`--force` starts the run over).
docs/trust.md says the same for users.
"""
from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from pathlib import Path
from typing import Any

import torch

from dtpshard.core.errors import UserError, first_line
from dtpshard.core.reading import ANY_SIZE, open_regular


def load_state(path: Path, what: str) -> dict[str, Any]:
    """A torch.save'd dict of tensors and plain values, loaded without running code."""
    try:
        with open_regular(path, ANY_SIZE, what) as f:  # the one reader: a FIFO or a device is refused by name
            state = torch.load(f, map_location="cpu", weights_only=True)
    except UserError:
        raise
    except pickle.UnpicklingError as e:  # weights_only names the global it refused
        first = first_line(e, 160)
        raise UserError(f"{path}: refused {what}: it holds more than tensors and plain values ({first}); "
                        "use --force to start over") from None
    except Exception as e:  # a corrupt file comes in many exception types
        raise UserError(f"{path}: unreadable {what} ({type(e).__name__}); use --force to start over") from None
    if not isinstance(state, dict):
        raise UserError(f"{path}: unreadable {what} (a {type(state).__name__}, not a dict); "
                        "use --force to start over")
    return state


_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                     "torch.distributed.checkpoint.planner")  # only their dataclasses and enums
_ALLOWED = {("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"), ("builtins", "frozenset"),
            ("builtins", "slice"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # the checkpoint id
            ("torch.serialization", "_get_layout")}  # torch.strided and the like, by name


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module in _METADATA_MODULES:
            found = super().find_class(module, name)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")


def load_metadata(data: bytes) -> Any:
    return _MetadataUnpickler(io.BytesIO(data)).load()


def safe_reader(path: Path) -> Any:
    """A torch.distributed.checkpoint FileSystemReader whose metadata is read by the restricted
    unpickler (the stock reader calls pickle.load on it)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"  # as torch's writer names it
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as f:
                metadata = load_metadata(f.read())
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def safe_planner() -> Any:
    """The default load planner, with byte items loaded by torch.load(weights_only=True)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()
