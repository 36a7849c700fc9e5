"""What an experiment records about itself: provenance.json (versions, the git commit, the model
files' sha256, the data and token counts), written once at the start, and timings.json (wall
seconds per phase, added up over resumed runs). Read back by the report (studies/study.py)."""
from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtpshard.core.io import atomic_write_text, dumps, read_json_object
from dtpshard.studies.smollm2 import MODEL_KEY, model_source

if TYPE_CHECKING:
    from dtpshard.studies.config import Experiment

# an experiment directory's files (experiment.py writes them, study.py reads them)
TIMINGS, PROVENANCE, SCORES, ZEROSHOT = "timings.json", "provenance.json", "scores.json", "zeroshot.json"
SENSITIVITY = "sensitivity.json"  # per base layout, every module's measured sensitivity (partial arms)
LAYOUT_DIR, RUNS, TEACHER_CACHE = "layouts", "runs", "teacher-cache"


class timed:
    """Adds the wall time of a phase to DIR/timings.json when it ends (a resumed phase adds up)."""

    def __init__(self, out: Path, phase: str):
        self.out, self.phase = out, phase

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        path = self.out / TIMINGS
        seconds = read_json_object(path, "timings") if path.is_file() else {}
        before = seconds.get(self.phase)
        if isinstance(before, bool) or not isinstance(before, (int, float)):  # absent, or a hand edit
            before = 0.0
        seconds[self.phase] = round(float(before) + time.perf_counter() - self.t0, 3)
        atomic_write_text(path, dumps(seconds, indent=1) + "\n")


def _commit() -> str | None:
    """The git commit of the dtpshard source running (+ "-dirty" with uncommitted changes), if a checkout."""
    src = Path(__file__).resolve().parents[2]
    try:
        top = subprocess.run(["git", "-C", str(src), "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             timeout=10)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != src:  # an install inside another repo
            return None
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no", "--",
                                "dtpshard"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:  # e.g. dtpshard run from a checkout that was never installed
        return None


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def write_provenance(cfg: Experiment, model: Path, out: Path) -> None:
    """DIR/provenance.json, written once: versions, the model files' sha256, the data and token counts,
    and for the SmolLM2 key what the model directory was made from."""
    path = out / PROVENANCE
    if path.is_file():
        return
    from dtpshard.model.checkpoint import open_checkpoint

    source = model_source() if cfg.model == MODEL_KEY else None

    cal, ev, t = cfg.calibration, cfg.evaluation, cfg.training
    record = {
        "versions": {p: _version(p) for p in ("dtpshard", "torch", "transformers", "numpy", "scipy")},
        "dtpshard_commit": _commit(),
        "python": platform.python_version(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "threads": _threads(),  # a parallel sum's order: results are bit for bit the same only with as many
        "model": str(model), "model_files": open_checkpoint(model).weight_hashes(), "model_source": source,
        "data": {"calibration": cal.text or cal.dataset or "offline",
                 "evaluation": ev.text or ev.dataset or "offline",
                 "training": t.text or t.dataset or "offline"},
        "tokens": {"calibration": cal.blocks * cal.seq_len, "evaluation": ev.blocks * (t.seq_len + 1),
                   "training_per_run": t.steps * t.micro_batch * t.grad_accum * t.nproc * t.seq_len},
    }
    atomic_write_text(path, dumps(record, indent=1) + "\n")
