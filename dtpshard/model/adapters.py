"""Low-rank adapters over a frozen model (`distill --adapters RANK`): W + (α/r)·B·A per projection.

The update is computed in the one place projections are, ops.device_matmul (ops.low_rank_term),
never formed as a matrix: a projection's memory is its frozen weight, A [r, in], B [out, r] and
[L, N, r] activations. torch.nn.utils.parametrize would hand every matmul W + B·A as a new
[out, in] tensor that autograd keeps for backward: a second copy of every weight
(bench/bench_adapters.py measures both).

B starts at zero, so step 0 is the untrained student exactly; A starts as peft's (Kaiming-uniform,
bound 1/√in), drawn from a generator seeded by the run's seed and the tensor's name, so every
process and every sharding draws the same A. `merged` gives the weights a student is saved with
(W + (α/r)·B·A in fp32), `save` the adapters alone in peft's LoRA layout.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtpshard.core.adapters import (  # noqa: F401 - the settings, defined without torch
    DEFAULT_ALPHA,
    DEFAULT_TARGETS,
    TARGETS,
    AdapterSettings,
    check_adapters,
    projection_shape,
    trainable_count,
)
from dtpshard.model.ops import Proj


class LowRank(nn.Module):
    """One projection's update (α/r)·B·A: A [r, in], B [out, r]. `on` False: the frozen weight alone."""

    def __init__(self, out_features: int, in_features: int, rank: int, scale: float):
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        self.scale, self.on = scale, True

    def delta(self) -> torch.Tensor:
        return (self.B.float() @ self.A.float()) * self.scale


def projections(model: nn.Module, targets: tuple[str, ...]) -> Iterator[tuple[str, Proj]]:
    """(name, Proj) of every adapted projection of a DTPModel, in layer order."""
    for i, layer in enumerate(model.model.layers):
        for t in targets:
            part, proj = TARGETS[t]
            yield f"model.layers.{i}.{part}.{proj}", getattr(getattr(layer, part), proj)


def attach(model: nn.Module, settings: AdapterSettings) -> None:
    """Adapters on the targets of `model` (any device, meta included), everything else frozen.
    A is left to `init_values` (after sharding, each process fills its own rows)."""
    model.requires_grad_(False)
    for _, proj in projections(model, settings.targets):
        out, inp = proj.weight.shape
        with torch.device(proj.weight.device):
            proj.adapter = LowRank(out, inp, settings.rank, settings.scale)
    model.adapters = settings


def initial_A(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A's initial values (fp32, CPU): peft's Kaiming-uniform, bound 1/√in, from (seed, name) alone."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).div_(math.sqrt(shape[1])).float()


def is_adapter(name: str) -> bool:
    return ".adapter." in name


@torch.no_grad()
def init_values(model: nn.Module, seed: int, rows: Callable[[str, int], slice] = lambda name, n: slice(None),
                local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
    """A from `initial_A`, B zero, for every adapter of `model`: the rows `rows(name, len)` of each
    whole tensor into its `local` part (a shard of it)."""
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        part = local(p)
        if name.endswith(".A"):
            part.copy_(initial_A(seed, name, tuple(p.shape))[rows(name, p.shape[0])])
        else:
            part.zero_()


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The frozen weights alone (the teacher of an adapter run), for the duration."""
    adapters = [m for m in model.modules() if isinstance(m, LowRank)]
    for m in adapters:
        m.on = False
    try:
        yield
    finally:
        for m in adapters:
            m.on = True


def merged(params: dict[str, Any], full: Callable[[Any], torch.Tensor],
           scale: float) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> a function giving the saved student's tensor: W + scale·B·A in fp32 for an adapted
    projection, the tensor itself otherwise; no adapter tensor. `full`: a parameter's whole value
    (a sharded one gathered), asked for in the order the saved tensors are written."""
    def of(name: str) -> Callable[[], torch.Tensor]:
        base = name.removesuffix(".weight")
        if f"{base}.adapter.A" not in params:
            return lambda: full(params[name])
        return lambda: full(params[name]).float() + scale * (full(params[f"{base}.adapter.B"]).float()
                                                             @ full(params[f"{base}.adapter.A"]).float())

    return {n: of(n) for n in params if not is_adapter(n)}


def peft_name(name: str) -> str:
    """Our adapter tensor's name in peft's LoRA files (base_model.model.<module>.lora_A.weight)."""
    base, which = name.rsplit(".adapter.", 1)
    return f"base_model.model.{base}.lora_{which}.weight"


def peft_config(settings: AdapterSettings) -> dict[str, Any]:
    """adapter_config.json as peft writes a LoRA's (the keys its LoraConfig reads). Its base is
    the teacher permuted by the run's layout (`dtpshard permute`), which exists nowhere until a
    user makes it: base_model_name_or_path is null, so that peft's auto classes never load the
    teacher as it is (its neurons in another order) and merge onto it; dtpshard.json says what
    the base is."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
            "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": sorted(TARGETS[t][1] for t in settings.targets), "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True}


def save(directory: Path, model: nn.Module, full: Callable[[torch.Tensor], torch.Tensor], write: bool,
         base: dict[str, Any]) -> None:
    """`directory` (atomically): the adapters alone, as peft writes a LoRA (adapter_model.safetensors,
    adapter_config.json), for users who keep them apart from the merged student, and
    dtpshard.json naming their base: the teacher permuted by the layout (`base`: the run's
    teacher, layout and layout_sha256). Every process gathers each tensor (`full`, in the same
    order); the one that `write`s writes."""
    from safetensors.torch import save_file

    from dtpshard.core.io import dumps
    from dtpshard.core.owned import replacing

    tensors = {peft_name(n): full(p).float().contiguous() for n, p in model.named_parameters() if is_adapter(n)}
    if not write:
        return
    with replacing(directory, "distill") as tmp:  # sealed: what --force may remove
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(dumps(peft_config(model.adapters),
                                                       indent=1) + "\n")
        (tmp / "dtpshard.json").write_text(dumps({"base": "the teacher permuted by the layout (dtpshard permute "
                                                  "TEACHER LAYOUT)", **base}, indent=1) + "\n")
