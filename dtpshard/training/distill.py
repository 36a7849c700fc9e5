"""`dtpshard distill` (docs/design.md §4): train the DTP student to match the frozen dense teacher,
in one process, under torchrun, or in --nproc local processes started by the one local launcher
(dtpshard.core.launch). The recipe is DistillConfig (settings.py), the run recipe.py, the loop loop.py.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from dtpshard.core.errors import UserError
from dtpshard.core.lazy import lazy_exports
from dtpshard.training.settings import DistillConfig, Recipe, check_config

# the run's torch side, imported when first used: `dtpshard distill --help` reads only the settings
# (FROZEN, Student, Teacher, lr_factor, resolve and train_blocks_for are still importable from here)
__getattr__, _ = lazy_exports("dtpshard.training", dict.fromkeys(
    ("FROZEN", "Student", "Teacher", "lr_factor", "resolve", "train_blocks_for"), "recipe"))
__all__ = ["DistillConfig", "Recipe", "check_config", "distill", "distill_cmd"]


def _rank(cfg: DistillConfig) -> int:
    """One local rank of `--nproc K` (the launcher set RANK, WORLD_SIZE, ...)."""
    if "OMP_NUM_THREADS" not in os.environ:  # K processes share the cores, as under torchrun
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.nproc))
    distill(cfg)
    return 0


def distill(cfg: DistillConfig) -> Path:
    """Run (or resume, or finish) the distillation into cfg.out; returns the run directory."""
    from dtpshard.training.ddp import run_distributed
    from dtpshard.training.loop import train

    from contextlib import nullcontext

    from dtpshard.training.rundir import LOCKED_ENV, locked

    check_config(cfg)
    from dtpshard.core.io import refuse_overwriting

    # --force starts a run over by removing its files, config.json among them: never the teacher's
    refuse_overwriting(cfg.out, the_teacher_directory=cfg.teacher, the_tokenizer_directory=cfg.tokenizer,
                       the_teacher_cache=cfg.teacher_cache)
    from dtpshard.training.rundir import refuse_foreign, refuse_unrelated

    refuse_foreign(Path(cfg.out))  # before any model is read: a model's or an experiment's directory,
    refuse_unrelated(Path(cfg.out), cfg.force)  # or unrelated files
    # One process owns RUN: this one, or the launcher of a data-parallel group (for its ranks).
    owner = int(os.environ.get("RANK", "0")) == 0
    with locked(cfg.out) if owner else nullcontext():
        if cfg.nproc > 1 and "WORLD_SIZE" not in os.environ:
            from dtpshard.core.launch import launch_local, root_cause

            os.environ[LOCKED_ENV] = str(Path(cfg.out).absolute())  # the ranks inherit it
            try:
                exits = launch_local(cfg.nproc, _rank, (cfg,), grace=cfg.timeout, who="dtpshard distill")
            finally:
                os.environ.pop(LOCKED_ENV, None)
            line = root_cause(exits)
            if line is not None:
                raise UserError(line if " failed: " in line else f"{line}; the run stopped (rerun the same "
                                                                  "command to resume)")
            return Path(cfg.out).absolute()
        return run_distributed(cfg, train)


# -- `dtpshard distill` --------------------------------------------------------------------------
def distill_cmd(teacher: Path, cfg: DistillConfig, *, json: bool = False) -> int:
    """Distil the DTP student of TEACHER (L devices, delay δ, permuted by --layout) into the run
    directory --out: config.json, metrics.jsonl, checkpoints, final/ (the student) and DONE.
    Rerunning the same command on an interrupted run resumes it. Data-parallel: --nproc K, or
    `torchrun --nproc-per-node K -m dtpshard distill ...` (global batch = micro × accum × K); with
    --fsdp the processes share out the weights, gradients and optimizer state instead of each
    holding all of them.

    Args:
        teacher: the dense Hugging Face checkpoint directory
        cfg: the recipe; every DistillConfig field is a flag
        json: print one JSON object {student, metrics, steps, eval_kl, eval_ppl} instead of text
    """
    as_json = json
    run = distill(dataclasses.replace(cfg, teacher=Path(teacher)))
    if int(os.environ.get("RANK", "0")) == 0:
        import json as _json

        from dtpshard.training.rundir import DONE

        if as_json:
            summary = _json.loads((run / DONE).read_text())
            print(_json.dumps({"student": str(run / "final"), "metrics": str(run / "metrics.jsonl"), **summary}))
        else:
            print(f"student: {run / 'final'}  metrics: {run / 'metrics.jsonl'}")
    return 0
