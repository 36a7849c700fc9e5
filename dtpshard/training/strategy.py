"""Where a run's models live: `Replicated` (one process, or DDP: every rank holds everything) or
`Sharded` (--fsdp: FSDP2, each rank holds 1/K of every tensor), both a `Strategy`. The loop
(loop.py) asks its strategy to build the models, wrap them, restore and save checkpoints and
write the student; it never asks which one it has.

Sharded building never holds a whole model: the teacher and the student are made on the meta
device, `fully_shard`ed, materialised empty, and each rank fills its own local shards straight
from the checkpoint's safetensors files (`fill_local`), reading only the rows it holds, through
the layout's indices for the student. Every local shard equals, bit for bit, the shard of the
whole model loaded in fp32 and sharded afterwards (tests/test_strategy.py).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dtpshard.core.errors import UserError, first_line
from dtpshard.core.layout import Layout
from dtpshard.core.permutation import layout_indices
from dtpshard.core.settings import DENSE
from dtpshard.model import adapters
from dtpshard.model.checkpoint import Checkpoint
from dtpshard.model.compiled import compile_module, want_compile
from dtpshard.model.dtp import DTPModel
from dtpshard.model.shards import TensorSpec, Weights
from dtpshard.training import fsdp, rundir
from dtpshard.training.ddp import Dist
from dtpshard.training.precision import autocast_for, param_dtype
from dtpshard.training.recipe import FROZEN, FrozenBase, Student, Teacher


def chunk_rows(rows: int, rank: int, world: int) -> slice:
    """The dim-0 rows rank `rank` holds of a tensor sharded over `world` (torch.chunk's split, as
    DTensor's Shard(0))."""
    c = math.ceil(rows / world)
    lo = min(rank * c, rows)
    return slice(lo, min(lo + c, rows))


def read_rows(ckpt: Checkpoint, name: str, gather: tuple[int, torch.Tensor] | None, rows: slice) -> torch.Tensor:
    """Rows `rows` of tensor `name` after the layout's gather (axis, index), reading no other rows:
    rows permuted -> the permuted rows' runs; columns permuted -> these rows, then their columns."""
    if gather is None:
        return ckpt.files.get(name, rows)
    axis, index = gather
    if axis == 0:
        return ckpt.files.get_units(name, index[rows].numpy(), 0)
    return ckpt.files.get(name, rows).index_select(1, index)


@torch.no_grad()
def fill_local(model: DTPModel, ckpt: Checkpoint, layout: Layout | None, rank: int, world: int) -> None:
    """Every parameter of a fully_shard-ed, materialised `model`: this rank's rows, from the files."""
    from torch.distributed.tensor import DTensor

    gathers = {} if layout is None else layout_indices(ckpt.shape, layout)
    for name, p in model.named_parameters():
        if adapters.is_adapter(name):  # not in the files: adapters.init_values draws them
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        rows = chunk_rows(p.shape[0], rank, world) if isinstance(p, DTensor) else slice(None)
        part = read_rows(ckpt, name, gathers.get(name), rows)
        if tuple(part.shape) != tuple(local.shape):
            raise RuntimeError(f"{name}: read {list(part.shape)} for a local shard of {list(local.shape)}")
        local.copy_(part)


def student_shared(ckpt: Checkpoint, layout: Layout | None) -> int:
    """The shared neurons of the student (docs/design.md §6): its layout's, else those the checkpoint
    holds last already; both is refused, as DTPModel.from_state_dict refuses it."""
    if layout is not None and ckpt.shape.shared:
        raise UserError(f"{ckpt.path} already holds {ckpt.shape.shared} shared neurons a layer, last; a layout "
                        "applies to the dense model it was made from")
    return ckpt.shape.shared if layout is None else layout.shared


class Strategy(Protocol):
    """What the loop asks of where its models live."""

    d: Dist
    lockstep: bool  # evaluation: every forward is a collective, so ranks make as many

    def autocast(self) -> contextlib.AbstractContextManager: ...

    def build(self, cfg: Any, ckpt: Checkpoint, layout: Layout | None) -> tuple[Teacher, Student]: ...

    def wrap(self, net: Student, cfg: Any, steps_left: int) -> nn.Module: ...

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Around a micro-batch's backward: gradients reduced after the last one only."""

    def restore(self, run: Path, net: Student, named: list, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The checkpoint's state put in place; the rest of it returned (None: no checkpoint)."""

    def checkpoint_path(self, run: Path) -> Path:
        """The file or directory a refusal of the checkpoint names."""

    def checkpoint_due(self, due: bool) -> bool: ...

    def save(self, run: Path, step: int, net: Student, named: list, opt: torch.optim.Optimizer,
             extra: dict[str, Any]) -> None: ...

    def after_eval(self, net: Student) -> None: ...

    def save_student(self, student: DTPModel, dtype: torch.dtype, write: Callable[[Weights], None],
                     follow: Callable[[Weights], None]) -> None:
        """The student's weights in `dtype`: rank 0 `write`s them (final/); the other ranks
        `follow` rank 0's save (asking for each tensor in its order, writing nothing) where the
        strategy needs them to."""


class Replicated:
    """One process, or DDP over the ranks: every rank builds the whole teacher and student (their
    frozen embedding and LM head shared), and rank 0 saves."""

    lockstep = False  # evaluation: a forward is not a collective

    def __init__(self, d: Dist, precision: str):
        self.d, self.precision = d, precision
        self.ddp = None

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast_for(self.d.device, self.precision)

    def build(self, cfg: Any, ckpt: Checkpoint, layout: Layout | None) -> tuple[Teacher | FrozenBase, Student]:
        if cfg.adapters is not None:  # one copy: the frozen base is the student's and the teacher's
            sd = ckpt.state_dict(param_dtype(self.precision, frozen=True))
            student = DTPModel.from_state_dict(ckpt.hf_config, sd, layout=layout, settings=cfg.dtp,
                                               shared=ckpt.shape.shared)
            del sd
            adapters.attach(student, cfg.adapter_settings)
            adapters.init_values(student, cfg.seed)
            net = Student(student.to(self.d.device))
            return FrozenBase(net), net
        sd = ckpt.state_dict(torch.float32)
        teacher = DTPModel.from_state_dict(ckpt.hf_config, sd, settings=DENSE)
        teacher.requires_grad_(False).eval()
        own = {k: v if k in FROZEN else v.clone() for k, v in sd.items()}
        del sd
        student = DTPModel.from_state_dict(ckpt.hf_config, own, layout=layout, settings=cfg.dtp,
                                           shared=ckpt.shape.shared)
        for name, p in student.named_parameters():
            p.requires_grad_(name not in FROZEN)
        return Teacher(teacher.to(self.d.device)), Student(student.to(self.d.device))

    def wrap(self, net: Student, cfg: Any, steps_left: int) -> nn.Module:
        out: nn.Module = net
        if self.d.world > 1:
            out = self.ddp = DDP(net, device_ids=[self.d.local_rank] if self.d.device.startswith("cuda") else None)
        return compile_module(out) if want_compile(cfg.compile, self.d.device, steps_left) else out

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Around a micro-batch's backward: DDP reduces the gradients after the last one only."""
        return self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()

    def restore(self, run: Path, net: Student, named: list, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
        state = rundir.load_checkpoint(run)
        if state is None:
            return None
        path = self.checkpoint_path(run)
        student, optimizer = state.get("student"), state.get("optimizer")
        if not isinstance(student, dict) or not isinstance(optimizer, dict):
            raise UserError(f"{path}: no {'student' if not isinstance(student, dict) else 'optimizer'} state "
                            "(a damaged checkpoint); use --force to start over")
        for n, p in named:
            t = student.get(n)
            if not isinstance(t, torch.Tensor):
                raise UserError(f"{path}: has no tensor {n!r}; use --force to start over")
            if t.shape != p.shape:
                raise UserError(f"{path}: tensor {n!r} has shape {list(t.shape)}, the student's {list(p.shape)} "
                                "(another model's checkpoint?); use --force to start over")
        with torch.no_grad():
            for n, p in named:
                p.copy_(student[n])
        try:
            _check_optimizer(optimizer, [p for g in opt.param_groups for p in g["params"]])
            opt.load_state_dict(optimizer)
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise UserError(f"{path}: unusable optimizer state ({first_line(e, 120)}); use --force to start "
                            "over") from None
        return state

    def checkpoint_path(self, run: Path) -> Path:
        return run / rundir.CHECKPOINT

    def checkpoint_due(self, due: bool) -> bool:
        return due

    def save(self, run: Path, step: int, net: Student, named: list, opt: torch.optim.Optimizer,
             extra: dict[str, Any]) -> None:
        if self.d.main:
            rundir.save_checkpoint(run, {**extra, "student": {n: p.detach() for n, p in named},
                                         "optimizer": opt.state_dict()})

    def after_eval(self, net: Student) -> None:
        pass

    def save_student(self, student: DTPModel, dtype: torch.dtype, write: Callable[[Weights], None],
                     follow: Callable[[Weights], None]) -> None:
        if self.d.main:  # every rank holds the whole student: the others have no part in it
            write(saved_weights(student, student.state_dict(), dtype, self.full))

    def full(self, p: torch.Tensor) -> torch.Tensor:
        return p.detach()


class Sharded:
    """FSDP2 over the ranks (fsdp.py's groups): weights, gradients and AdamW state 1/K per rank;
    bf16-mixed: bf16 compute, fp32 master weights and gradient reduction, the teacher held in bf16."""

    lockstep = True  # every forward all-gathers: ranks evaluate in lockstep

    def __init__(self, d: Dist, precision: str):
        self.d, self.precision = d, precision
        self.mesh = fsdp.mesh_for(d.device, d.world)

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # FSDP's MixedPrecisionPolicy casts the weights itself

    def build(self, cfg: Any, ckpt: Checkpoint, layout: Layout | None) -> tuple[Teacher, Student]:
        dev, rank, world = torch.device(self.d.device), self.d.rank, self.d.world
        policy = fsdp.policy(self.precision)
        if cfg.adapters is not None:
            return self._build_adapters(cfg, ckpt, layout, policy)
        with torch.device("meta"):
            teacher = DTPModel(ckpt.hf_config, DENSE).to(param_dtype(self.precision, frozen=True))
            student = DTPModel(ckpt.hf_config, cfg.dtp, student_shared(ckpt, layout))
        teacher.requires_grad_(False).eval()
        for name, p in student.named_parameters():
            p.requires_grad_(name not in FROZEN)
        if layout is not None:
            student.layout_sha256 = layout.content_sha256()
        nets = Teacher(teacher), Student(student)
        for net, frozen, lay in ((nets[0], True, None), (nets[1], False, layout)):
            fsdp.shard(net, self.mesh, frozen, policy)
            net.to_empty(device=dev)
            fill_local(net.model, ckpt, lay, rank, world)
            net.model.rebuild_buffers()
        student.source_path = Path(cfg.teacher)
        return nets

    def _build_adapters(self, cfg: Any, ckpt: Checkpoint, layout: Layout | None,
                        policy: Any) -> tuple[FrozenBase, Student]:
        """The frozen base held once (bf16 under bf16-mixed), sharded with the adapters (fp32) in
        each module's group; each rank fills its rows from the files and draws its rows of A."""
        dev, rank, world = torch.device(self.d.device), self.d.rank, self.d.world
        with torch.device("meta"):
            student = DTPModel(ckpt.hf_config, cfg.dtp, student_shared(ckpt, layout)).to(
                param_dtype(self.precision, frozen=True))
            adapters.attach(student, cfg.adapter_settings)
        if layout is not None:
            student.layout_sha256 = layout.content_sha256()
        net = Student(student)
        fsdp.shard(net, self.mesh, False, policy)
        net.to_empty(device=dev)
        fill_local(student, ckpt, layout, rank, world)
        adapters.init_values(student, cfg.seed, rows=lambda name, n: chunk_rows(n, rank, world),
                             local=lambda p: p.to_local())
        student.rebuild_buffers()
        student.source_path = Path(cfg.teacher)
        return FrozenBase(net), net

    def wrap(self, net: Student, cfg: Any, steps_left: int) -> nn.Module:
        return net  # compile is refused with --fsdp (recipe.check_config); auto stays eager

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # each micro-batch's gradients are reduce-scattered as it ends

    def restore(self, run: Path, net: Student, named: list, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
        return fsdp.load(run, net, opt)  # the shards in place; the rest returned

    def checkpoint_due(self, due: bool) -> bool:
        """Saving is collective: rank 0's clock decides for all."""
        return bool(self.d.sum(torch.tensor([float(due and self.d.main)]))[0] > 0)

    def checkpoint_path(self, run: Path) -> Path:
        return fsdp.latest(run) or run / fsdp.DIR

    def save(self, run: Path, step: int, net: Student, named: list, opt: torch.optim.Optimizer,
             extra: dict[str, Any]) -> None:
        fsdp.save(run, step, net, opt, extra, self.d.main, self.d.barrier)

    def after_eval(self, net: Student) -> None:
        # FSDP keeps a root's weights gathered after forward (for the backward, none here): free
        # them, and give named_parameters() the sharded ones back
        net.reshard()

    def save_student(self, student: DTPModel, dtype: torch.dtype, write: Callable[[Weights], None],
                     follow: Callable[[Weights], None]) -> None:
        """Each tensor gathered in turn on every rank (a collective, in the same order everywhere):
        a rank holds its shards and one whole tensor at a time."""
        (write if self.d.main else follow)(saved_weights(student, dict(student.named_parameters()), dtype,
                                                                  self.full))

    def full(self, p: torch.Tensor) -> torch.Tensor:
        """A sharded tensor gathered whole on every rank (a collective)."""
        return p.full_tensor()


def _check_optimizer(state: dict[str, Any], params: list[torch.Tensor]) -> None:
    """AdamW's saved moments have their parameters' shapes (load_state_dict does not check them:
    a wrong one would fail, or broadcast, at the first step); `params` in the optimizer's order,
    which its state's indices follow."""
    for i, p in enumerate(params):
        for key, t in (state.get("state") or {}).get(i, {}).items():
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape != p.shape:
                raise ValueError(f"{key} of parameter {i} has shape {list(t.shape)}, not {list(p.shape)}")


def saved_weights(student: DTPModel, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                  full: Callable[[torch.Tensor], torch.Tensor]) -> Weights:
    """The student as saved, each tensor got whole (`full`) when its turn comes: with adapters,
    every adapted projection merged (W + (α/r)·B·A, model/adapters.py) and no adapter tensor."""
    settings = getattr(student, "adapters", None)
    if settings is None:
        produce = {n: (lambda t=t: full(t)) for n, t in tensors.items()}
    else:
        produce = adapters.merged(tensors, full, settings.scale)
    specs = [TensorSpec(n, tuple(tensors[n].shape), dtype if tensors[n].is_floating_point() else tensors[n].dtype)
             for n in produce]
    return Weights(specs, lambda s: produce[s.name]())


def strategy_for(cfg: Any, d: Dist, precision: str) -> Strategy:
    """Sharded under --fsdp with several processes; one process holds everything whatever the flag."""
    return Sharded(d, precision) if cfg.fsdp and d.world > 1 else Replicated(d, precision)
