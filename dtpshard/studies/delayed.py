"""The report's section on partial students (arms with `delayed`, docs/design.md §1, per-module
delay): how much of the model must change, in KL against the share of syncs removed, and what each
share gains at decode.

Quality comes from the study's runs: each partial layout's zero-shot KL and top-1 (its student
before training) and its seed-mean curve; the recipe calibration's pilots (the partial arms' own
lr and CE weight, seed 0) are listed first, as chosen. Speed comes from bench/bench_vllm.py
--delayed ... --json, its last line saved beside the study as decode.json (rows with `delayed`,
the share; the bench's own random model: decode cost depends on how many modules are delayed, not
on which); without it the section says how to add it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError
from dtpshard.core.io import atomic_path, atomic_write_text, dumps, read_json_object
from dtpshard.studies.adapters import fmt_seeds
from dtpshard.studies.provenance import SENSITIVITY, timed
from dtpshard.studies.shared import decode_rows
from dtpshard.studies.stats import MAX_KL, Curve, is_kl, mean_curve, mean_sd
from dtpshard.studies.study import Run, Study

GOAL_LATENCY = 0.5  # ms added to every sum: where decode gains are compared with the share removed


@dataclass
class PartialArm:
    layout: str
    share: float  # of the modules delayed: the syncs removed
    by: str | None  # sensitivity, upper, random; None for explicit indices
    zero_kl: float | None
    zero_top1: float | None
    runs: list[Run]

    @property
    def kl(self) -> Curve:
        return mean_curve([r.kl for r in self.runs])

    def ends(self, end: float) -> list[float]:
        return [v for v in (r.kl.at(end) for r in self.runs) if v is not None]

    def top1(self, end: float) -> list[float]:
        return [v for v in (r.top1.at(end) for r in self.runs) if v is not None]


def arms(study: Study) -> list[PartialArm]:
    """Every partial layout with trained runs (none without), by rule then share."""
    out = []
    for name, info in study.layouts.items():
        d = info.delayed
        if d is None or not info.runs:
            continue
        out.append(PartialArm(name, d["count"] / d["modules"], d.get("by"), info.zero_kl, info.zero_top1,
                              sorted(info.runs, key=lambda r: r.seed)))
    return sorted(out, key=lambda a: (a.by != "sensitivity", a.by or "", a.share))


def pilots(study: Study) -> dict[tuple[str, float | None, float | None], list[Run]]:
    """The recipe calibration: runs of partial layouts at their arm's own lr or CE weight, and
    beside them the same layout's seed-0 run at the study's recipe (the one chosen)."""
    partial = {n for n, info in study.layouts.items() if info.delayed is not None}
    out: dict[tuple[str, float | None, float | None], list[Run]] = {}
    for run in study.recipe_runs:
        if run.layout in partial:
            out.setdefault((run.layout, run.lr, run.ce_weight), []).append(run)
    t = study.config.training if study.config else None
    for layout in {k[0] for k in out} if t is not None else ():
        chosen = [r for r in study.layouts[layout].runs if r.seed == 0]
        if chosen:
            out[layout, t.lr, t.ce_weight] = chosen
    return out


def decode_gains(study: Study, latency: float = GOAL_LATENCY) -> dict[int, dict[float, float]]:
    """batch -> share -> the student's decode gain over TP (tokens/s ratio − 1) at `latency`, from
    decode.json's rows with `delayed`."""
    out: dict[int, dict[float, float]] = {}
    for r in decode_rows(study):
        if r.get("latency_ms") == latency and isinstance(r.get("delayed"), (int, float)) and "dtp_per_tp" in r:
            out.setdefault(int(r["batch"]), {})[float(r["delayed"])] = float(r["dtp_per_tp"]) - 1
    return out


def delayed_lines(study: Study, figures: dict[str, str]) -> list[str]:
    """The section, or nothing for an experiment without partial arms."""
    all_arms = arms(study)
    calibration = pilots(study)
    if not all_arms and not calibration:
        return []
    end = float(study.steps)
    evals = sorted({s for a in all_arms for r in a.runs for s in r.kl.steps})
    out = ["## Partial students: how much of the model must change", "",
           "Only a share of the modules is delayed; every other module sums its partials at once, as tensor "
           "parallelism does (docs/design.md §1). The delayed modules are those of least measured sensitivity (KL "
           "to the dense model with that module alone delayed, under the optimised layout, on calibration blocks: "
           "sensitivity.json), the upper ones, or drawn at random; the layout is re-optimised over the delayed "
           "modules' edges. Zero-shot: the student before any training.", ""]
    out += _calibration_lines(study, calibration, evals)
    if not all_arms:
        return out
    gains = decode_gains(study)
    out += _arm_rows(all_arms, gains, evals, end)
    out += [""]
    out += goal_lines(all_arms, gains, end)
    if not gains:
        shares = sorted({round(a.share, 4) for a in all_arms} - {1.0})
        out += [f"No decode measurement: save the last line of `python bench/bench_vllm.py --tp 2 --batch 1 8 "
                f"--latency-ms 0 {GOAL_LATENCY:g} --delayed {' '.join(f'{s:g}' for s in shares)} --json` as "
                "decode.json here and run `dtpshard report` again.", ""]
    if "delayed" in figures:
        out += [f"![KL against the share of syncs removed]({figures['delayed']})", "",
                f"Left: seed mean ± sd of KL at step {end:g} (filled) and zero-shot (open) against the share of "
                f"modules delayed. Right: the decode gain over TP at {GOAL_LATENCY:g} ms added to every sum "
                "(decode.json), with the line a gain proportional to the share would follow.", ""]
    return out


def _calibration_lines(study: Study, calibration: dict, evals: list[float]) -> list[str]:
    """The recipe calibration's table (the pilots' KL at each evaluation), and the recipe chosen."""
    if not calibration:
        return []
    out = ["The partial arms' recipe, calibrated on seed 0 before the other seeds ran (KL at each "
           "evaluation):", "",
           "| layout | lr | CE weight | " + " | ".join(f"KL @ {s:g}" for s in evals) + " |",
           "|---|---:|---:|" + "---:|" * len(evals)]
    t = study.config.training if study.config else None
    for (layout, lr, ce), runs in sorted(calibration.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0,
                                                                               kv[0][2] or 0)):
        kl = mean_curve([r.kl for r in runs])
        chosen = " (chosen)" if t is not None and (lr, ce) == (t.lr, t.ce_weight) else ""
        out.append(f"| {layout}{chosen} | {lr:g} | {ce:g} | " + " | ".join(
            "–" if kl.at(s) is None else f"{kl.at(s):.3f}" for s in evals) + " |"
            if lr is not None and ce is not None else f"| {layout} | ? | ? | |")
    if t is not None:
        out += ["", f"The arms below train at lr {t.lr:g} with CE weight {t.ce_weight:g}.", ""]
    return out


def _arm_rows(all_arms: list[PartialArm], gains: dict, evals: list[float], end: float) -> list[str]:
    """One row per partial arm: its share, rule, zero-shot and trained KL, and the bench's decode gain."""
    batches = sorted(gains)
    head = ["layout", "delayed (syncs removed)", "by", "seeds", "zero-shot KL", "zero-shot top-1",
            *(f"KL @ {s:g}" for s in evals), f"top-1 @ {end:g}",
            *(f"decode gain over TP, batch {b}, {GOAL_LATENCY:g} ms" for b in batches)]
    out = ["| " + " | ".join(head) + " |", "|---|---:|---|---:|" + "---:|" * (len(head) - 4)]
    for a in all_arms:
        kl = a.kl
        by = "–" if a.share == 1 else a.by or "listed"  # every module delayed: no rule chose them
        cells = [a.layout, f"{a.share:.0%}", by, str(len(a.runs)),
                 "–" if a.zero_kl is None else f"{a.zero_kl:.3f}", "–" if a.zero_top1 is None else f"{a.zero_top1:.3f}",
                 *("–" if kl.at(s) is None else f"{kl.at(s):.3f}" for s in evals[:-1]),
                 fmt_seeds(a.ends(end)), fmt_seeds(a.top1(end))]
        for b in batches:
            g = _nearest(gains[b], a.share)  # the bench's partial student of that share
            cells.append("–" if g is None else f"{g:+.1%}")
        out.append("| " + " | ".join(cells) + " |")
    return out


def _nearest(by_share: dict[float, float], share: float) -> float | None:
    for s, g in by_share.items():
        if abs(s - share) < 0.02:
            return g
    return None


def goal_lines(all_arms: list[PartialArm], gains: dict[int, dict[float, float]], end: float) -> list[str]:
    """The issue's goals, each said met or missed from the numbers above."""
    by = {(a.by, round(a.share, 2)): a for a in all_arms}
    out = []
    half = by.get(("sensitivity", 0.5))
    if half and half.ends(end):
        m = mean_sd(half.ends(end)).mean
        others = [by.get((rule, 0.5)) for rule in ("upper", "random")]
        beats = all(o is not None and len(o.ends(end)) == len(half.ends(end))
                    and all(h < v for h, v in zip(half.ends(end), o.ends(end))) for o in others)
        out.append(f"- 50% by sensitivity: seed-mean KL at step {end:g} {m:.3f} (goal ≤ 0.10: "
                   f"{'met' if m <= 0.10 else 'missed'}); lower than upper and random at 50% for every seed: "
                   f"{'yes' if beats else 'no'}.")
    three = by.get(("sensitivity", 0.75))
    if three and three.ends(end):
        m = mean_sd(three.ends(end)).mean
        out.append(f"- 75% by sensitivity: seed-mean KL at step {end:g} {m:.3f} (goal ≤ 0.316, the full student's "
                   f"step-500 KL: {'met' if m <= 0.316 else 'missed'}).")
    for b, row in sorted(gains.items()):
        full = row.get(1.0)
        if full is None or full <= 0:
            continue
        said = [f"{s:.0%}: {g:+.1%} against {0.9 * s * full:+.1%}" for s, g in sorted(row.items()) if s < 1]
        ok = all(g >= 0.9 * s * full for s, g in row.items() if s < 1)
        out.append(f"- Decode at {GOAL_LATENCY:g} ms, batch {b}: the full student gains {full:+.1%} over TP; each "
                   f"partial student at least 0.9 × share × that ({'; '.join(said)}): {'met' if ok else 'missed'}.")
    return out + ([""] if out else [])


def draw_delayed(study: Study, path: Path) -> Path | None:
    """KL at the last step (and zero-shot) against the share of modules delayed, one marker per rule;
    beside it the decode gain over TP against the share."""
    all_arms = arms(study)
    if not all_arms:
        return None
    import matplotlib.pyplot as plt

    end = float(study.steps)
    gains = decode_gains(study)
    fig, axes = plt.subplots(1, 2 if gains else 1, figsize=(11 if gains else 5.5, 3.8), squeeze=False)
    ax = axes[0][0]
    styles = {"sensitivity": ("C0", "o"), "upper": ("C3", "s"), "random": ("C2", "^"), None: ("C7", "D")}
    for rule in dict.fromkeys(a.by for a in all_arms):
        mine = sorted((a for a in all_arms if a.by == rule and a.ends(end)), key=lambda a: a.share)
        if not mine:
            continue
        color, marker = styles.get(rule, ("C7", "D"))
        stats = [mean_sd(a.ends(end)) for a in mine]
        ax.errorbar([a.share for a in mine], [s.mean for s in stats], yerr=[s.sd or 0 for s in stats], fmt=marker,
                    linestyle="-" if rule == "sensitivity" else "none", color=color, capsize=3,
                    label=f"by {rule or 'list'}, step {end:g}")
        zs = [(a.share, a.zero_kl) for a in mine if a.zero_kl is not None]
        if zs:
            ax.plot(*zip(*zs), marker=marker, linestyle=":", color=color, markerfacecolor="none",
                    label=f"by {rule or 'list'}, zero-shot")
    ax.set_xlabel("share of modules delayed (syncs removed)")
    ax.set_ylabel("KL to the dense model")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if gains:
        ax = axes[0][1]
        for i, (b, row) in enumerate(sorted(gains.items())):
            xs = sorted(row)
            ax.plot(xs, [100 * row[x] for x in xs], marker="o", color=f"C{i}", label=f"batch {b}")
            if 1.0 in row:
                ax.plot([0, 1], [0, 100 * row[1.0]], linestyle="--", color=f"C{i}", linewidth=1)
        ax.axhline(0, color="grey", linewidth=1)
        ax.set_xlabel("share of modules delayed")
        ax.set_ylabel(f"decode gain over TP at {GOAL_LATENCY:g} ms (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=130, bbox_inches="tight")
    plt.close(fig)
    return path


def study_sensitivity(cfg: Any, model: Path, out: Path, base: str, layout: Any, say: Any) -> dict[str, Any]:
    """Every module's sensitivity under layout `base` (every module delayed), measured once on the
    calibration blocks and kept in DIR/sensitivity.json for every partial arm chosen under it."""
    path = out / SENSITIVITY
    done = read_json_object(path, "module sensitivity") if path.is_file() else {}
    entry = done.get(base)
    if isinstance(entry, dict) and entry.get("layout_sha256") == layout.content_sha256():
        kl = entry.get("kl")
        if not isinstance(kl, list) or not kl or not all(map(is_kl, kl)):  # it chooses which modules are delayed
            raise UserError(f"{path}: {base}'s 'kl' must be a list of KLs (finite numbers from 0 to {MAX_KL:g}); "
                            "delete the file to measure again")
        if len(kl) != layout.model.modules:  # one KL a module: a shorter list would shift every choice
            raise UserError(f"{path}: {base}'s 'kl' lists {len(kl)} modules, the model has "
                            f"{layout.model.modules}; delete the file to measure again")
        return entry
    from dtpshard.affinity.sensitivity import SENSITIVITY_BLOCKS
    from dtpshard.core.devices import pick_device
    from dtpshard.layouts.delayed import measure_for_layout, sensitivity_ids

    cal = cfg.calibration
    blocks = min(cal.blocks, SENSITIVITY_BLOCKS)  # the calibration pass's first blocks
    ids = sensitivity_ids(model, cal.text, cal.dataset, blocks=blocks, seq_len=cal.seq_len, seed=cal.seed,
                          text_field=cfg.text_field, tokenizer=cfg.tokenizer)
    say(f"sensitivity under {base}: each module delayed alone, on {blocks} blocks x {cal.seq_len} tokens")
    with timed(out, "sensitivity"):
        entry = measure_for_layout(model, layout, cfg.dtp, ids, pick_device(cfg.device), cal.micro_batch,
                                   cfg.training.progress)
    entry["layout_sha256"] = layout.content_sha256()
    done[base] = entry
    atomic_write_text(path, dumps(done, indent=1) + "\n")
    return entry
