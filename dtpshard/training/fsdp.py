"""Fully sharded distillation (`--fsdp`): the student's weights, gradients and AdamW state, and the
frozen teacher's weights, split across the ranks with PyTorch's FSDP2 (`fully_shard`).

Groups. One FSDP group per DTP module (each layer's attention, each layer's FFN) plus the root.
The schedule runs a layer's two modules as two separate calls with the residual-stream updates
in between, so a per-layer group would be all-gathered twice per forward (or kept whole across
both); per module, every weight is gathered once in forward and once in backward, as per-layer
FSDP does for a dense model. The modules' entry point is `partials`, not `forward`, hence
`register_fsdp_forward_method`. The RMSNorm weights (D floats each), the embedding and the LM
head stay in the root group: gathered when the root's forward starts, kept until backward ends.

Teacher. Sharded the same way and forward only (under no_grad FSDP registers no backward hooks),
its root resharded after every forward: it costs 1/K of its weights per rank plus one gathered
module at a time, and one all-gather per module per micro-batch; streaming its layers from the
safetensors files instead would re-read the whole checkpoint from disk every micro-batch. Its
untied LM head is never used (the loss uses the student's, the same frozen tensor), so it has
a group of its own that is never gathered.

Frozen tensors (embedding, LM head) are sharded with requires_grad False: no gradient, no
optimizer state. Under --precision fp32 parameters stay fp32, so the numbers match DDP's; under
bf16-mixed a MixedPrecisionPolicy computes in bf16 and reduces gradients in fp32 (`policy`).

Checkpoint: RUN/checkpoint.dcp/ holds step directories written by `torch.distributed.checkpoint`
(every rank writes its own shards) and LATEST naming the complete one: a step is written under a
temporary name, renamed, then LATEST is replaced atomically, then older steps are removed, so a
kill at any moment leaves one whole checkpoint. All ranks must see the same run directory (one
machine, or a shared filesystem).

Backends: gloo on CPU (tested); NCCL on CUDA (written, not tested here: this machine has no GPU).
"""
from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtpshard.core.errors import UserError, first_line
from dtpshard.core.io import SMALL_JSON, atomic_path, atomic_write_text, pid_alive, read_text
from dtpshard.core.temporary import temporary_name, temporary_of
from dtpshard.training.rundir import SHARDED_CHECKPOINT as DIR

LATEST = "LATEST"
EXTRA = "run.pt"  # the scheduler, step, wall time, metrics length, RNG: small, written by rank 0


def mesh_for(device: str, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(torch.device(device).type, (world,))


def policy(precision: str) -> Any:
    """bf16-mixed: bf16 weights in forward and backward, fp32 master weights and fp32 gradient
    reduction (FSDP2's MixedPrecisionPolicy); fp32: None (everything fp32)."""
    if precision != "bf16-mixed":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard(net: nn.Module, mesh: Any, frozen: bool, mp_policy: Any = None) -> None:
    """fully_shard a Student/Teacher wrapper (net.model a DTPModel) in place: one group per DTP
    module, the rest in the root. frozen: a forward-only model (the teacher)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    kw = {} if mp_policy is None else {"mp_policy": mp_policy}

    # FSDP warns that a view returned by a module would lose its pre-backward hook to an in-place
    # op; the schedule only ever adds partials out of place (x = x + p), so the warning is noise
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    model = net.model
    for layer in model.model.layers:
        for part in (layer.self_attn, layer.mlp):
            fully_shard(part, mesh=mesh, **kw)
            register_fsdp_forward_method(part, "partials")
    if frozen and model.lm_head is not None:
        fully_shard(model.lm_head, mesh=mesh, **kw)  # never called: stays sharded
    # a forward-only root frees its gathered weights after each forward; the student's root keeps
    # them for the backward that follows (FSDP's default for the root)
    fully_shard(net, mesh=mesh, reshard_after_forward=True if frozen else None, **kw)


def local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of these tensors (a DTensor's local shard), a tensor seen twice counted
    once (the student and the teacher share the frozen tensors when not sharded)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        seen[t.data_ptr()] = t.nbytes
    return sum(seen.values())


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def full_norm(t: torch.Tensor) -> float:
    """clip_grad_norm_'s total norm: over DTensor gradients it is a DTensor reduced across ranks."""
    from torch.distributed.tensor import DTensor

    return float(t.full_tensor() if isinstance(t, DTensor) else t)


# -- the sharded checkpoint --------------------------------------------------------------------------
def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def latest(run: Path) -> Path | None:
    p = run / DIR / LATEST
    if not p.is_file():
        return None
    return run / DIR / read_text(p, SMALL_JSON, "checkpoint pointer").strip()


def clean(run: Path) -> None:
    """Rank 0, before training: drop temporaries and every step directory LATEST does not name."""
    root = run / DIR
    if root.is_symlink():  # its files are someone else's: never cleared
        raise UserError(f"{root}: is a symbolic link, which dtpshard did not make; remove it or use another --out")
    if not root.is_dir():
        return
    keep = latest(run)
    for p in root.iterdir():  # only what save() writes: a step directory, a dead writer's temporary
        found = temporary_of(p.name)
        ours = _is_step(p.name) or found is not None and (_is_step(found[0]) or found[0] == LATEST) \
            and not pid_alive(found[1])
        if not ours or p == keep or p.is_symlink():
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _is_step(name: str) -> bool:
    return name.startswith("step-") and name[5:].isdigit()


def _OPTIONS(load: bool = False) -> Any:  # a constant, made when torch.distributed is loaded
    """What a checkpoint holds: the trained tensors only. The frozen ones (the embedding and LM
    head; with adapters, every base weight) are read from the teacher again on resume, so a load
    sets only the trained ones (dcp.load has refused a checkpoint without one of them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=not load)


def save(run: Path, step: int, net: nn.Module, opt: torch.optim.Optimizer, extra: dict[str, Any], main: bool,
         barrier: Callable[[], None]) -> None:
    """Collective: every rank writes its shards of the student and AdamW state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = run / DIR
    final = root / _step_name(step)
    tmp = root / temporary_name(final.name, pid=_writer_pid())
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    model_sd, optim_sd = get_state_dict(net, opt, options=_OPTIONS())
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)  # ends with a collective: all shards written
    if main:
        with atomic_path(tmp / EXTRA) as f:
            torch.save(extra, f)
        publish(run, tmp, final)
    barrier()


def _writer_pid() -> int:
    """Rank 0's pid, on every rank: the step's temporary (core/temporary.py) is one name for all the
    ranks that write into it, and rank 0's, the process that publishes it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return os.getpid()
    box = [os.getpid()]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def publish(run: Path, tmp: Path, final: Path) -> None:
    """Rank 0: the complete temporary step directory becomes the checkpoint."""
    before = latest(run)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(run / DIR / LATEST, final.name + "\n")
    if before is not None and before != final:
        shutil.rmtree(before, ignore_errors=True)


def load(run: Path, net: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Collective: restore the student and AdamW state in place -> rank 0's extras, or None."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from dtpshard.training.trust import load_state, safe_planner, safe_reader

    path = latest(run)
    if path is None:
        return None
    try:
        extra = load_state(path / EXTRA, "checkpoint")
        model_sd, optim_sd = get_state_dict(net, opt, options=_OPTIONS())
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=safe_reader(path), planner=safe_planner())
    except UserError:
        raise
    except (Exception, CheckpointException) as e:  # a corrupt or foreign checkpoint fails in many
        # ways, and torch.distributed.checkpoint's own error is a BaseException, not an Exception
        raise UserError(f"{path}: unreadable sharded checkpoint ({first_line(e, 120, named=True)}); "
                        "use --force to start over") from None
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_OPTIONS(load=True))
    return extra
