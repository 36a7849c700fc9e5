"""What a study's students lose on benchmarks: every model scored on the same items, kept per
item, and the rows of `downstream.json`.

A model is scored once and kept in `downstream/NAME.json` (its per-item rows, downstream/evaluate.py)
in the study's folder, so an interrupted study resumes at the next model. `downstream.json` is a
list of rows {arm, seed, step, task, n, acc, acc_norm}: the teacher as arm "teacher" (step null),
an untrained arm at step 0; every other row also says, against the teacher on the same items,
`diff` (points, by the task's primary metric), `diff_ci` (its 95% interval) and `disagree`.
`read_downstream` checks each row as what it measures before a report draws it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError
from dtpshard.core.io import atomic_write_text, dumps, read_json, read_json_object
from dtpshard.core.settings import DTPFlags
from dtpshard.downstream.evaluate import accuracy, compare
from dtpshard.downstream.tasks import TASKS
from dtpshard.studies.stats import is_fraction, is_number

TEACHER = "teacher"
ROWS = "downstream.json"
KEPT = "downstream"  # the folder of every model's per-item rows


@dataclass(frozen=True)
class Scored:
    """One model of a study: its arm, seed and step (None: the teacher; 0: untrained), and how to load it."""

    arm: str
    seed: int | None
    step: int | None
    model: Path
    devices: int | None = None
    delay: float | None = None
    layout: Path | None = None

    @property
    def name(self) -> str:
        if self.step is None:
            return self.arm
        return f"{self.arm}-step{self.step}" if self.seed is None else f"{self.arm}-s{self.seed}-step{self.step}"


def score(study: Path, scored: Scored, tasks: list[str], limit: int | None, device: str = "cpu") -> dict:
    """The model's per-item rows {task: [...]}, each task scored once at this limit and kept in
    study/downstream/NAME.json: a rerun, or another task list, scores only the tasks not kept yet."""
    from dtpshard.downstream.evaluate import load_for_tasks, score_items
    from dtpshard.downstream.lm import language_model

    kept = Path(study) / KEPT / f"{scored.name}.json"
    have: dict[str, Any] = {}
    if kept.is_file():
        data = read_json_object(kept, "a model's benchmark items", max_bytes=1 << 28)
        if data.get("limit") == limit and isinstance(data.get("items"), dict):
            have = data["items"]
    missing = [t for t in tasks if t not in have]
    if missing:
        flags = DTPFlags(devices=scored.devices, delay=scored.delay)
        net, tok, length = load_for_tasks(scored.model, flags, scored.layout, device, None)
        have.update(score_items(language_model(net, tok, length), missing, limit))
        kept.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(kept, dumps({"limit": limit, "model": str(scored.model), **net.dtp_settings(),
                                       "items": have}) + "\n")
    return {t: have[t] for t in tasks}


def rows(scored: list[Scored], items: dict[str, dict], teacher: str = TEACHER) -> list[dict[str, Any]]:
    """downstream.json's rows of every scored model (`items` by Scored.name), the teacher's first."""
    out = []
    base = items[teacher]
    for s in scored:
        diffs = None if s.arm == teacher else compare(items[s.name], base)["tasks"]
        for task, its in items[s.name].items():
            row = {"arm": s.arm, "seed": s.seed, "step": s.step, "task": task, **accuracy(its)}
            if diffs is not None:
                row.update({k: diffs[task][k] for k in ("diff", "diff_ci", "diff_sd", "disagree")})
            out.append(row)
    return out


def write_rows(study: Path, table: list[dict[str, Any]]) -> Path:
    path = Path(study) / ROWS
    atomic_write_text(path, dumps(table, indent=1) + "\n")
    return path


def read_downstream(path: Path) -> list[dict[str, Any]]:
    """downstream.json's rows, each checked as what it measures, or one line naming the file."""
    raw = read_json(path, "benchmark rows", max_bytes=1 << 26)
    if not isinstance(raw, list):
        raise UserError(f"{path}: must be a list of rows")
    for i, row in enumerate(raw):
        why = _bad(row)
        if why:
            raise UserError(f"{path}: row {i}: {why}")
    return raw


def _bad(row: Any) -> str:
    if not isinstance(row, dict):
        return "not an object"
    if not isinstance(row.get("arm"), str) or not row["arm"]:
        return "arm must be a name"
    if row.get("task") not in TASKS:
        return f"task {row.get('task')!r} is not one dtpshard scores"
    if row["arm"] == TEACHER and row.get("step") is not None:
        return "the teacher's step must be null"
    for key in ("seed", "step"):
        v = row.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            return f"{key} must be a whole number >= 0 or null"
    if not isinstance(row.get("n"), int) or isinstance(row["n"], bool) or row["n"] < 1:
        return "n must be a whole number >= 1"
    if not is_fraction(row.get("acc")):
        return "acc must be a fraction from 0 to 1"
    if row.get("acc_norm") is not None and not is_fraction(row["acc_norm"]):
        return "acc_norm must be a fraction from 0 to 1 or null"
    if "diff" in row:
        ci = row.get("diff_ci")
        if not (is_number(row["diff"]) and -100 <= row["diff"] <= 100 and isinstance(ci, list) and len(ci) == 2
                and all(is_number(c) and -200 <= c <= 200 for c in ci) and ci[0] <= row["diff"] <= ci[1]):
            return "diff must be points from -100 to 100 inside its diff_ci [low, high]"
        if not is_fraction(row.get("disagree")):
            return "disagree must be a fraction from 0 to 1"
        if not (is_number(row.get("diff_sd")) and 0 <= row["diff_sd"] <= 200):
            return "diff_sd must be points from 0 to 200"
    return ""


def run(study: Path, models: list[Scored], tasks: list[str], limit: int | None = None,
        device: str = "cpu") -> list[dict[str, Any]]:
    """Score every model (the teacher first, arm TEACHER), resuming, and write downstream.json."""
    from tqdm import tqdm

    if not models or models[0].arm != TEACHER:
        raise UserError(f"a study's first model is its teacher (arm {TEACHER!r})")
    items = {}
    for m in tqdm(models, desc="models", unit="model"):
        items[m.name] = score(study, m, tasks, limit, device)
        write_rows(study, rows([s for s in models if s.name in items], items))
    return read_downstream(Path(study) / ROWS)


def for_experiment(cfg: Any, model: Path, layouts: dict[str, Path], out: Path) -> list[dict[str, Any]]:
    """An experiment's [eval]: the teacher, every layout untrained (step 0, the layout applied to the
    teacher) and every finished run's student (its final step), on the same items."""
    from dtpshard.training.rundir import FINAL, is_done

    models = [Scored(TEACHER, None, None, model, 1, 0)]
    models += [Scored(name, None, 0, model, cfg.devices, cfg.delay, path) for name, path in layouts.items()]
    for arm in cfg.arms:
        for spec in arm.layouts:
            for seed in arm.seeds:
                done = out / "runs" / arm.run_name(spec.name, seed)
                if is_done(done):
                    models.append(Scored(done.name.removesuffix(f"-s{seed}"), seed, cfg.training.steps, done / FINAL))
    return run(out, models, list(cfg.eval.tasks), cfg.eval.limit, cfg.device if cfg.device != "auto" else "cpu")


def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's drop against the teacher over every item of its rows (each task's n, diff and
    diff_sd give the pooled mean and sd exactly), with its 95% interval; and its share of differing
    choices."""
    from dtpshard.downstream.evaluate import Z95

    n = sum(r["n"] for r in rows)
    if n == 0 or any("diff" not in r for r in rows):
        return {"n": n, "diff": None, "diff_ci": None, "disagree": None}
    mean = sum(r["n"] * r["diff"] for r in rows) / n
    squares = sum((r["n"] - 1) * r["diff_sd"] ** 2 + r["n"] * r["diff"] ** 2 for r in rows)
    half = Z95 * (max(0.0, squares - n * mean ** 2) / max(1, n - 1) / n) ** 0.5
    return {"n": n, "diff": mean, "diff_ci": [mean - half, mean + half],
            "disagree": sum(r["n"] * r["disagree"] for r in rows) / n}


def kl_key(arm: str, seed: int | None, step: int | None) -> str:
    """A model's key in the section's `kl`: arm@step (untrained: step 0), arm-sSEED@step for a
    seeded run (each seed its own KL)."""
    return f"{arm}@{step}" if seed is None else f"{arm}-s{seed}@{step}"


def report_lines(study: Any) -> list[str]:
    """The Downstream section of an experiment's report (none without downstream.json)."""
    path = Path(study.directory) / ROWS
    if not path.is_file():
        return []
    kl = {f"{name}@0": lay.zero_kl for name, lay in study.layouts.items() if lay.zero_kl is not None}
    for r in study.runs:
        if r.kl.steps.size:
            kl[kl_key(r.name.removesuffix(f"-s{r.seed}"), r.seed, int(r.kl.steps[-1]))] = float(r.kl.values[-1])
    limit = study.config.eval.limit if study.config is not None else None
    return section(read_downstream(path), kl, limit)


def section(table: list[dict[str, Any]], kl: dict[str, float], limit: int | None = None) -> list[str]:
    """The report's "Downstream" section from downstream.json's rows: accuracy per model and task
    (chance and the teacher first), each model's pooled drop with its interval and differing
    choices, and how well the KL predicts the drop across models (`kl`: by `kl_key`)."""
    from dtpshard.studies.stats import bootstrap_pearson, correlate

    tasks = list(dict.fromkeys(r["task"] for r in table))
    models: dict[tuple, list[dict[str, Any]]] = {}
    for r in table:
        models.setdefault((r["arm"], r["seed"], r["step"]), []).append(r)

    def acc(r: dict[str, Any]) -> float:
        return r["acc_norm"] if TASKS[r["task"]].norm else r["acc"]

    head = ["model", "step", *tasks, "drop [95% CI]", "differ"]
    lines = ["## Downstream", "",
             f"Accuracy in points on {len(tasks)} tasks by lm-eval's own definitions (acc_norm where a task has it, "
             f"else acc), {'every item' if limit is None else f'the first {limit} items'} of each validation split, "
             "the same items for every model. The drop is the model's minus the teacher's, pooled over every item, "
             "with its 95% interval; differ is the share of items on which its choice is not the teacher's.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             "| chance | | " + " | ".join(f"{100 * TASKS[t].chance:.1f}" for t in tasks) + " | | |"]
    xs, ys = [], []
    for (arm, seed, step), rs in models.items():
        by = {r["task"]: r for r in rs}
        cells = [f"{100 * acc(by[t]):.1f}" if t in by else "–" for t in tasks]
        p = pooled(rs)
        drop = "" if p["diff"] is None else f"{p['diff']:+.2f} [{p['diff_ci'][0]:+.2f}, {p['diff_ci'][1]:+.2f}]"
        differ = "" if p["disagree"] is None else f"{100 * p['disagree']:.1f}%"
        name = arm if seed is None else f"{arm} (seed {seed})"
        lines.append(f"| {name} | {'' if step is None else step} | " + " | ".join(cells) + f" | {drop} | {differ} |")
        key = kl_key(arm, seed, step)
        if p["diff"] is not None and key in kl:
            xs.append(kl[key])
            ys.append(p["diff"])
    fit = correlate(xs, ys)
    if fit.r is not None:
        ci = bootstrap_pearson(xs, ys)
        lines += ["", f"Across the {fit.n} models, the held-out KL to the teacher predicts the drop with Pearson "
                      f"r = {fit.r:.3f}" + ("" if ci is None else f" (95% bootstrap interval {ci.low:.3f} to "
                                                                   f"{ci.high:.3f})")
                  + f"; the least-squares line: drop = {fit.slope:.2f} × KL {fit.intercept:+.2f} points."]
    return lines + [""]
