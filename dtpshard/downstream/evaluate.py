"""Accuracy on benchmark tasks, per item, and what a student loses against its teacher.

`score_items` runs lm-eval's evaluator over a model (downstream/lm.py) on the offline tasks
(downstream/tasks.py) and keeps every item: whether the model's choice is right by `acc` and by
`acc_norm`, and which choice it made. `compare` pairs two models' items: the difference in points
(student - teacher) with a 95% interval over the items, and the share of items on which they
choose differently, per task and pooled over every item of every task. The metric compared is
`acc_norm` where the task has it, else `acc` (`primary`).
"""
from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any

from dtpshard.core.cache import cache_dir
from dtpshard.core.errors import UserError
from dtpshard.downstream.tasks import TASKS, write_task_configs

Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval


def primary(name: str) -> str:
    """The metric a task is compared by: acc_norm where lm-eval reports it, else acc."""
    return "acc_norm" if TASKS[name].norm else "acc"


@contextlib.contextmanager
def _quiet() -> Any:
    """lm-eval and datasets log every task build at INFO: progress is the bar's, the rest noise."""
    names = ("lm-eval", "lm_eval", "datasets", "evaluate")
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.WARNING)
    try:
        yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)


def score_items(lm: Any, names: list[str], limit: int | None) -> dict[str, list[dict[str, Any]]]:
    """{task: [{doc_id, acc, acc_norm, choice, choice_norm}, ...] in item order} of lm-eval's LM
    `lm` (acc_norm and choice_norm None where the task has no acc_norm). `limit`: each task's
    first N items, as lm-eval's --limit."""
    if limit is not None and limit < 1:
        raise UserError(f"--limit {limit}: must be at least 1 (items per task)")
    from lm_eval.evaluator import evaluate
    from lm_eval.tasks import TaskManager

    cache = cache_dir()  # the task YAMLs (the same for every run of this install) and the datasets' copies
    with _quiet():
        manager = TaskManager(include_path=str(write_task_configs(cache / "lm-eval-tasks", names, cache / "datasets")))
        loaded = manager.load(names)
        tasks = loaded["tasks"]
        results = evaluate(lm, loaded, limit=limit, bootstrap_iters=0, log_samples=True, verbosity="WARNING")
    out = {}
    for name in names:
        task = tasks[name]
        rows = []
        for s in sorted(results["samples"][name], key=lambda s: s["doc_id"]):
            lls = [float(r[0]) for r in s["filtered_resps"]]
            lengths = [float(len(c)) for c in task.doc_to_choice(s["doc"])]
            norm = TASKS[name].norm
            rows.append({"doc_id": int(s["doc_id"]), "acc": float(s["acc"]),
                         "acc_norm": float(s["acc_norm"]) if norm else None,
                         "choice": max(range(len(lls)), key=lls.__getitem__),
                         "choice_norm": max(range(len(lls)), key=lambda i: lls[i] / lengths[i]) if norm else None})
        out[name] = rows
    return out


def accuracy(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(rows)
    acc_norm = [r["acc_norm"] for r in rows if r["acc_norm"] is not None]
    return {"n": n, "acc": sum(r["acc"] for r in rows) / n if n else None,
            "acc_norm": sum(acc_norm) / len(acc_norm) if acc_norm and len(acc_norm) == n else None}


def paired(diffs: list[float]) -> dict[str, Any]:
    """Mean of per-item differences and its 95% interval (normal, over the items), in points."""
    n = len(diffs)
    if n == 0:
        return {"diff": None, "diff_ci": None, "diff_sd": None}
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    half = Z95 * math.sqrt(var / n)
    return {"diff": 100 * mean, "diff_ci": [100 * (mean - half), 100 * (mean + half)], "diff_sd": 100 * math.sqrt(var)}


def compare(student: dict[str, list[dict[str, Any]]], teacher: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per task and pooled: student - teacher in points by the task's primary metric with its 95%
    interval, and the share of items whose choice differs (by that metric's choice)."""
    per, pooled_d, pooled_x = {}, [], []
    for name, rows in student.items():
        theirs = {r["doc_id"]: r for r in teacher[name]}
        if sorted(theirs) != [r["doc_id"] for r in rows]:
            raise UserError(f"{name}: the student and the teacher were scored on other items")
        metric, pick = primary(name), "choice_norm" if TASKS[name].norm else "choice"
        d = [r[metric] - theirs[r["doc_id"]][metric] for r in rows]
        x = [float(r[pick] != theirs[r["doc_id"]][pick]) for r in rows]
        per[name] = {"metric": metric, **paired(d), "disagree": sum(x) / len(x) if x else None}
        pooled_d += d
        pooled_x += x
    return {"tasks": per, "pooled": {**paired(pooled_d), "n": len(pooled_d),
                                     "disagree": sum(pooled_x) / len(pooled_x) if pooled_x else None}}


def summary(items: dict[str, list[dict[str, Any]]], teacher: dict[str, list[dict[str, Any]]] | None) -> dict[str, Any]:
    """The result object of `dtpshard eval --tasks` (its --json): per task the model's acc and
    acc_norm, chance, and with a teacher teacher_acc, teacher_acc_norm, diff, diff_ci, disagree;
    `pooled` over every item."""
    tasks: dict[str, Any] = {}
    for name, rows in items.items():
        tasks[name] = {**accuracy(rows), "chance": TASKS[name].chance, "metric": primary(name)}
    out: dict[str, Any] = {"tasks": tasks}
    if teacher is not None:
        diffs = compare(items, teacher)
        for name in tasks:
            t = accuracy(teacher[name])
            tasks[name].update({"teacher_acc": t["acc"], "teacher_acc_norm": t["acc_norm"], **diffs["tasks"][name]})
        out["pooled"] = diffs["pooled"]
    return out


def table(result: dict[str, Any]) -> str:
    """The result as a text table (points)."""
    with_teacher = "pooled" in result
    head = f"{'task':<16}{'n':>6}{'acc':>8}{'acc_norm':>10}{'chance':>8}"
    if with_teacher:
        head += f"{'teacher':>9}{'diff':>8}{'95% CI':>18}{'differ':>8}"
    lines = [head]

    def pt(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}"

    for name, t in result["tasks"].items():
        line = f"{name:<16}{t['n']:>6}{pt(t['acc']):>8}{pt(t['acc_norm']):>10}{pt(t['chance']):>8}"
        if with_teacher:
            teach = t["teacher_acc_norm"] if t["metric"] == "acc_norm" else t["teacher_acc"]
            ci = f"[{t['diff_ci'][0]:+.1f}, {t['diff_ci'][1]:+.1f}]"
            line += f"{pt(teach):>9}{t['diff']:>+8.1f}{ci:>18}{pt(t['disagree']):>8}"
        lines.append(line)
    if with_teacher:
        p = result["pooled"]
        ci = f"[{p['diff_ci'][0]:+.1f}, {p['diff_ci'][1]:+.1f}]"
        lines.append(f"{'pooled':<16}{p['n']:>6}{'':>8}{'':>10}{'':>8}{'':>9}{p['diff']:>+8.1f}{ci:>18}"
                     f"{pt(p['disagree']):>8}")
        lines.append("(diff: student - teacher in points, by acc_norm where the task has it, else acc; "
                     "differ: % of items where their choices differ)")
    return "\n".join(lines)


def load_for_tasks(model: Path, dtp: Any, layout: Path | None, device: str, tokenizer: Path | None,
                   dtype: Any = None) -> tuple:
    """(DTPModel with its weights in `dtype` (fp32 unless given), its tokenizer, its length as lm-eval
    resolves it)."""
    import torch
    from lm_eval.models.utils import resolve_max_length

    from dtpshard.model.dtp import DTPModel

    net = DTPModel.from_pretrained(model, dtp.devices, dtp.delay, dtype=dtype or torch.float32, layout=layout,
                                   stage3=dtp.stage3, device=device)
    tok = net.checkpoint.tokenizer(tokenizer)
    return net, tok, resolve_max_length(net.hf_config, tok, default=2048)


def benchmark(model: Path, dtp: Any, tasks: list[str], *, limit: int | None = None, layout: Path | None = None,
              teacher: Path | None = None, tokenizer: Path | None = None, device: str = "cpu",
              autocast: Any = contextlib.nullcontext, dtype: Any = None) -> dict[str, Any]:
    """`dtpshard eval MODEL --tasks ...`'s work -> summary(...) with "items" (per task and model,
    the per-item rows) and the settings. The teacher (dense) is scored on the same items.
    autocast, dtype: what every forward runs under and the weights' dtype (fp32 unless given); the
    command passes training/precision.py's, for bf16-mixed bf16 autocast and bf16 weights (a frozen
    model's, so no forward casts them again), the log-softmax in fp32 either way."""
    from dtpshard.core.settings import DTPFlags
    from dtpshard.downstream.lm import language_model
    from dtpshard.downstream.tasks import resolve

    names = resolve(tasks)
    DENSE = DTPFlags(devices=1, delay=0)  # the teacher as it is: one device, nothing delayed
    if limit is not None and limit < 1:
        raise UserError(f"--limit {limit}: must be at least 1 (items per task)")
    net, tok, length = load_for_tasks(model, dtp, layout, device, tokenizer, dtype)
    dense = None
    if teacher is not None:
        dense, dense_tok, _ = load_for_tasks(teacher, DENSE, None, device, tokenizer, dtype)
        if dense.shape.vocab != net.shape.vocab or len(dense_tok) != len(tok):
            raise UserError(f"--teacher {teacher}: another vocabulary than {model} ({len(dense_tok)} tokens "
                            f"against {len(tok)}); a teacher is scored on the student's items, token for token")
    items = score_items(language_model(net, tok, length, autocast=autocast), names, limit)
    theirs = (score_items(language_model(dense, tok, length, autocast=autocast), names, limit)
              if dense is not None else None)
    result = summary(items, theirs)
    weights = str(next(net.parameters()).dtype).removeprefix("torch.")
    result.update({"model": str(model), **net.dtp_settings(), "weights": weights,
                   "layout": None if layout is None else str(layout),
                   "teacher": None if teacher is None else str(teacher), "limit": limit,
                   "items": {"model": items, **({"teacher": theirs} if theirs is not None else {})}})
    return result
