"""torch.compile for training: when it is used (`--compile auto|on|off`) and where its artifacts live.

Compiling DTPModel fuses what the L residual streams add over the dense model, which is all
elementwise work on [L, B, T, D] tensors: the pre-norms, the own-partial update and the
arrivals' Σ_{j≠l} updates become a few fused kernels per module instead of one pass (and one
temporary) per op. The compile itself takes many steps' time, so inductor's FX-graph and autograd
caches are kept under the dtpshard cache dir: a second run of the same shape loads the compiled
kernels instead of rebuilding them.

`auto` compiles on CUDA always (fused kernels, fewer launches) and on CPU for runs of at least
`AUTO_MIN_STEPS` optimizer steps: on a CPU, where the GEMMs are the step, compiled DTP is about as
fast as eager DTP and what a long run gains is memory (fewer temporaries alive at once), worth a
compile only over many steps. The numbers are bench/bench_model.py's, in docs/benchmarks.md.
"""
from __future__ import annotations

import os

import torch

from dtpshard.core.cache import cache_dir
from dtpshard.core.errors import UserError
from dtpshard.core.vocab import CompileMode  # noqa: F401 - the flag's type, named here too

AUTO_MIN_STEPS = 200  # shorter CPU runs (tests, demos) stay eager: there the compile is a large share of the run


def use_inductor_cache() -> str:
    """Point inductor's on-disk caches at <dtpshard cache>/inductor (unless the user chose a dir)."""
    path = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    import torch._inductor.config as ic

    ic.fx_graph_cache = True  # compiled kernels keyed by graph and shape, reused across processes
    if hasattr(ic, "autograd_cache"):
        ic.autograd_cache = True  # the joint forward/backward graph too
    return path


def want_compile(mode: str | bool, device: str, steps: int | None = None) -> bool:
    """Resolve `--compile` for a training run on `device`."""
    if isinstance(mode, bool):  # a Python caller may pass True/False
        return mode
    if mode not in ("auto", "on", "off"):
        raise UserError(f"--compile {mode!r}: must be auto, on or off")
    if mode != "auto":
        return mode == "on"
    if torch.device(device).type == "cuda":
        return True
    return steps is None or steps >= AUTO_MIN_STEPS


def compile_module(module: torch.nn.Module) -> torch.nn.Module:
    """torch.compile with static shapes (training blocks all have one shape) and the disk cache."""
    use_inductor_cache()
    return torch.compile(module, dynamic=False)
