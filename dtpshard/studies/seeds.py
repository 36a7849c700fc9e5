"""Layout or seed: how much of the random layouts' spread in trained KL is the layout's, and whether
J's ranking survives averaging over training seeds.

The report's "Layout or seed" section, present when at least MIN_LAYOUTS random layouts were each
trained with two or more seeds:

- the one-way intraclass correlation ICC(1) of the final KL over those layouts (layout the group,
  training seed the replicate), on KL and on log KL: the share of the variance that lies between
  layouts. 0 means the layout explains nothing beyond what another seed would; 1 means the seeds
  agree and only the layout matters. Its 95% interval is a two-stage percentile bootstrap
  (layouts resampled, then each one's seeds);
- Pearson r and Spearman ρ of J against the final KL over every distinct layout, with bootstrap
  intervals, on the seed-mean KL and on seed 0's alone (what a one-seed study sees);
- among those random layouts: ρ of J against each seed's KL and against the seed mean, and the
  layouts of highest J against those of lowest J (their mean KLs, and an exact permutation p over
  every split into two halves).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import rankdata

from dtpshard.studies.stats import (
    Interval,
    bootstrap_pearson,
    correlate,
    pearson_rows,
    percentile_interval,
    rank_correlate,
)
from dtpshard.studies.study import LayoutInfo, Study, distinct

MIN_LAYOUTS = 3
RESAMPLES = 10000


def icc1(groups: list[list[float]]) -> float | None:
    """One-way random-effects ICC(1) of values grouped by layout (groups of unequal size allowed:
    n0 = (N - Σ n_i² / N) / (g - 1)). None where it is undefined."""
    groups = [g for g in groups if len(g) >= 1]
    g, N = len(groups), sum(len(x) for x in groups)
    if g < 2 or N <= g:
        return None
    grand = sum(sum(x) for x in groups) / N
    msb = sum(len(x) * (np.mean(x) - grand) ** 2 for x in groups) / (g - 1)
    msw = sum(((np.asarray(x) - np.mean(x)) ** 2).sum() for x in groups) / (N - g)
    n0 = (N - sum(len(x) ** 2 for x in groups) / N) / (g - 1)
    den = msb + (n0 - 1) * msw
    return None if den <= 0 else float((msb - msw) / den)


def bootstrap_icc(groups: list[list[float]], resamples: int = RESAMPLES, level: float = 0.95,
                  seed: int = 0) -> Interval | None:
    """Two-stage percentile bootstrap of ICC(1): layouts with replacement, then seeds within each."""
    rng = np.random.default_rng(seed)
    stats = np.empty(resamples)
    for b in range(resamples):
        picked = [groups[i] for i in rng.integers(0, len(groups), len(groups))]
        icc = icc1([[x[j] for j in rng.integers(0, len(x), len(x))] for x in picked])
        stats[b] = np.nan if icc is None else icc  # an ICC of exactly 0 is a value, not a missing one
    return percentile_interval(stats, level)


def bootstrap_spearman(x: list[float], y: list[float], resamples: int = RESAMPLES, level: float = 0.95,
                       seed: int = 0) -> Interval | None:
    """Percentile bootstrap interval of Spearman ρ (layouts resampled with replacement)."""
    xs, ys = np.asarray(x, float), np.asarray(y, float)
    if len(xs) < 3:
        return None
    idx = np.random.default_rng(seed).integers(0, len(xs), size=(resamples, len(xs)))
    return percentile_interval(pearson_rows(rankdata(xs[idx], axis=1), rankdata(ys[idx], axis=1)), level)


def _end(run, steps: int) -> float | None:
    return run.kl.at(steps) if run.done else None


def seeded_random(study: Study) -> list[tuple[LayoutInfo, list[float]]]:
    """The random layouts trained to the end with two or more seeds: (layout, final KL per seed), by J."""
    out = []
    for info in distinct(study):
        if info.kind != "random" or info.J is None:
            continue
        kls = [v for r in sorted(info.runs, key=lambda r: r.seed) if (v := _end(r, study.steps)) is not None]
        if len(kls) >= 2:
            out.append((info, kls))
    return sorted(out, key=lambda t: -t[0].J)


@dataclass(frozen=True)
class Correlation:
    label: str
    n: int
    r: float | None
    r_ci: Interval | None
    rho: float | None
    rho_ci: Interval | None

    def format(self) -> str:
        if self.r is None:
            return f"- {self.label}: n/a ({self.n} layouts)"
        r_ci = f" {self.r_ci.format()}" if self.r_ci else ""
        rho = "" if self.rho is None else f", Spearman ρ = {self.rho:+.3f}" + (
            f" {self.rho_ci.format()}" if self.rho_ci else "")
        return f"- {self.label} over {self.n} layouts: Pearson r = {self.r:+.3f}{r_ci}{rho}"


def _correlation(label: str, xs: list[float], ys: list[float]) -> Correlation:
    fit, rank = correlate(xs, ys), rank_correlate(xs, ys)
    return Correlation(label, fit.n, fit.r, bootstrap_pearson(xs, ys), rank.rho, bootstrap_spearman(xs, ys))


def j_correlations(study: Study) -> list[Correlation]:
    """J against the final KL over every distinct layout: seed mean, then seed 0 alone."""
    mean, first = [], []
    for info in distinct(study):
        ends = {r.seed: v for r in info.runs if (v := _end(r, study.steps)) is not None}
        if info.J is None or not ends:
            continue
        mean.append((info.J, sum(ends.values()) / len(ends)))
        if 0 in ends:
            first.append((info.J, ends[0]))
    return [_correlation(f"seed-mean KL at step {study.steps}", *map(list, zip(*mean))),
            _correlation(f"seed 0's KL at step {study.steps} (one seed per layout)", *map(list, zip(*first)))]


EXACT_SPLITS = 1 << 17  # past this many splits into halves the permutation p is sampled (C(20, 10) is 184756)
SAMPLED_SPLITS = 1 << 14  # random splits of a sampled p, seeded: the report is the same on every run


def split_test(values: list[float]) -> tuple[float, float, bool]:
    """The first half's mean minus the second half's (values ordered by J, highest first), the
    two-sided permutation p over splits into halves of those sizes, and whether it is exact: every
    split up to EXACT_SPLITS of them, else SAMPLED_SPLITS random ones (Monte Carlo, seeded), so the
    work is bounded whatever the number of layouts."""
    n, half = len(values), len(values) // 2
    total, diff = sum(values), np.mean(values[:half]) - np.mean(values[half:])
    exact = math.comb(n, half) <= EXACT_SPLITS
    if exact:
        splits = itertools.combinations(range(n), half)
    else:
        rng = np.random.default_rng(0)
        splits = (rng.permutation(n)[:half] for _ in range(SAMPLED_SPLITS))
    count = more = 0
    for s in splits:
        first = sum(values[i] for i in s)
        more += abs(first / half - (total - first) / (n - half)) >= abs(diff) - 1e-12
        count += 1
    return float(diff), more / count, exact


def seed_lines(study: Study, figures: dict[str, str]) -> list[str]:
    seeded = seeded_random(study)
    if len(seeded) < MIN_LAYOUTS:
        return []
    groups = [kls for _, kls in seeded]
    seeds = min(len(g) for g in groups)
    out = ["## Layout or seed", "",
           f"{len(seeded)} random layouts trained with {seeds}–{max(len(g) for g in groups)} seeds each. ICC(1) is "
           "the share of their final KL's variance that lies between layouts (0: the layout explains nothing "
           "another training seed would not; 1: only the layout matters), with a two-stage bootstrap 95% interval "
           f"({RESAMPLES} resamples: layouts, then each one's seeds).", ""]
    for label, vals in (("KL", groups), ("log KL", [[math.log(v) for v in g] for g in groups])):
        icc, ci = icc1(vals), bootstrap_icc(vals)
        out.append(f"- ICC(1) on {label} at step {study.steps}: "
                   + ("n/a" if icc is None else f"{icc:+.3f}") + (f" {ci.format()}" if ci else ""))
    out += ["", "J against the trained KL over every distinct layout (bootstrap 95% intervals over layouts):", ""]
    out += [c.format() for c in j_correlations(study)]
    js = [i.J for i, _ in seeded]
    means = [float(np.mean(g)) for g in groups]
    out += ["", f"Among these {len(seeded)} random layouts (J {min(js):.2f}–{max(js):.2f}):", ""]
    for s in range(seeds):
        rank = rank_correlate(js, [g[s] for g in groups])
        out.append(f"- seed {s} alone: Spearman ρ(J, KL) = {rank.rho:+.3f}")
    rank = rank_correlate(js, means)
    out.append(f"- seed mean: Spearman ρ(J, KL) = {rank.rho:+.3f} (p = {rank.p:.2g})")
    diff, p, exact = split_test(means)
    half = len(means) // 2
    out.append(f"- the {half} of highest J against the {len(means) - half} of lowest: seed-mean KL "
               f"{np.mean(means[:half]):.3f} against {np.mean(means[half:]):.3f} (difference {diff:+.3f}; "
               + (f"exact permutation p = {p:.2f} over every split)" if exact else
                  f"permutation p = {p:.2f} over {SAMPLED_SPLITS} random splits)"))
    out += ["", "| layout | J | " + " | ".join(f"KL seed {s}" for s in range(max(len(g) for g in groups)))
            + " | mean | spread (max − min) |", "|---|---:|" + "---:|" * (max(len(g) for g in groups) + 2)]
    for (info, kls), mean in zip(seeded, means):
        cells = [f"{v:.3f}" for v in kls] + ["–"] * (max(len(g) for g in groups) - len(kls))
        out.append(f"| {info.name} | {info.J:.3f} | " + " | ".join(cells)
                   + f" | {mean:.3f} | {max(kls) - min(kls):.3f} |")
    if "seeds" in figures:
        out += ["", f"![final KL of each seed against J]({figures['seeds']})"]
    return out + [""]
