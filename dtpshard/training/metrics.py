"""RUN/metrics.jsonl: one JSON object per line ({"kind": "train", ...} and {"kind": "eval", ...}),
appended and fsync'ed row by row, never through a link; optionally mirrored as TensorBoard
scalars. A resume rewinds it to its checkpoint's length (training/rundir.py)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError, naming
from dtpshard.core.io import append_bytes, atomic_path, check_regular, dumps, loads, read_bytes
from dtpshard.training.settings import require_tensorboard

METRICS = "metrics.jsonl"
_ROW_BYTES = 1 << 16  # a metrics row is ~200 bytes
METRICS_BYTES = 1 << 31  # metrics.jsonl: millions of rows


class Metrics:
    """Append-only JSONL, flushed per row; truncate() rewinds to a checkpoint's length.

    With `tensorboard` (a directory) every row is also written as TensorBoard scalars
    (train/loss, train/kl, ..., eval/kl, eval/ppl against the step); metrics.jsonl stays the
    record. A resumed run purges the events after its checkpoint's step, as it truncates the file."""

    def __init__(self, run: Path, tensorboard: Path | None = None, start: int = 0):
        self.path = run / METRICS
        self.writer = None
        if tensorboard is not None:
            require_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            # rows up to step `start` are covered by the checkpoint: the resumed run writes start + 1 on
            if start:
                _after_older_event_files(Path(tensorboard))
            self.writer = SummaryWriter(str(tensorboard), purge_step=start + 1 if start else None)

    def size(self) -> int:
        return self.path.stat().st_size if check_regular(self.path) else 0

    def truncate(self, size: int) -> None:
        """Rewind to a checkpoint's length (the first thing a run does with its metrics): a
        metrics.jsonl that is not a regular file (a FIFO would block the appends) is refused."""
        if self.size() > size:
            data = read_bytes(self.path, METRICS_BYTES, "metrics file")[:size]
            with atomic_path(self.path) as tmp:
                tmp.write_bytes(data)
        else:  # created if missing, and checked before any step: never appended through a link
            append_bytes(self.path, b"")

    def append(self, row: dict[str, Any]) -> None:
        append_bytes(self.path, (dumps(row) + "\n").encode())  # strict JSON: a NaN is written null
        if self.writer is not None:
            kind = row.get("kind", "train")
            for key, value in row.items():
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                if number and key not in ("kind", "step", "tokens", "wall"):
                    self.writer.add_scalar(f"{kind}/{key.removeprefix(kind + '_')}", value, row["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class NoMetrics:
    """The metrics of a rank that is not rank 0: rank 0 writes the run's record, the others nothing."""

    def size(self) -> int:
        return 0

    def truncate(self, size: int) -> None:
        pass

    def append(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def metrics_for(run: Path, main: bool, tensorboard: Path | None = None, start: int = 0) -> Metrics | NoMetrics:
    return Metrics(run, tensorboard, start) if main else NoMetrics()


def read_metrics(run: Path) -> list[dict[str, Any]]:
    """All complete rows of RUN/metrics.jsonl (a half-written last line is dropped; anything else
    that is not a JSON object per line is refused, naming the file and line)."""
    rows = []
    path = Path(run) / METRICS
    if os.path.lexists(path):
        with naming(path):
            lines = read_bytes(path, METRICS_BYTES, "metrics file").decode("utf-8").split("\n")
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if len(line) > _ROW_BYTES:
                raise UserError(f"{path}:{n}: {len(line)} bytes, more than a metrics row can need")
            try:
                row = loads(line, f"{path}:{n}")
            except json.JSONDecodeError as e:
                if n == len(lines):  # no newline after it: a write cut short by a kill
                    break
                raise UserError(f"{path}:{n}: malformed JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{n}: expected a JSON object per line")
            rows.append(row)
    return rows


def _after_older_event_files(directory: Path) -> None:
    """Wait (at most a second) until a new event file sorts after the existing ones. TensorBoard
    reads a directory's event files in name order, and the name starts with the second the file
    was made: a resumed run's purge marker must come after the interrupted run's events."""
    stamps = [p.name.split(".")[3] for p in directory.glob("events.out.tfevents.*")]
    newest = max((int(t) for t in stamps if t.isdigit()), default=0)
    while time.time() < newest + 1:
        time.sleep(0.05)
