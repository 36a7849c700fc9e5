"""`dtpshard convert --plan`: each stage's memory per process and its expected time, from the
teacher's config.json alone (no weight, no safetensors header, no text is read).

Memory: the calibration pass's plan (affinity/offload.py: in memory or one layer at a time, the
hidden states it keeps), the optimiser's edge matrices, distillation's plan (training/memory.py),
the student's bytes on disk. Time: each stage's matmul work (counted below from the shapes) at the
rate this machine reaches now for the model's own matmul ([micro-batch tokens, hidden] @ [hidden,
neurons], in the stage's dtype, on random matrices for about a quarter of a second). Real runs also
spend time outside matmuls (norms, softmax, data, the optimiser's assignment) and the machine's load
changes, so the time is an estimate of the order of the run, not a promise.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from dtpshard.affinity.calibrate import CalibrationData, PassSettings
from dtpshard.affinity.file import edges_for_delay
from dtpshard.affinity.offload import default_budget, layer_params, plan
from dtpshard.core.errors import UserError
from dtpshard.core.memory import GIB, size_text
from dtpshard.core.settings import DTPSettings
from dtpshard.core.shape import ModelShape
from dtpshard.training.settings import DistillConfig

MAX_SWEEPS = 20  # the optimiser's default cap (layouts/optimise.py)


@dataclass
class StagePlan:
    """One stage: bytes per process against what it may use, and the expected seconds."""

    stage: str
    memory: int
    available: int
    seconds: float
    how: str  # the stage's own plan, in words
    detail: Any = field(default=None, repr=False)  # distillation's MemoryPlan (its refusal gives advice)

    @property
    def fits(self) -> bool:
        return self.memory <= self.available

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "memory": self.memory, "available": self.available, "fits": self.fits,
                "seconds": self.seconds, "how": self.how}

    def describe(self) -> str:
        time_ = "" if math.isnan(self.seconds) else f", about {_duration(self.seconds)}"
        memory = (f"{size_text(self.memory):>11} of {size_text(self.available):>11} per process, "
                  f"{'fits' if self.fits else 'DOES NOT FIT'}" if self.memory else "no memory beyond the files")
        return f"{self.stage:<13}{memory}{time_}\n             {self.how}"


def _duration(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def matmul_rate(device: str, dtype: str, rows: int, inner: int, cols: int) -> float:
    """Floating-point operations per second on `device` now, of a [rows, inner] @ [inner, cols]
    matmul (the model's own: tokens of a micro-batch, hidden size, neurons)."""
    import torch

    a = torch.randn(rows, inner, dtype=getattr(torch, dtype), device=device)
    b = torch.randn(inner, cols, dtype=getattr(torch, dtype), device=device)
    a @ b  # warm-up
    reps, t0 = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - t0 < 0.25:
        a @ b
        reps += 1
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return 2 * rows * inner * cols * reps / (time.perf_counter() - t0)


def _edge_entries(s: ModelShape, delay: float) -> list[tuple[int, int]]:
    """(units of a, units of b) of every edge δ creates."""
    return [(s.units(a), s.units(b)) for a, b in edges_for_delay(s.modules, delay)]


def calibration_plan(s: ModelShape, data: CalibrationData, run: PassSettings, delay: float, device: str,
                     rate: float | None) -> StagePlan:
    import torch

    tokens = data.blocks * data.seq_len
    budget = int(run.memory_budget * GIB) if run.memory_budget > 0 else default_budget(device)
    dtype = getattr(torch, run.dtype)
    how = plan(s, tokens, delay, dtype, budget, run.offload)
    weights = how.window if how.offload else how.weights + layer_params(s) * dtype.itemsize
    memory = weights + min(how.hidden, how.hidden_budget)  # the rest of the hidden states is spilled to disk
    # per token: the forward (2 per weight), then per edge the folded target rows against each source
    # unit's output: 2·H·2N·hd for a heads -> neurons edge, 2·N·(H + 2G)·hd for neurons -> heads
    rows = {0: s.heads * s.head_dim + 2 * s.kv_groups * s.head_dim, 1: 2 * s.neurons}
    width = {0: s.heads * s.head_dim, 1: s.neurons}
    per_token = 2 * s.layers * s.layer_params() + sum(
        2 * width[a % 2] * rows[b % 2] for a, b in edges_for_delay(s.modules, delay))
    seconds = tokens * per_token / rate if rate else math.nan
    return StagePlan("calibration", memory, budget, seconds, f"affinity pass: {how.describe()}")


def layout_plan(s: ModelShape, dtp: DTPSettings, available: int, rate: float | None) -> StagePlan:
    entries = sum(u * v for u, v in _edge_entries(s, dtp.delay))
    memory = 12 * entries  # the file's float32 and the optimiser's float64 copy
    # each sweep multiplies every edge by a one-hot [units, L] from both ends; three layouts scored
    flops = (2 * MAX_SWEEPS + 3) * 2 * entries * dtp.devices
    seconds = flops / rate if rate else math.nan
    return StagePlan("layout", memory, available, seconds,
                     f"{len(_edge_entries(s, dtp.delay))} edges, at most {MAX_SWEEPS} sweeps; contiguous and "
                     "random scored beside it")


def distill_plan(cfg: DistillConfig, s: ModelShape, world: int, local: int | None, device: str,
                 rate: float | None) -> StagePlan:
    """cfg: resolved (L and δ given)."""
    from dtpshard.training.memory import plan_for

    mem = plan_for(cfg, world, device, local)
    P = s.params()
    per_token = (8 + (2 if cfg.grad_checkpointing else 0)) * P  # the student's forward and backward, the teacher's
    tokens = cfg.steps * cfg.micro_batch * cfg.grad_accum * world * cfg.seq_len
    evals = (cfg.steps // cfg.eval_every + 2) * cfg.eval_blocks * cfg.seq_len
    flops = tokens * per_token + evals * 4 * P
    # local processes share this machine's cores; each GPU is its own
    share = world if device.startswith("cuda") else max(1, world // (local or 1))
    seconds = flops / (rate * share) if rate else math.nan
    return StagePlan("distillation", mem.total, mem.available, seconds,
                     mem.describe().replace("\n", "\n             "), mem)


def student_plan(cfg: DistillConfig, hf_config: Any, s: ModelShape) -> StagePlan:
    from dtpshard.model.hf import resolve_dtype

    dtype = cfg.save_dtype if cfg.save_dtype != "auto" else str(resolve_dtype("auto", hf_config, None))
    size = 2 if "16" in dtype else 4
    return StagePlan("student", 0, 0, 0.0, f"{size_text(s.params() * size)} on disk ({dtype.removeprefix('torch.')}), "
                     "hard links to the run's final/ (no copy)")


def plan_convert(cfg: DistillConfig, data: CalibrationData, run: PassSettings, *, timed: bool) -> list[StagePlan]:
    """Every stage's plan (cfg resolved: L and δ given); `timed`: also measure the matmul rate for
    the expected times."""
    import os

    import psutil

    from dtpshard.core.devices import pick_device
    from dtpshard.core.shape import shape_from_hf_config
    from dtpshard.model.checkpoint import load_hf_config
    from dtpshard.training.precision import resolve_precision

    hf_config = load_hf_config(cfg.teacher)
    s = shape_from_hf_config(hf_config)
    dtp = DTPSettings(cfg.devices, cfg.delay, cfg.stage3)
    device = pick_device(cfg.device)
    world = cfg.plan_world or (cfg.nproc if cfg.nproc > 1 else int(os.environ.get("WORLD_SIZE", "1")))
    local = cfg.nproc if cfg.nproc > 1 and cfg.plan_world is None else None
    train_dtype = "bfloat16" if resolve_precision(cfg.precision, device) == "bf16-mixed" else "float32"
    rows = min(cfg.micro_batch * cfg.seq_len, 4096)
    rates = {d: matmul_rate(device, d, rows, s.hidden, s.neurons) if timed else None for d in {run.dtype, train_dtype}}
    return [calibration_plan(s, data, run, dtp.delay, device, rates[run.dtype]),
            layout_plan(s, dtp, int(psutil.virtual_memory().available), rates[train_dtype]),
            distill_plan(cfg, s, world, local, device, rates[train_dtype]),
            student_plan(cfg, hf_config, s)]


def refuse_unless_fits(plans: list[StagePlan]) -> None:
    """One line for the first stage that cannot fit (distillation's says what would make it fit)."""
    from dtpshard.training.memory import refuse_unless_fits as refuse_distill

    for p in plans:
        if p.fits:
            continue
        if p.detail is not None:
            try:
                refuse_distill(p.detail)
            except UserError as e:
                raise UserError(f"stage {p.stage}: {e}") from None
        raise UserError(f"stage {p.stage}: needs {size_text(p.memory)} per process, more than the "
                        f"{size_text(p.available)} available ({p.how}); see --plan")
