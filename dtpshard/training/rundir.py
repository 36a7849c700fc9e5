"""A distillation run directory that explains itself and survives a kill at any moment.

    RUN/config.json     the resolved configuration (written once; a rerun must match it)
    RUN/metrics.jsonl   one JSON object per line: {"kind": "train", ...} and {"kind": "eval", ...}
    RUN/checkpoint.pt   the last good checkpoint (one file, replaced atomically by rename)
    RUN/checkpoint.dcp/ instead, with --fsdp: each rank's shards (fsdp.py)
    RUN/final/          the student (DTPModel.save_pretrained), written when training ends
    RUN/DONE            written last, atomically

A checkpoint records the byte length of metrics.jsonl when it was taken; resuming truncates
the file there, so rows written after the last checkpoint (and a half-written last line) are
dropped and recomputed identically.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dtpshard.core.errors import UserError
from dtpshard.core.io import atomic_path, atomic_write_text

CONFIG = "config.json"
METRICS = "metrics.jsonl"
CHECKPOINT = "checkpoint.pt"
SHARDED_CHECKPOINT = "checkpoint.dcp"
FINAL = "final"
DONE = "DONE"
OWNED = (CONFIG, METRICS, CHECKPOINT, SHARDED_CHECKPOINT, FINAL, DONE)


def _show(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, str) else v


def config_differences(old: dict[str, Any], new: dict[str, Any], keys: list[str]) -> list[str]:
    """'name OLD (now NEW)' for every compared setting that differs."""
    out = []
    for k in keys:
        if old.get(k) == new.get(k):
            continue
        base = k.removesuffix("_sha256")
        if base != k and base in new:  # a content hash: name what it is the hash of
            out.append(f"{base} content changed ({_show(old.get(base))} vs now {_show(new.get(base))})")
        else:
            out.append(f"{k} {_show(old.get(k))} (now {_show(new.get(k))})")
    return out


def check_run(run: Path, config: dict[str, Any], compared: list[str], force: bool,
              added: dict[str, Any] | None = None) -> bool:
    """Whether RUN already holds this run (resume); refuse a RUN of other settings unless force.
    added: settings newer than some run directories, with the value those runs had implicitly.

    Read-only, so every rank of a data-parallel run can call it and fail the same way."""
    if run.exists() and not run.is_dir():
        raise UserError(f"--out {run}: exists and is not a directory")
    if not (run / CONFIG).is_file():
        if run.is_dir() and any(p.name in OWNED for p in run.iterdir()):
            if not force:
                raise UserError(f"--out {run}: has run files but no {CONFIG} (use --force to start it over)")
        return False
    try:
        old = json.loads((run / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        if force:
            return False
        raise UserError(f"{run / CONFIG}: unreadable ({e}); use --force to start the run over") from None
    diff = config_differences({**(added or {}), **old}, config, compared)
    if diff and not force:
        raise UserError(f"--out {run} was made with different settings: {'; '.join(diff)} "
                        "(use --force to start it over, or another --out)")
    return not diff


def start_over(run: Path) -> None:
    """Remove this run's own files (never anything else in the directory)."""
    for name in OWNED:
        p = run / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    clean_temporaries(run)


def clean_temporaries(run: Path) -> None:
    """Leftovers of a kill during an atomic write (.NAME.tmp-PID files and directories)."""
    if not run.is_dir():
        return
    for p in run.iterdir():
        if p.name.startswith(".") and ".tmp-" in p.name and p.name[1:].split(".tmp-")[0] in OWNED:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def write_config(run: Path, config: dict[str, Any]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run / CONFIG, json.dumps(config, indent=1, sort_keys=True) + "\n")


def is_done(run: Path) -> bool:
    return (run / DONE).is_file() and (run / FINAL).is_dir()


def mark_done(run: Path, summary: dict[str, Any]) -> None:
    atomic_write_text(run / DONE, json.dumps(summary) + "\n")


class Metrics:
    """Append-only JSONL, flushed per row; truncate() rewinds to a checkpoint's length.

    With `tensorboard` (a directory) every row is also written as TensorBoard scalars
    (train/loss, train/kl, ..., eval/kl, eval/ppl against the step); metrics.jsonl stays the
    record. A resumed run purges the events after its checkpoint's step, as it truncates the file."""

    def __init__(self, run: Path, tensorboard: Path | None = None, start: int = 0):
        self.path = run / METRICS
        self.writer = None
        if tensorboard is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("--tensorboard needs the tensorboard package (pip install tensorboard)") from None
            # rows up to step `start` are covered by the checkpoint: the resumed run writes start + 1 on
            self.writer = SummaryWriter(str(tensorboard), purge_step=start + 1 if start else None)

    def size(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def truncate(self, size: int) -> None:
        if self.size() > size:
            data = self.path.read_bytes()[:size]
            with atomic_path(self.path) as tmp:
                tmp.write_bytes(data)
        elif not self.path.exists():
            self.path.touch()

    def append(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.writer is not None:
            kind = row.get("kind", "train")
            for key, value in row.items():
                if key not in ("kind", "step", "tokens", "wall") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(f"{kind}/{key.removeprefix(kind + '_')}", value, row["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(run: Path) -> list[dict[str, Any]]:
    """All complete rows of RUN/metrics.jsonl."""
    rows = []
    path = Path(run) / METRICS
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a half-written last line
    return rows


def save_checkpoint(run: Path, state: dict[str, Any]) -> None:
    """torch.save to a temporary sibling, fsync, rename: the old checkpoint stays until the new one is whole."""
    with atomic_path(run / CHECKPOINT) as tmp:
        torch.save(state, tmp)


def load_checkpoint(run: Path) -> dict[str, Any] | None:
    path = run / CHECKPOINT
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a corrupt file comes in many exception types
        raise UserError(f"{path}: unreadable checkpoint ({type(e).__name__}); use --force to start over") from None


def remove_checkpoint(run: Path) -> None:
    (run / CHECKPOINT).unlink(missing_ok=True)
    shutil.rmtree(run / SHARDED_CHECKPOINT, ignore_errors=True)
