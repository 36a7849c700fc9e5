"""No result from numbers that are not numbers: NaN or infinite logits are refused in one line that
names the config field most likely at fault, as `eval` refuses a NaN metric (core/errors.py
check_result). `generate` and `run` check every step's logits (model/decode.py); a server checks
its first forward with the same function.

Which field: a model whose numbers overflow was almost always given a multiplier, a scaling, a
norm epsilon or a rope base far from any model's, so the field whose value lies farthest (by
orders of magnitude) from its usual one is named; with none of them unusual, the weights are.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from dtpshard.core.errors import UserError, quote

# a usual value of each field that scales the model's numbers (Granite's multipliers, Phi-3's factor)
USUAL = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 0.1,
         "logits_scaling": 1.0, "partial_rotary_factor": 1.0, "rms_norm_eps": 1e-6, "rope_theta": 1e4}
_UNUSUAL = 2.0  # orders of magnitude from the usual value before a field is suspected


def _value(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def likeliest_cause(config: Any) -> str:
    """The config field most likely to have made the numbers overflow, in words for a refusal."""
    worst, far = None, _UNUSUAL
    for key, usual in USUAL.items():
        v = _value(config, key) if config is not None else None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        distance = math.inf if not math.isfinite(v) or v <= 0 else abs(math.log10(v / usual))
        if distance > far:
            worst, far = f"config.json's {key}={quote(v)}", distance
    return worst or "the weights (no config.json multiplier, epsilon or rope base is out of the ordinary)"


def check_logits(logits: torch.Tensor, config: Any, where: str = "the model") -> None:
    """Refuse NaN or infinite `logits` in one line naming the likeliest cause; nothing is reported."""
    if bool(torch.isfinite(logits).all()):
        return
    bad = "NaN" if bool(torch.isnan(logits).any()) else "infinite"
    raise UserError(f"{where}: its logits are {bad} (likeliest cause: {likeliest_cause(config)}); "
                    "no tokens reported")
