"""The report's section on adapter arms (runs/NAME-rRANK-sSEED, `distill --adapters`): every arm's
KL and top-1 at every evaluation beside full distillation of the same layout, what each trains,
its time per step and peak memory, and three answers computed from them: how much of full
distillation's KL the adapters reach, whether the optimised layout's head start survives, and at
which rank a larger rank stops paying.
"""
from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

from dtpshard.core.adapters import AdapterSettings, trainable_count
from dtpshard.core.io import atomic_path
from dtpshard.core.shape import ModelShape
from dtpshard.core.vocab import LAYOUT_KINDS
from dtpshard.studies.provenance import RUNS
from dtpshard.studies.stats import Curve, mean_curve, mean_sd, step_matching
from dtpshard.studies.study import Run, Study, _num, _read_json


@dataclasses.dataclass
class Arm:
    layout: str
    rank: int | None  # None: full distillation
    runs: list[Run]
    trainable: int | None
    step_seconds: list[float]  # per run: the median seconds of a training step (no evaluation in it)
    peak_rss: list[int]  # per run with a memory record: the training phase's peak, largest rank
    elsewhere: list[str]  # runs trained in another experiment: where (their config.json's out)
    threads: list[int]  # the intra-op threads the runs started with (config.json)

    @property
    def name(self) -> str:
        return f"{self.layout}, {'full' if self.rank is None else f'rank {self.rank}'}"

    @property
    def kl(self) -> Curve:
        return mean_curve([r.kl for r in self.runs])


def _shape(model: dict[str, Any]) -> ModelShape:
    """A run's config.json `model` (ModelShape.to_dict) as a ModelShape."""
    fields = {f.name for f in dataclasses.fields(ModelShape)}
    heads = model["heads"]
    return ModelShape(**{k: v for k, v in model.items() if k in fields},
                      heads_per_group=heads // model["kv_groups"])


def _home(study: Study) -> Path | None:
    """Where the adapter runs were trained (their config.json's out, less runs/NAME): a run trained
    elsewhere was copied in from another experiment (the directory may have moved since)."""
    for run in study.adapter_runs:
        out = (_read_json(study.directory / RUNS / run.name / "config.json", "run config") or {}).get("out")
        if out:
            return Path(str(out)).parent.parent
    return None


def _arm(study: Study, layout: str, rank: int | None, runs: list[Run], home: Path | None) -> Arm:
    from dtpshard.training.rundir import METRICS, read_metrics  # torch: only where there are runs

    trainable, seconds, peaks, elsewhere, threads = None, [], [], [], set()
    for run in runs:
        d = study.directory / RUNS / run.name
        cfg = _read_json(d / "config.json", "run config") or {}
        if isinstance(cfg.get("threads"), int) and cfg["threads"] > 0:
            threads.add(cfg["threads"])
        if cfg.get("model") and trainable is None:
            shape = _shape(cfg["model"])
            frozen = shape.vocab * shape.hidden * (1 if shape.tied else 2)
            trainable = shape.params() - frozen if rank is None else trainable_count(
                shape, AdapterSettings(rank, targets=tuple(cfg.get("adapter_targets") or AdapterSettings(1).targets)))
        where = Path(str(cfg.get("out") or "")).parent.parent
        if home is not None and cfg.get("out") and where != home:
            elsewhere.append(str(where))
        rows = read_metrics(d)
        walls = [_num(row, "wall", d / METRICS) for row in rows]
        gaps = [b - a for a, b, x, y in zip(walls, walls[1:], rows, rows[1:])
                if x.get("kind") == y.get("kind") == "train" and None not in (a, b)]
        if gaps:
            seconds.append(statistics.median(gaps))
        memory = _read_json(d / "memory.json", "memory record") or {}
        training = (memory.get("measured") or {}).get("training") or []
        if any(isinstance(v, int) for v in training):
            peaks.append(max(v for v in training if isinstance(v, int)))
    return Arm(layout, rank, runs, trainable, seconds, peaks, sorted(set(elsewhere)), sorted(threads))


def arms(study: Study) -> list[Arm]:
    """Every adapter arm, and the full-distillation arm of each layout an adapter arm trains."""
    groups: dict[tuple[str, int | None], list[Run]] = {}
    for run in study.adapter_runs:
        groups.setdefault((run.layout, run.adapters), []).append(run)
    for layout in sorted({k[0] for k in groups}):
        if layout in study.layouts and study.layouts[layout].runs:
            groups[(layout, None)] = list(study.layouts[layout].runs)
    kinds = {k: i for i, k in enumerate(LAYOUT_KINDS)}  # the paper's families first, full before each rank

    def order(key: tuple[str, int | None]) -> tuple:
        info = study.layouts.get(key[0])
        return kinds.get(info.kind if info else key[0], len(kinds)), key[0], key[1] is not None, key[1] or 0

    keys = sorted(groups, key=order)
    home = _home(study)
    return [_arm(study, layout, rank, groups[(layout, rank)], home) for layout, rank in keys]


def fmt_seeds(values: list[float], digits: int = 3) -> str:
    """Mean ± sd of the seeds' values, a dash for none (every arm table of the report)."""
    return mean_sd(values).format(digits) if values else "–"


def _eval_steps(all_arms: list[Arm]) -> list[float]:
    steps: set[float] = set()
    for arm in all_arms:
        steps |= set(arm.kl.steps.tolist())
    return sorted(steps)


def seeds_at(runs: list[Run], step: float, what: str = "kl") -> list[float]:
    """Each run's `what` curve at `step`, the runs without an evaluation there left out."""
    return [v for v in (getattr(r, what).at(step) for r in runs) if v is not None]


def _answers(study: Study, all_arms: list[Arm], end: float) -> list[str]:
    out = []
    full = {a.layout: a for a in all_arms if a.rank is None}
    lines = []
    for a in all_arms:
        f = full.get(a.layout)
        if a.rank is None or f is None:
            continue
        ka, kf, k0 = a.kl.at(end), f.kl.at(end), f.kl.at(0)
        if None in (ka, kf, k0):
            continue
        fall = f"; {(k0 - ka) / (k0 - kf):.0%} of full distillation's fall from {k0:.3f}" if k0 > kf else ""
        lines.append(f"  - {a.name}: KL {ka:.3f} against full {kf:.3f} ({ka / kf - 1:+.0%}){fall}")
    if lines:
        out += [f"- **How much of full distillation's KL do adapters reach?** At step {end:g} (seed means):", *lines]
    ranks = sorted({a.rank for a in all_arms if a.rank is not None})
    by = {(a.layout, a.rank): a for a in all_arms}
    layouts = [n for n in ("optimised", "contiguous") if any(k[0] == n for k in by)]
    if len(layouts) == 2:
        out.append(f"- **Does the optimised layout's head start survive?** Optimised against contiguous at step "
                   f"{end:g}; the multiplier is the step contiguous's KL at step {end:g} is reached at, by the "
                   "optimised mean curve:")
        for rank in [None, *ranks]:
            o, c = by.get(("optimised", rank)), by.get(("contiguous", rank))
            if o is None or c is None:
                continue
            ko, kc = seeds_at(o.runs, end), seeds_at(c.runs, end)
            match = step_matching(o.kl, c.kl, end)
            wins = sum(x < y for x in ko for y in kc)
            label = "full" if rank is None else f"rank {rank}"
            out.append(f"  - {label}: {fmt_seeds(ko)} against {fmt_seeds(kc)}, optimised lower in {wins} of "
                       f"{len(ko) * len(kc)} seed pairs; reached at step "
                       f"{match.format() if match else '–'}")
    steps = []
    for layout in layouts or sorted({a.layout for a in all_arms}):
        chain = [by[(layout, r)] for r in ranks if (layout, r) in by]
        for lo, hi in zip(chain, chain[1:]):
            a, b = seeds_at(lo.runs, end), seeds_at(hi.runs, end)
            if not a or not b:
                continue
            gain, spread = mean_sd(a).mean - mean_sd(b).mean, max(mean_sd(a).sd or 0.0, mean_sd(b).sd or 0.0)
            verdict = "pays" if gain > spread else "does not pay (within the seeds' sd)"
            steps.append(f"  - {layout}: rank {lo.rank} → {hi.rank}: KL {mean_sd(a).mean:.3f} → "
                         f"{mean_sd(b).mean:.3f} ({gain:+.3f} against a seed sd of {spread:.3f}): {verdict}")
    if steps:
        out += [f"- **At which rank does it stop paying?** The KL a larger rank saves at step {end:g}, against "
                "the larger of the two arms' seed sd:", *steps]
    return out


def adapter_lines(study: Study, figures: dict[str, str]) -> list[str]:
    """The section, or nothing for an experiment without adapter runs."""
    all_arms = arms(study)
    if not any(a.rank is not None for a in all_arms):
        return []
    end = float(study.steps)
    steps = _eval_steps(all_arms)
    cfg = study.config
    lr = sorted({a.lr for a in cfg.arms if a.adapters is not None and a.lr}) if cfg else []
    rates = f"; peak learning rate {', '.join(f'{x:g}' for x in lr)}" if lr else ""
    if cfg:
        rates += f" (full distillation: {cfg.training.lr:g})"
    head = ["## Adapters against full distillation", "",
            "Arms with `adapters`: low-rank adapters W + (α/r)·B·A on the projections, over the frozen permuted "
            "weights (the teacher is the same weights run dense with the adapters off), B = 0 at step 0"
            f"{rates}. Seconds per step: the median over a run's steps with no evaluation in them, with the "
            "intra-op threads its run started with (a time per step compares only at equal threads and load).", "",
            "| arm | runs | trained parameters | s / step | threads | peak RSS (training) |",
            "|---|---|---|---|---|---|"]
    notes = []
    for a in all_arms:
        mark = ""
        if a.elsewhere:
            notes.append(f"{a.name}: trained in {', '.join(a.elsewhere)} (copied here with its config.json, "
                         "metrics and DONE); its time per step is from that experiment")
            mark = " †"
        rss = fmt_seeds([p / 2**30 for p in a.peak_rss], 2) + " GiB" if a.peak_rss else "not recorded"
        trained = f"{a.trainable / 1e6:.2f} M" if a.trainable else "–"
        threads = ", ".join(map(str, a.threads)) or "–"
        seconds = fmt_seeds(a.step_seconds, 2)
        head.append(f"| {a.name}{mark} | {len(a.runs)} | {trained} | {seconds} | {threads} | {rss} |")
    head += [""] + [f"† {n}." for n in notes] + ([""] if notes else [])
    for what, title in (("kl", "KL"), ("top1", "Top-1 agreement with the teacher")):
        head += [f"{title} at every evaluation (mean ± sd over training seeds):", "",
                 "| step | " + " | ".join(a.name for a in all_arms) + " |",
                 "|---|" + "---|" * len(all_arms)]
        for s in steps:
            head.append(f"| {s:g} | " + " | ".join(fmt_seeds(seeds_at(a.runs, s, what)) for a in all_arms) + " |")
        head.append("")
    head += _answers(study, all_arms, end) + [""]
    if "adapters" in figures:
        head += [f"![KL against step, adapters and full distillation]({figures['adapters']})", "",
                 "Bold: mean over training seeds; faint: single seeds; black: full distillation.", ""]
    return head


def draw_adapters(study: Study, path: Path) -> Path | None:
    """KL against step, one panel per layout: full distillation and every rank."""
    all_arms = arms(study)
    if not any(a.rank is not None for a in all_arms):
        return None
    import matplotlib.pyplot as plt

    layouts = list(dict.fromkeys(a.layout for a in all_arms))
    ranks = sorted({a.rank for a in all_arms if a.rank is not None})
    cmap = plt.get_cmap("viridis")
    colours = {r: cmap(0.15 + 0.7 * i / max(1, len(ranks) - 1)) for i, r in enumerate(ranks)}
    fig, axes = plt.subplots(1, len(layouts), figsize=(5.2 * len(layouts), 3.8), sharey=True, squeeze=False)
    log = bool(study.config and study.config.report.log_steps)
    for ax, layout in zip(axes[0], layouts):
        for a in (x for x in all_arms if x.layout == layout):
            colour = "black" if a.rank is None else colours[a.rank]
            for r in a.runs:
                s, v = (r.kl.steps[1:], r.kl.values[1:]) if log else (r.kl.steps, r.kl.values)
                ax.plot(s, v, color=colour, alpha=0.25, linewidth=0.8)
            m = a.kl
            s, v = (m.steps[1:], m.values[1:]) if log else (m.steps, m.values)
            ax.plot(s, v, color=colour, linewidth=2, label="full" if a.rank is None else f"rank {a.rank}")
        ax.set_title(layout)
        ax.set_xlabel("step")
        if log:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("KL(dense ‖ student), nats/token")
    axes[0][-1].legend(frameon=False)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=130, bbox_inches="tight")
    plt.close(fig)
    return path
