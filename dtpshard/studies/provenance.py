"""What an experiment records about itself: provenance.json (versions, the git commit, the model
files' sha256, the data and token counts), written once at the start, and timings.json (wall
seconds per phase, added up over resumed runs). Read back by the report (studies/study.py)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from dtpshard.core.io import atomic_write_text, read_json_object

TIMINGS, PROVENANCE = "timings.json", "provenance.json"


class timed:
    """Adds the wall time of a phase to DIR/timings.json when it ends (a resumed phase adds up)."""

    def __init__(self, out: Path, phase: str):
        self.out, self.phase = out, phase

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        path = self.out / TIMINGS
        seconds = read_json_object(path, "timings") if path.is_file() else {}
        seconds[self.phase] = round(float(seconds.get(self.phase, 0.0)) + time.perf_counter() - self.t0, 3)
        atomic_write_text(path, json.dumps(seconds, indent=1) + "\n")


def _commit() -> str | None:
    """The git commit of the dtpshard source running (+ "-dirty" with uncommitted changes), if a checkout."""
    import subprocess

    src = Path(__file__).resolve().parents[2]
    try:
        top = subprocess.run(["git", "-C", str(src), "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             timeout=10)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != src:  # an install inside another repo
            return None
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no", "--", "dtpshard"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:  # e.g. dtpshard run from a checkout that was never installed
        return None


def write_provenance(cfg: dict[str, Any], model: Path, out: Path, source: dict[str, Any] | None) -> None:
    """DIR/provenance.json, written once: versions, the model files' sha256, the data and token counts.
    `source`: what the model directory was made from (None: asked of studies.smollm2 for its key)."""
    path = out / PROVENANCE
    if path.is_file():
        return
    import hashlib
    import platform

    from dtpshard.studies.smollm2 import MODEL_KEY, model_source

    if source is None and cfg["model"] == MODEL_KEY:
        source = model_source()

    from dtpshard.model.checkpoint import open_checkpoint

    def sha256(p: Path) -> str:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        return h.hexdigest()

    files = open_checkpoint(model).files.files
    cal, ev, train = cfg["calibration"], cfg["evaluation"], cfg["training"]
    from dtpshard.training.recipe import DistillConfig

    d = DistillConfig(teacher=model, out=out)
    t = {k: train.get(k, getattr(d, k)) for k in ("steps", "seq_len", "micro_batch", "grad_accum", "nproc")}
    record = {
        "versions": {p: _version(p) for p in ("dtpshard", "torch", "transformers", "numpy", "scipy")},
        "dtpshard_commit": _commit(),
        "python": platform.python_version(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "model": str(model), "model_files": {f.name: sha256(f) for f in files}, "model_source": source,
        "data": {"calibration": cal["text"] or cal["dataset"] or "offline",
                 "evaluation": ev["text"] or ev["dataset"] or "offline",
                 "training": train.get("text") or train.get("dataset") or "offline"},
        "tokens": {"calibration": cal["blocks"] * cal["seq_len"], "evaluation": ev["blocks"] * (t["seq_len"] + 1),
                   "training_per_run": t["steps"] * t["micro_batch"] * t["grad_accum"] * t["nproc"] * t["seq_len"]},
    }
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
