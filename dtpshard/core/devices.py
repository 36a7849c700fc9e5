"""Where and in what precision to run: `--device` and `--dtype` resolved once."""
from __future__ import annotations

from typing import Any

import torch

from dtpshard.core.errors import UserError

# the one table of dtype names: flags, config.json's dtype, a student's save dtype, the teacher cache
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """DTYPES' name of a torch dtype (float32, bfloat16, float16)."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def config_dtype(config: Any) -> Any:
    """The dtype a config.json names (a dict or a transformers config): `dtype`, else the older
    `torch_dtype`; None if neither. The one reading of that key."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    return get("dtype") or get("torch_dtype")


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={device!r} but CUDA is not available")
    return device
