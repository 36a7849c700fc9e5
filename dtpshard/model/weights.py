"""A checkpoint's weights checked as data, from the safetensors headers alone, before any is read.

A weight is a floating-point number in a dtype a forward runs in: an integer or bool tensor (a
hand-edited or foreign file) would fail deep inside torch (`state_dict` copies, "isfinite not
implemented"), and a float8 tensor is a quantised weight whose true value needs its scales, which
dtpshard does not apply. Two stored names of one parameter (`model.norm.weight` and `norm.weight`)
would leave the choice to the order of a dict: transformers takes one, dtpshard might take the
other. Each is refused in one line naming the tensor and its file.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dtpshard.core.errors import UserError

WEIGHT_DTYPES = ("F32", "F16", "BF16", "F64")  # safetensors' names of the dtypes a forward runs in
_SCALES = ("_scale_inv", "_scale")  # what FP8 checkpoints store beside a quantised weight


def check_names(where: dict[str, Path], canonical: Callable[[str], str]) -> dict[str, str]:
    """{canonical name: stored name} of every tensor in `where` (stored name -> file); two stored
    names of one parameter are refused."""
    alias: dict[str, str] = {}
    for stored in where:
        name = canonical(stored)
        if name in alias:
            first = alias[name]
            raise UserError(f"{where[stored]}: holds both {first!r} and {stored!r}, two names of the parameter "
                            f"{name!r} (transformers would read one, the other would be ignored); remove one")
        alias[name] = stored
    return alias


def check_dtypes(dtypes: dict[str, str], where: dict[str, Path]) -> None:
    """Refuse a tensor whose stored dtype (safetensors' name) is not a floating-point weight's."""
    for name, dtype in dtypes.items():
        if dtype in WEIGHT_DTYPES:
            continue
        if dtype.startswith(("F8", "F6", "F4")):
            stem = name.removesuffix(".weight")
            scaled = any(f"{stem}.weight{s}" in dtypes or f"{stem}{s}" in dtypes for s in _SCALES)
            how = "with its scales (a quantised checkpoint)" if scaled else "without its scales"
            raise UserError(f"{where[name]}: tensor {name!r} is stored as {dtype} (float8) {how}; dtpshard reads "
                            f"{', '.join(WEIGHT_DTYPES)} weights: dequantise the checkpoint first")
        raise UserError(f"{where[name]}: tensor {name!r} is stored as {dtype}, not floating-point weights "
                        f"({', '.join(WEIGHT_DTYPES)}); the file is damaged or not this model's")
