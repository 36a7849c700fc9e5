"""The report's optional sections (the experiment's [report] table, studies/config.py ReportOptions):

- the head start over training: optimised against contiguous at chosen steps, laid out like the
  paper's Table 2, and the same at every evaluation: both mean KLs, the gap, the gap as a fraction
  of contiguous's KL, the multiplier (contiguous's step s over the step at which optimised's mean
  curve first reached contiguous's KL at s, docs/design.md §4) with a rolling median of five, and
  top-1 agreement with the teacher;
- a side-by-side with another experiment: per layout group, the co-located fraction of each edge
  kind, J over its random expectation, the KL at the end and the multiplier.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from dtpshard.core.errors import UserError
from dtpshard.studies.stats import Curve, mean_curve, mean_sd, pair_matching, step_matching
from dtpshard.studies.study import EDGE_KINDS, Study, groups, load_study


@dataclass(frozen=True)
class HeadStart:
    step: int
    optimised: float  # mean KL
    contiguous: float
    multiplier: float | None  # None: optimised never reached contiguous's KL at this step
    top1: tuple[float | None, float | None]  # optimised, contiguous

    @property
    def gap(self) -> float:
        return self.contiguous - self.optimised

    @property
    def fraction(self) -> float:
        return self.gap / self.contiguous


def _curves(study: Study, kind: str, attr: str) -> list[Curve]:
    return [getattr(r, attr) for i in groups(study).get(kind, []) for r in i.runs]


def head_start(study: Study) -> list[HeadStart]:
    """Optimised against contiguous at every evaluation step (after step 0) of contiguous's mean curve."""
    opt, cont = mean_curve(_curves(study, "optimised", "kl")), mean_curve(_curves(study, "contiguous", "kl"))
    t_opt, t_cont = (mean_curve(_curves(study, k, "top1")) for k in ("optimised", "contiguous"))
    out = []
    for s in cont.steps:
        o, c = opt.at(s), cont.at(s)
        if s <= 0 or o is None or c is None:
            continue
        m = step_matching(opt, cont, s)
        out.append(HeadStart(int(s), o, c, None if m is None else m.multiplier, (t_opt.at(s), t_cont.at(s))))
    return out


def rolling_median(values: list[float | None], width: int = 5) -> list[float | None]:
    """The median of each value and its neighbours (`width` in all, fewer at the ends), of those known."""
    half, out = width // 2, []
    for i in range(len(values)):
        known = [v for v in values[max(0, i - half):i + half + 1] if v is not None]
        out.append(statistics.median(known) if known else None)
    return out


def _f(v: float | None, digits: int = 3, suffix: str = "") -> str:
    return "–" if v is None else f"{v:.{digits}f}{suffix}"


def _mult(v: float | None) -> str:
    return "not reached" if v is None else f"{v:.2f}×"


def head_start_lines(study: Study, steps: list[int]) -> list[str]:
    rows = head_start(study)
    if not rows:
        return []
    medians = rolling_median([r.multiplier for r in rows])
    by_step = {r.step: (r, m) for r, m in zip(rows, medians)}
    table = ["| step | KL optimised | KL contiguous | gap | gap / contiguous | multiplier | rolling median (5) | "
             "top-1 optimised | top-1 contiguous |", "|---|---|---|---|---|---|---|---|---|"]

    def line(r: HeadStart, m: float | None) -> str:
        return (f"| {r.step} | {r.optimised:.4f} | {r.contiguous:.4f} | {r.gap:.4f} | {100 * r.fraction:.1f}% | "
                f"{_mult(r.multiplier)} | {_mult(m)} | {_f(r.top1[0], 4)} | {_f(r.top1[1], 4)} |")

    chosen = [by_step[s] for s in steps if s in by_step]
    out = ["## The head start over training", "",
           "Optimised against contiguous (seed-mean curves): the gap is contiguous's KL minus optimised's, the "
           "multiplier contiguous's step over the (interpolated) step at which optimised first reached the same KL, "
           "top-1 the share of held-out positions where the student's most likely token is the teacher's.", ""]
    if chosen:
        out += [f"At steps {', '.join(str(r.step) for r, _ in chosen)} (as the paper's Table 2):", "",
                *table, *(line(r, m) for r, m in chosen), ""]
    out += ["At every evaluation:", "", *table, *(line(r, m) for r, m in zip(rows, medians)), ""]
    return out


# -- the side-by-side with another experiment ------------------------------------------------------
SIDE_GROUPS = ("optimised", "contiguous", "random", "anti")


def _group_row(study: Study, kind: str) -> dict[str, str]:
    infos = groups(study).get(kind, [])
    if not infos:
        return {}
    fr = {k: mean_sd([i.edge_fractions.get(k) for i in infos if k in i.edge_fractions]) for k in EDGE_KINDS}
    ratio = mean_sd([i.ratio for i in infos])
    ends = [r.kl.at(study.steps) for i in infos for r in i.runs]
    row = {k: (v.format() if v.n else "–") for k, v in fr.items()}
    row.update(ratio=ratio.format() if ratio.n else "–", kl=mean_sd(ends).format() if ends else "–",
               runs=str(len(ends)))
    if kind == "optimised":
        opt, cont = _curves(study, "optimised", "kl"), _curves(study, "contiguous", "kl")
        m = step_matching(mean_curve(opt), mean_curve(cont), study.steps) if opt and cont else None
        pairs = pair_matching(opt, cont, study.steps)
        row["multiplier"] = "–" if m is None else (f"{_mult(m.multiplier)} ({pairs.format()})")
    return row


def side_by_side_lines(study: Study, other: Study, other_name: str) -> list[str]:
    mine = f"this study (δ = {study.config.delay})" if study.config else "this study"
    theirs = f"{other_name} (δ = {other.config.delay})" if other.config else other_name
    out = [f"## Side by side with {other_name}", "",
           "Per layout group: the mean co-located fraction of each edge kind (the share of each edge's normalised "
           "affinity whose two units share a device; 1/L ignores the affinity), J over its random expectation, "
           "the KL at the last step and the multiplier there (its range over seed pairs).", "",
           "| study | group | runs | up | down | attention→attention | FFN→FFN | J / random | KL at the end | "
           "multiplier at the end |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in ((mine, study), (theirs, other)):
        for kind in SIDE_GROUPS:
            r = _group_row(s, kind)
            if r:
                out.append(f"| {name} | {kind} | {r['runs']} | " + " | ".join(r[k] for k in EDGE_KINDS) +
                           f" | {r['ratio']} | {r['kl']} | {r.get('multiplier', '')} |")
    return out + [""]


def optional_sections(study: Study, figures: dict[str, str]) -> list[str]:
    """The sections the experiment's [report] table asks for (none for an experiment without one)."""
    opts = study.config.report if study.config else None
    if opts is None:
        return []
    out: list[str] = []
    if opts.steps:
        out += head_start_lines(study, list(opts.steps))
        if "head_start" in figures:
            out += [f"![gap and multiplier against step]({figures['head_start']})", ""]
    if opts.compare:
        other = Path(opts.compare)
        if not other.is_dir():  # the one place a relative [report] compare is resolved: say from where
            raise UserError(f"[report] compare = {opts.compare!r}: no such experiment directory (a relative path is "
                            f"read from the current directory, {Path.cwd()})")
        out += side_by_side_lines(study, load_study(other), opts.compare)
    return out
