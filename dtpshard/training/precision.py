"""The numeric precision of training and evaluation (`--precision`), resolved in one place.

fp32: everything in fp32. bf16-mixed: weights and activations in bf16 for the forward and backward,
fp32 master weights, optimizer state and gradient reduction (FSDP2's MixedPrecisionPolicy when
sharded, torch.autocast otherwise); losses and softmaxes are fp32 either way (losses.py). auto is
bf16-mixed on CUDA and fp32 on the CPU, where bf16 matmuls are not faster.
"""
from __future__ import annotations

import contextlib

import torch

from dtpshard.training.settings import Precision  # noqa: F401 - the flag's type, defined with the settings


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """"fp32" or "bf16-mixed" for this run's device."""
    if precision == "auto":
        return "bf16-mixed" if torch.device(device).type == "cuda" else "fp32"
    return precision


def autocast_for(device: torch.device | str, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast under bf16-mixed (on any device), nothing under fp32."""
    if resolve_precision(precision, device) == "bf16-mixed":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def param_dtype(precision: str, frozen: bool) -> torch.dtype:
    """The dtype a model's weights are held in: a forward-only (frozen) model in bf16 under
    bf16-mixed, which halves it; trained weights are fp32 masters always."""
    return torch.bfloat16 if frozen and precision == "bf16-mixed" else torch.float32
