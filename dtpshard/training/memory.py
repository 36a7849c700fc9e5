"""Memory per process: planned from config.json before anything is loaded, measured while a run runs.

`plan_memory` adds up, per process, the parts of a distillation: the teacher's and the student's
weights, the gradients, AdamW's two moments, the activations of one micro-batch, the collectives'
buffers and the process itself. Weights, gradients and optimizer state follow from the shape and
the strategy (replicated: all of them on every process; --fsdp: 1/K, plus the FSDP groups gathered
at a time). The activations are not a hand-kept formula: the student's forward is traced on fake
tensors (no memory, no data) and what autograd saves for backward is added up, with and without
gradient checkpointing, so the plan follows the model code. A run that cannot fit is refused
before loading, with what would make it fit (`advice`).

`PhasePeaks` measures each phase's peak (setup, training, saving): the peak resident set on the
CPU (Linux's VmHWM, reset between phases), the allocator's peak on CUDA. Every run writes both to
RUN/memory.json. The plan counts live tensors; a CPU's resident set also holds what glibc's malloc
keeps after a free (its mmap threshold rises to the largest block freed, so later blocks up to
32 MB come from a heap it does not hand back). At SmolLM2 scale a checkpointed forward leaves
80 MB of tensors live and 760 MB more resident (90 MB with MALLOC_MMAP_THRESHOLD_=131072, which
costs 30-46% more time a step); checkpointed CPU runs there measure 1.45-1.53x their plan.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dtpshard.core.adapters import DEFAULT_TARGETS, AdapterSettings, trainable_count
from dtpshard.core.errors import UserError
from dtpshard.core.io import atomic_write_text, dumps
from dtpshard.core.layout import Layout, permuted_layout
from dtpshard.core.memory import size_text
from dtpshard.core.reading import read_text
from dtpshard.core.settings import DTPSettings
from dtpshard.core.shape import ModelShape, shape_from_hf_config
from dtpshard.model.adapters import attach
from dtpshard.model.checkpoint import load_hf_config
from dtpshard.model.decoder import checkpoint_segment
from dtpshard.model.dtp import DTPModel
from dtpshard.model.shards import parse_size
from dtpshard.training.losses import chunk_tokens
from dtpshard.training.precision import param_dtype, resolve_precision
from dtpshard.training.recipe import FROZEN, DistillConfig
from dtpshard.training.recipes import uses_streams

ADVISED_RANK = 64  # the rank a plan that does not fit suggests (docs/results/smollm2-l3-d1-adapters)
CUDA_RUNTIME = 1 << 30  # the CUDA context and the allocator's slack, not in any tensor
LOSS_BUFFERS = 6  # [chunk, V] fp32 buffers alive at once in the fused loss (teacher and student logits, ...)


@dataclass
class Setup:
    """What the plan depends on."""

    world: int
    sharded: bool
    precision: str  # fp32 | bf16-mixed
    grad_checkpointing: bool
    micro_batch: int
    seq_len: int
    device_type: str  # cpu | cuda
    adapters: int | None = None  # the adapters' rank (None: every weight trains)
    adapter_params: int = 0  # what the adapters train (model.adapters.trainable_count)
    adapter_targets: tuple[str, ...] = DEFAULT_TARGETS
    streams: bool = False  # the recipe matches streams on some step (training/recipes.py)


@dataclass
class MemoryPlan:
    setup: Setup
    parts: dict[str, int]  # bytes per process
    available: int  # bytes per process
    activations_other: int = 0  # the activations with the other gradient-checkpointing setting
    advice: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.available

    def to_json(self) -> dict[str, Any]:
        return {"setup": dataclasses.asdict(self.setup), "parts": self.parts, "total": self.total,
                "available": self.available, "fits": self.fits,
                "activations_with_checkpointing" if not self.setup.grad_checkpointing
                else "activations_without_checkpointing": self.activations_other, "advice": self.advice}

    def describe(self) -> str:
        s = self.setup
        how = (f"{s.world} process(es), {'--fsdp' if s.sharded else 'replicated'}, {s.precision}, "
               f"{'' if s.adapters is None else f'adapters of rank {s.adapters}, '}"
               f"micro-batch {s.micro_batch} x {s.seq_len} tokens"
               f"{', gradient checkpointing' if s.grad_checkpointing else ''}")
        lines = [f"memory per process ({how}):"]
        lines += [f"  {k:<16}{size_text(v):>12}" for k, v in self.parts.items()]
        other = "with" if not s.grad_checkpointing else "without"
        lines.append(f"  {'total':<16}{size_text(self.total):>12}  of {size_text(self.available)} available"
                     f" ({'fits' if self.fits else 'does not fit'}; activations {other} checkpointing: "
                     f"{size_text(self.activations_other)})")
        return "\n".join(lines)


_TRACED: dict[tuple, int] = {}


def saved_bytes(hf_config: Any, settings: DTPSettings, micro_batch: int, seq_len: int,
                dtype: torch.dtype, grad_checkpointing: bool, adapters: AdapterSettings | None = None,
                shared: int = 0) -> int:
    """Bytes autograd saves for backward over the student's forward of one micro-batch, traced on
    fake tensors (nothing allocated); each setting traced once per process. `adapters`: only they
    train (the frozen weights' gradients are not computed, the [N, r] activations are saved).
    `shared`: the neurons a layer replicates (docs/design.md §6), whose activations every device
    of the simulator saves, L times n instead of n."""
    key = (id(hf_config), settings, micro_batch, seq_len, dtype, grad_checkpointing, adapters, shared)
    if key not in _TRACED:
        _TRACED[key] = _trace(hf_config, settings, micro_batch, seq_len, dtype, grad_checkpointing, adapters, shared)
    return _TRACED[key]


def _trace(hf_config: Any, settings: DTPSettings, micro_batch: int, seq_len: int,
           dtype: torch.dtype, grad_checkpointing: bool, adapters: AdapterSettings | None, shared: int) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            st = t.untyped_storage()
            seen[st._cdata] = st.nbytes()
        return t

    default = torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(dtype)  # built in the compute dtype (a .to() would swap fake parameters)
        try:
            model = DTPModel(hf_config, settings, shared)
            if adapters is not None:  # computed in that dtype too (their fp32 masters are counted apart)
                attach(model, adapters)
        finally:
            torch.set_default_dtype(default)
        if adapters is None:
            for name, p in model.named_parameters():
                p.requires_grad_(name not in FROZEN)
        model.gradient_checkpointing = grad_checkpointing
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.hidden(ids)
    return sum(seen.values())


def plan_memory(shape: ModelShape, hf_config: Any, s: Setup, *, settings: DTPSettings,
                available: int, runtime: int, with_advice: bool = True) -> MemoryPlan:
    """Bytes per process of a distillation with setup `s` (see the module docstring); a plan that
    does not fit says what would make it fit (with_advice)."""
    K = s.world if s.sharded else 1
    P, F = shape.params(), shape.vocab * shape.hidden * (1 if shape.tied else 2)
    T = P - F  # trained: everything but the frozen embedding and LM head
    compute = torch.bfloat16 if s.precision == "bf16-mixed" else torch.float32
    frozen_bytes = param_dtype(s.precision, frozen=True).itemsize
    lowrank = None if s.adapters is None else AdapterSettings(s.adapters, targets=tuple(s.adapter_targets))
    if lowrank is None:
        parts = {"process": runtime,
                 "teacher": (P if s.sharded else T) * (frozen_bytes if s.sharded else 4) // K,  # replicated: shares
                 "student": 4 * P // K, "gradients": 4 * T // K, "optimizer": 8 * T // K}  # the frozen tensors
    else:  # one copy of the weights, the teacher's too; the adapters, their gradients and AdamW state in fp32
        A = s.adapter_params
        parts = {"process": runtime, "weights": P * frozen_bytes // K, "adapters": 4 * A // K,
                 "gradients": 4 * A // K, "optimizer": 8 * A // K}
    traced = {c: saved_bytes(hf_config, settings, s.micro_batch, s.seq_len, compute, c, lowrank, shape.shared)
              for c in (False, True)}
    layer = traced[False] // shape.layers  # one layer's saved set
    # with checkpointing, backward recomputes one segment at a time: its modules' saved sets come back
    segment = traced[False] * checkpoint_segment(shape.modules) // shape.modules
    act = traced[True] + segment if s.grad_checkpointing else traced[False]
    other = traced[False] if s.grad_checkpointing else traced[True] + segment
    tokens = s.micro_batch * s.seq_len
    loss = LOSS_BUFFERS * min(tokens, chunk_tokens(shape.vocab)) * shape.vocab * 4 + tokens * shape.hidden * 4
    parts["activations"] = act + layer + loss  # + one layer's gradients in flight
    if s.streams:  # the teacher's stream after every module, and each module's saved difference from it
        parts["streams"] = shape.modules * tokens * shape.hidden * (compute.itemsize + 4 * settings.devices)
    trained = T if lowrank is None else s.adapter_params
    if s.sharded:  # two groups gathered at once (prefetch), the root (embedding, norms, head) all along,
        # one group's unsharded gradients before their reduce-scatter (an FFN's, the larger group)
        group = max(shape.layer_params() - 3 * shape.neurons * shape.hidden, 3 * shape.neurons * shape.hidden)
        grads = group if lowrank is None else s.adapter_params // shape.layers
        parts["communication"] = (2 * group + F) * compute.itemsize + grads * 4
    elif s.world > 1:
        parts["communication"] = 4 * trained  # DDP's gradient buckets
    plan = MemoryPlan(s, parts, available, other)
    if not plan.fits and with_advice:
        plan.advice = advice(shape, hf_config, s, settings=settings, available=available,
                             runtime=runtime)
    return plan


def advice(shape: ModelShape, hf_config: Any, s: Setup, **kw: Any) -> list[str]:
    """What would make the run fit: each change that does on its own (checked by planning it), else
    the first combination of them that does."""
    def fits(setup: Setup) -> bool:
        return plan_memory(shape, hf_config, setup, with_advice=False, **kw).fits

    remedies: list[tuple[str, dict[str, Any]]] = []
    if not s.grad_checkpointing:
        remedies.append(("--grad-checkpointing", {"grad_checkpointing": True}))
    if s.precision == "fp32":
        remedies.append(("--precision bf16-mixed", {"precision": "bf16-mixed"}))
    if not s.sharded and s.world > 1:
        remedies.append(("--fsdp", {"sharded": True}))
    remedies += [(f"--micro-batch {mb}", {"micro_batch": mb}) for mb in (s.micro_batch // 2, 1)
                 if 0 < mb < s.micro_batch]
    if s.adapters is None:  # the first remedy a model too large for full distillation has
        remedies.append((f"--adapters {ADVISED_RANK}", {"adapters": ADVISED_RANK, "adapter_params": trainable_count(
            shape, AdapterSettings(ADVISED_RANK))}))
    remedies += [(f"{k} processes with --fsdp", {"world": k, "sharded": True})
                 for k in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if k > s.world]
    alone: list[str] = []
    for flag, change in remedies:
        more_ranks = "world" in change
        if (not more_ranks or not any("processes" in f for f in alone)) and fits(dataclasses.replace(s, **change)):
            alone.append(flag)  # of the process counts, only the smallest that fits
    if alone:
        return alone
    chosen: dict[str, str] = {}  # setting -> the flag that sets it (a later remedy replaces an earlier one)
    current = s
    for flag, change in remedies:
        current = dataclasses.replace(current, **change)
        chosen.update({("world" if "world" in change else next(iter(change))): flag})
        if fits(current):
            return [" + ".join(dict.fromkeys(chosen.values()))]
    return []


def available_bytes(device: str, local_ranks: int, given: int | None = None) -> int:
    """Memory one process may use: `given`, else the GPU's total memory, else its share of the RAM
    available now (the local ranks share it) plus what this process already holds."""
    if given is not None:
        return given
    if torch.device(device).type == "cuda":
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return int(psutil.virtual_memory().available / max(1, local_ranks)) + process_bytes("cpu")


def process_bytes(device: str) -> int:
    """What the process holds before the run's tensors: its resident set on the CPU, the CUDA
    runtime's share on a GPU."""
    if torch.device(device).type == "cuda":
        return CUDA_RUNTIME
    return int(psutil.Process().memory_info().rss)


# -- measuring ---------------------------------------------------------------------------------
_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _hwm() -> int | None:
    try:
        for line in read_text(_STATUS, 1 << 20, "process status").splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, UserError):  # no /proc: no measurement
        pass
    return None


class PhasePeaks:
    """Peak memory of each phase of this process: `with peaks.phase("setup"): ...`."""

    def __init__(self, device: str):
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.peaks: dict[str, int] = {}

    def _reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:  # Linux: "5" resets the peak resident set (VmHWM) to the current one
            _CLEAR.write_text("5")
        except OSError:
            pass

    def _peak(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device)) + CUDA_RUNTIME if self.cuda else _hwm()

    class _Phase:
        def __init__(self, owner: PhasePeaks, name: str):
            self.owner, self.name = owner, name

        def __enter__(self) -> None:
            self.owner._reset()

        def __exit__(self, *exc: Any) -> None:
            peak = self.owner._peak()
            if peak is not None:
                self.owner.peaks[self.name] = max(peak, self.owner.peaks.get(self.name, 0))

    def phase(self, name: str) -> PhasePeaks._Phase:
        return PhasePeaks._Phase(self, name)


def local_ranks() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def plan_for(cfg: DistillConfig, world: int, device: str, local: int | None = None,
             hf_config: Any = None) -> MemoryPlan:
    """The memory plan of this run per process, from config.json alone (cfg resolved; `hf_config`:
    the teacher's, when it is read already); `local` processes share this machine's RAM (default:
    torchrun's LOCAL_WORLD_SIZE)."""
    hf_config = load_hf_config(cfg.teacher) if hf_config is None else hf_config
    precision = resolve_precision(cfg.precision, device)
    shape = shape_from_hf_config(hf_config)
    # the student's shared neurons (docs/design.md §6): its layout's, else a permuted teacher's or a student's
    applied = permuted_layout(Path(cfg.teacher))
    shared = Layout.load(cfg.layout, shape).shared if cfg.layout is not None else \
        shape.shared or (0 if applied is None else applied.shared)
    shape = dataclasses.replace(shape, shared=shared)
    lowrank = cfg.adapter_settings
    setup = Setup(world, cfg.fsdp and world > 1, precision, cfg.grad_checkpointing, cfg.micro_batch, cfg.seq_len,
                  torch.device(device).type, cfg.adapters, 0 if lowrank is None else trainable_count(shape, lowrank),
                  DEFAULT_TARGETS if lowrank is None else lowrank.targets, uses_streams(cfg.recipe, cfg.steps))
    given = None if cfg.plan_memory is None else parse_size(cfg.plan_memory, "--plan-memory")
    return plan_memory(shape, hf_config, setup, settings=cfg.dtp,
                       available=available_bytes(device, local or local_ranks(), given), runtime=process_bytes(device))


def refuse_unless_fits(plan: MemoryPlan) -> None:
    if plan.fits:
        return
    fix = "; it would fit with " + " or ".join(plan.advice) if plan.advice else ""
    largest = max(plan.parts, key=plan.parts.get)
    raise UserError(f"the run needs {size_text(plan.total)} per process, more than the {size_text(plan.available)} "
                    f"available (largest part: {largest} {size_text(plan.parts[largest])}){fix}; see --plan")


def record(path: Path, plan: MemoryPlan, peaks: PhasePeaks, d: Any) -> None:
    """RUN/memory.json at `path`: the plan per process and every rank's measured peak per phase
    (`d`: the run's ddp.Dist; every rank calls it)."""
    phases = ("setup", "training", "saving")
    mine = torch.tensor([float(peaks.peaks.get(p, -1)) for p in phases], dtype=torch.float64)
    every = torch.zeros(d.world, len(phases), dtype=torch.float64)
    every[d.rank] = mine
    every = d.sum(every)  # each rank fills its own row
    if not d.main:
        return
    measured = {p: [None if v < 0 else int(v) for v in every[:, i].tolist()] for i, p in enumerate(phases)}
    peak = max((v for vals in measured.values() for v in vals if v is not None), default=None)
    out = {"plan": plan.to_json(), "measured": measured, "unit": "bytes",
              "how": "peak resident set per phase (VmHWM)" if plan.setup.device_type == "cpu"
              else "peak allocated by torch per phase, plus the CUDA runtime",
              "measured_over_planned": None if peak is None else peak / plan.total}
    atomic_write_text(path, dumps(out, indent=1) + "\n")
