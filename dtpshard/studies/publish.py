"""A study published: an experiment directory's records copied where others read them, each input
named by what it is, never by where it lay on the machine that ran it (docs/results/).

An experiment directory keeps the paths it ran with: a run's config.json names its teacher, layout
and teacher cache by their paths, and a resume compares the teacher's (training/settings.py), and
provenance.json names the model directory whose recorded hashes a student's card reuses
(training/card.py). So the records are made portable when they are published, not when written:
a path inside the experiment becomes relative to it ("layouts/optimised.json", "teacher-cache"), one
inside another experiment becomes "../NAME/..." (a run copied in from it, published beside it), the
model becomes what the study calls it (its key or hub id; provenance.json's model_files and
model_source say what it held), and any other path its file name alone (the data's hashes say what
it held). The report is then written from the published records."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError
from dtpshard.core.guard import check_outputs
from dtpshard.core.io import atomic_dir, copy_regular, dumps
from dtpshard.core.reading import SMALL_JSON, read_json, read_json_object
from dtpshard.studies import provenance as p
from dtpshard.studies.config import FORMAT

METRICS_BYTES = 1 << 30  # a run's metrics.jsonl: a row per step and evaluation, far less for any run we know

# what a study publishes: its records and measurements, not weights, checkpoints or caches
TOP = ("config.json", p.PROVENANCE, p.TIMINGS, p.SCORES, p.ZEROSHOT, p.SENSITIVITY, "cost.json", "decode.json")
RUN_FILES = ("config.json", "metrics.jsonl", "DONE", "memory.json")
EXPERIMENT_FORMAT = FORMAT.split("/")[0] + "/"


def _experiment(path: Path) -> Path | None:
    """The experiment directory a path lies in (its nearest folder holding an experiment's config.json)."""
    for top in path.parents:
        try:
            if str(read_json_object(top / "config.json", "experiment config").get("format", "")).startswith(
                    EXPERIMENT_FORMAT):
                return top
        except (OSError, UserError):  # no config.json there, or not one an experiment wrote
            continue
    return None


def named(path: str, home: Path, model: Path | None, model_name: str, others: dict[Path, str]) -> str:
    """What a published record calls an absolute `path` (the module docstring's rule). `others`:
    the other experiment directories seen so far, by the name each is published under."""
    at = Path(os.path.normpath(path))
    if model is not None and at == model:
        return model_name
    if at == home or home in at.parents:
        return at.relative_to(home).as_posix()
    other = next((d for d in others if d == at or d in at.parents), None) or _experiment(at)
    if other is not None:
        others.setdefault(other, other.name)
        return (Path("..") / others[other] / at.relative_to(other)).as_posix()
    return at.name


def portable(value: Any, home: Path, model: Path | None, model_name: str, others: dict[Path, str]) -> Any:
    """A record with every absolute path in it `named`."""
    if isinstance(value, dict):
        return {k: portable(v, home, model, model_name, others) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v, home, model, model_name, others) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        return named(value, home, model, model_name, others)
    return value


def _model(directory: Path) -> tuple[Path | None, str]:
    """The model directory the experiment ran (provenance.json) and what its study calls it."""
    prov = read_json_object(directory / p.PROVENANCE, "provenance") if (directory / p.PROVENANCE).is_file() else {}
    study = str(read_json_object(directory / "config.json", "experiment config").get("model", ""))
    local = prov.get("model")
    name = Path(study).name if os.path.isabs(study) else study  # a local model: its folder's name
    return (Path(os.path.normpath(local)) if isinstance(local, str) and os.path.isabs(local) else None), name


def _files(directory: Path) -> list[Path]:
    """The published files, relative to the experiment directory."""
    files = [Path(n) for n in TOP if (directory / n).is_file()]
    if (directory / p.LAYOUT_DIR).is_dir():
        files += sorted(Path(p.LAYOUT_DIR) / f.name for f in (directory / p.LAYOUT_DIR).glob("*.json"))
    if (directory / p.RUNS).is_dir():
        for run in sorted((directory / p.RUNS).iterdir()):
            files += [Path(p.RUNS) / run.name / n for n in RUN_FILES if (run / n).is_file()]
    return files


def publish(directory: Path, out: Path) -> Path:
    """A new directory `out` with the experiment's records made portable and its report; returns
    the report's path."""
    from dtpshard.studies.report import write_report

    home = Path(os.path.normpath(Path(directory).absolute()))
    if not (home / "config.json").is_file():
        raise UserError(f"{directory}: not an experiment directory (no config.json)")
    check_outputs({"--out": Path(out)}, {"the experiment directory": home})
    model, model_name = _model(home)
    others: dict[Path, str] = {}
    with atomic_dir(out) as tmp:
        for rel in _files(home):
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            record = read_json(home / rel, str(rel), SMALL_JSON) if rel.suffix == ".json" else None
            published = portable(record, home, model, model_name, others)
            if published != record:  # a record that names no path is copied byte for byte
                (tmp / rel).write_text(dumps(published, indent=1) + "\n", encoding="utf-8")
            else:
                copy_regular(home / rel, tmp / rel, METRICS_BYTES, str(rel))
        write_report(tmp)
    return Path(out) / "report.md"
