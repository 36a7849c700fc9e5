"""Where and in what precision to run: `--device` and `--dtype` resolved once."""
from __future__ import annotations

import torch

from dtpshard.core.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={device!r} but CUDA is not available")
    return device
