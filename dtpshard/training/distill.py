"""`dtpshard distill`'s work (docs/design.md §4; the command is dtpshard/commands/training.py):
train the DTP student to match the frozen dense teacher, in one process, under torchrun, or in
--nproc local processes started by the one local launcher (dtpshard.core.launch). The recipe is
DistillConfig (settings.py), the run recipe.py, the loop loop.py.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path

from dtpshard.core.errors import UserError
from dtpshard.core.guard import check_outputs, local_paths
from dtpshard.core.lazy import lazy_exports
from dtpshard.training.settings import DistillConfig, Recipe, check_config

# recipe.py's names stay importable from here, loaded when first asked for: recipe.py is torch,
# which `dtpshard distill --help` does not load (dtpshard/__init__.py)
__getattr__, _ = lazy_exports("dtpshard.training", dict.fromkeys(
    ("FROZEN", "Student", "Teacher", "lr_factor", "resolve", "train_blocks_for"), "recipe"))
__all__ = ["DistillConfig", "Recipe", "check_config", "distill", "memory_plan", "train_rank"]


def train_rank(cfg: DistillConfig) -> int:
    """One local rank of `--nproc K` (launch_local set RANK, WORLD_SIZE, ...): it trains, and never
    goes back through `distill`, whose launcher holds the run's lock for all of them."""
    import torch

    from dtpshard.training.ddp import run_distributed
    from dtpshard.training.loop import train

    if "OMP_NUM_THREADS" not in os.environ:  # K processes share the cores, as under torchrun
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.nproc))
    run_distributed(cfg, train)
    return 0


def distill(cfg: DistillConfig) -> Path:
    """Run (or resume, or finish) the distillation into cfg.out; returns the run directory. One
    process owns RUN while it runs: this one (which, with --nproc K, starts the K ranks), or under
    torchrun rank 0."""
    from dtpshard.training.ddp import run_distributed
    from dtpshard.training.loop import train
    from dtpshard.training.rundir import locked, refuse_foreign, refuse_unrelated

    check_config(cfg)
    # --force starts a run over by removing its files, config.json among them: never an input's
    check_outputs({"--out": cfg.out, "--tensorboard": cfg.tensorboard},
                  {"the teacher directory": cfg.teacher, "the tokenizer directory": cfg.tokenizer,
                   "the layout": cfg.layout, "the teacher cache": cfg.teacher_cache, "the training text": cfg.text,
                   "the evaluation text": cfg.eval_text, "the dataset": local_paths([cfg.dataset, cfg.eval_dataset])})
    refuse_foreign(Path(cfg.out))  # before any model is read: a model's or an experiment's directory,
    refuse_unrelated(Path(cfg.out), cfg.force)  # or unrelated files
    under_torchrun = "WORLD_SIZE" in os.environ  # each process is a rank already (ddp.setup checks --nproc)
    if cfg.nproc > 1 and not under_torchrun:  # refused here, before any rank starts (each rank checks again)
        from dtpshard.core.devices import pick_device
        from dtpshard.training.memory import plan_for, refuse_unless_fits
        from dtpshard.training.recipe import resolve

        refuse_unless_fits(plan_for(resolve(cfg), cfg.nproc, pick_device(cfg.device), cfg.nproc))
    owner = int(os.environ.get("RANK", "0")) == 0
    with locked(cfg.out) if owner else nullcontext():
        if cfg.nproc > 1 and not under_torchrun:
            from dtpshard.core.launch import launch_local, root_cause

            exits = launch_local(cfg.nproc, train_rank, (cfg,), grace=cfg.timeout, who="dtpshard distill")
            line = root_cause(exits)
            if line is not None:
                raise UserError(line if " failed: " in line else f"{line}; the run stopped (rerun the same "
                                                                  "command to resume)")
            return Path(cfg.out).absolute()
        return run_distributed(cfg, train)


def memory_plan(cfg: DistillConfig):  # -> training.memory's MemoryPlan, not imported here (it imports torch)
    """`distill --plan`: the memory plan per process, from config.json alone."""
    from dtpshard.core.devices import pick_device
    from dtpshard.training.memory import plan_for
    from dtpshard.training.recipe import resolve

    check_config(cfg)
    world = cfg.plan_world or (cfg.nproc if cfg.nproc > 1 else int(os.environ.get("WORLD_SIZE", "1")))
    local = cfg.nproc if cfg.nproc > 1 and cfg.plan_world is None else None
    return plan_for(resolve(cfg), world, pick_device(cfg.device), local)
