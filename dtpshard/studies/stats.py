"""The statistics of a study (docs/design.md §4 and §5): seed means, step matching, correlation.

Curves are evaluation curves: increasing steps with a value (KL or perplexity) at each. A curve
is read between evaluations by linear interpolation, which is what the paper's step matching
does ("the first step at which the optimised arm's mean KL curve reaches the contiguous arm's KL
at step s"). Seeds of one arm evaluate at the same steps; where they do not (an unfinished seed),
the mean is taken over the steps all of them share, so a mean point is never an average of
different numbers of seeds.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MeanSd:
    mean: float
    sd: float | None  # sample sd (ddof = 1); None for a single value
    n: int

    def format(self, digits: int = 3) -> str:
        if math.isnan(self.mean):
            return "–"
        if self.sd is None:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.sd:.{digits}f}"


def is_number(v: object) -> bool:
    """A JSON value a report may compute with: an int or float, not a bool, finite (not NaN, not
    ±Infinity, which Python's JSON reader takes). Each measured kind below adds its own range, and a
    report input is checked as what it measures."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# a report draws what it reads, and matplotlib's locators overflow near float's limit: no run's KL
# comes near 1e6 nats, nor its perplexity near 1e300
MAX_KL, MAX_PERPLEXITY = 1e6, 1e300


def is_kl(v: object) -> bool:
    """A KL divergence (or a loss, a perplexity's log): finite, >= 0 and below MAX_KL."""
    return is_number(v) and 0 <= v <= MAX_KL


def is_perplexity(v: object) -> bool:
    """A perplexity: exp of a cross-entropy, so >= 1, and below MAX_PERPLEXITY."""
    return is_number(v) and 1 <= v <= MAX_PERPLEXITY


def is_fraction(v: object) -> bool:
    """An agreement or a share: from 0 to 1."""
    return is_number(v) and 0 <= v <= 1


def is_rate(v: object) -> bool:
    """A throughput, a duration or a ratio of them: finite and > 0."""
    return is_number(v) and v > 0


def is_step(v: object, limit: int = 1 << 31) -> bool:
    """A step (or a batch, a count): an integer from 0 to `limit` (a whole float too, as JSON has it)."""
    return is_number(v) and float(v).is_integer() and 0 <= v <= limit


def mean_sd(values: Sequence[float]) -> MeanSd:
    """Mean and sample standard deviation (n - 1 in the denominator, as the paper's ± is)."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    if v.size == 0:
        return MeanSd(math.nan, None, 0)
    sd = float(v.std(ddof=1)) if v.size > 1 else None
    return MeanSd(float(v.mean()), sd, int(v.size))


@dataclass(frozen=True)
class Curve:
    steps: np.ndarray  # [E] increasing evaluation steps
    values: np.ndarray  # [E]

    def at(self, step: float) -> float | None:
        """The value at `step`, linearly interpolated; None outside the evaluated range."""
        if len(self.steps) == 0 or step < self.steps[0] or step > self.steps[-1]:
            return None
        return float(np.interp(step, self.steps, self.values))


def make_curve(steps: Sequence[float], values: Sequence[float]) -> Curve:
    """A curve from (step, value) pairs; a repeated step keeps its last value (a re-evaluation)."""
    last: dict[float, float] = {}
    for s, v in zip(steps, values):
        if v is not None and math.isfinite(v):
            last[float(s)] = float(v)
    order = sorted(last)
    return Curve(np.asarray(order, dtype=np.float64), np.asarray([last[s] for s in order], dtype=np.float64))


def mean_curve(curves: Sequence[Curve]) -> Curve:
    """The seed mean at the steps every curve evaluated (a run with no evaluation yet is left out)."""
    curves = [c for c in curves if len(c.steps)]
    if not curves:
        return Curve(np.zeros(0), np.zeros(0))
    common = set(curves[0].steps.tolist())
    for c in curves[1:]:
        common &= set(c.steps.tolist())
    steps = np.asarray(sorted(common), dtype=np.float64)
    vals = [np.mean([c.values[np.searchsorted(c.steps, s)] for c in curves]) for s in steps]
    return Curve(steps, np.asarray(vals, dtype=np.float64))


def first_reach(curve: Curve, target: float) -> float | None:
    """The first step at which the interpolated curve is at or below `target`; None if never."""
    s, v = curve.steps, curve.values
    if len(s) == 0:
        return None
    if v[0] <= target:
        return float(s[0])
    for i in range(len(s) - 1):
        if v[i] > target >= v[i + 1]:  # crosses inside this segment: solve the line for target
            frac = (v[i] - target) / (v[i] - v[i + 1])
            return float(s[i] + frac * (s[i + 1] - s[i]))
    return None


@dataclass(frozen=True)
class StepMatch:
    step: float  # s: the contiguous arm's step
    target: float  # the contiguous arm's mean KL at s
    reached: float | None  # the first step the optimised arm's mean reaches it
    multiplier: float | None  # s / reached (None if never reached, inf if reached at step 0)

    def format(self) -> str:
        if self.reached is None:
            return f"not reached by step {self.step:g}"
        if self.multiplier is None or math.isinf(self.multiplier):
            return f"{self.reached:.0f} (at the start)"
        return f"{self.reached:.0f} ({self.multiplier:.1f}×)"


def step_matching(optimised: Curve, contiguous: Curve, step: float) -> StepMatch | None:
    """Spec section 4: where `optimised` reaches contiguous@step, and the multiplier step / that."""
    target = contiguous.at(step)
    if target is None:
        return None
    reached = first_reach(optimised, target)
    if reached is None:
        return StepMatch(step, target, None, None)
    return StepMatch(step, target, reached, step / reached if reached > 0 else math.inf)


def _known(*columns: Sequence[float]) -> list[np.ndarray]:
    """The columns restricted to the rows where every value is a finite number."""
    rows = [r for r in zip(*columns) if all(v is not None and math.isfinite(v) for v in r)]
    return [np.asarray(c, dtype=np.float64) for c in zip(*rows)] if rows else [np.zeros(0) for _ in columns]


@dataclass(frozen=True)
class Fit:
    r: float | None  # Pearson r (scipy.stats.pearsonr); None with < 3 points or constant data
    p: float | None
    slope: float | None  # least-squares line y = slope·x + intercept
    intercept: float | None
    n: int


def correlate(x: Sequence[float], y: Sequence[float]) -> Fit:
    """Pearson r and the least-squares line of y on x, over the pairs where both are known."""
    xs, ys = _known(x, y)
    n = len(xs)
    if n < 2:
        return Fit(None, None, None, None, n)
    if np.ptp(xs) == 0:
        return Fit(None, None, None, None, n)
    slope, intercept = np.polyfit(xs, ys, 1)
    r = p = None
    if n >= 3 and np.ptp(ys) > 0:
        from scipy.stats import pearsonr

        res = pearsonr(xs, ys)
        r, p = float(res.statistic), float(res.pvalue)
    return Fit(r, p, float(slope), float(intercept), n)


@dataclass(frozen=True)
class Rank:
    rho: float | None  # Spearman's rank correlation (scipy.stats.spearmanr); None with < 3 points or ties only
    p: float | None
    n: int


def rank_correlate(x: Sequence[float], y: Sequence[float]) -> Rank:
    """Spearman's ρ over the pairs where both are known: whether J orders the layouts as their KL
    does, whatever the shape of the relation (a few far-off layouts bend Pearson's line)."""
    xs, ys = _known(x, y)
    if len(xs) < 3 or np.ptp(xs) == 0 or np.ptp(ys) == 0:
        return Rank(None, None, len(xs))
    from scipy.stats import spearmanr

    res = spearmanr(xs, ys)
    return Rank(float(res.statistic), float(res.pvalue), len(xs))


def pearson_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r of each row pair of x, y [B, n] (nan where a row is constant)."""
    xc = x - x.mean(axis=1, keepdims=True)
    yc = y - y.mean(axis=1, keepdims=True)
    den = np.sqrt((xc * xc).sum(axis=1) * (yc * yc).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (xc * yc).sum(axis=1) / np.where(den > 0, den, 1.0), np.nan)


@dataclass(frozen=True)
class Interval:
    low: float
    high: float
    resamples: int  # resamples with a defined r (a resample of one repeated layout has none)

    def format(self, digits: int = 2) -> str:
        return f"[{self.low:+.{digits}f}, {self.high:+.{digits}f}]"


def percentile_interval(stats: np.ndarray, level: float) -> Interval | None:
    stats = stats[np.isfinite(stats)]  # resamples where r is undefined are dropped
    if stats.size == 0:
        return None
    alpha = (1 - level) / 2
    low, high = np.quantile(stats, [alpha, 1 - alpha])
    return Interval(float(low), float(high), int(stats.size))


def _resamples(n: int, resamples: int, seed: int) -> np.ndarray:  # [resamples, n] row indices
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def bootstrap_pearson(x: Sequence[float], y: Sequence[float], resamples: int = 10000, level: float = 0.95,
                      seed: int = 0) -> Interval | None:
    """Percentile bootstrap interval of Pearson r over the pairs (layouts resampled with
    replacement); resamples where r is undefined (constant x or y) are dropped. None with < 3 pairs."""
    xs, ys = _known(x, y)
    if len(xs) < 3:
        return None
    idx = _resamples(len(xs), resamples, seed)
    return percentile_interval(pearson_rows(xs[idx], ys[idx]), level)


def bootstrap_pearson_difference(xa: Sequence[float], xb: Sequence[float], y: Sequence[float],
                                 resamples: int = 10000, level: float = 0.95, seed: int = 0) -> Interval | None:
    """Percentile bootstrap interval of r(xa, y) - r(xb, y), both on the same resampled layouts
    (paired: two scores of the same layouts are strongly correlated, so their difference is
    resolved far better than two separate intervals suggest)."""
    a, b, c = _known(xa, xb, y)
    if len(a) < 3:
        return None
    idx = _resamples(len(a), resamples, seed)
    return percentile_interval(pearson_rows(a[idx], c[idx]) - pearson_rows(b[idx], c[idx]), level)


@dataclass(frozen=True)
class PairMatches:
    """Step matching of every (optimised seed, contiguous seed) pair of single-seed curves."""

    matches: list[StepMatch]

    @property
    def multipliers(self) -> list[float]:
        return [m.multiplier for m in self.matches if m.multiplier is not None and math.isfinite(m.multiplier)]

    @property
    def unreached(self) -> int:
        return sum(m.reached is None for m in self.matches)

    @property
    def at_start(self) -> int:  # reached at step 0: the optimised seed started below the target
        return sum(m.multiplier is not None and math.isinf(m.multiplier) for m in self.matches)

    def format(self) -> str:
        ms = self.multipliers
        if not self.matches:
            return "–"
        if len(ms) == 1:
            parts = [f"{ms[0]:.1f}× (one seed pair)"]
        else:
            parts = [f"{min(ms):.1f}–{max(ms):.1f}× over {len(ms)} seed pairs" if ms else ""]
        if self.at_start:
            parts.append(f"{self.at_start} of {len(self.matches)} pairs at the start")
        if self.unreached:
            parts.append(f"{self.unreached} of {len(self.matches)} pairs never reached it")
        return "; ".join(p for p in parts if p)


def pair_matching(optimised: Sequence[Curve], contiguous: Sequence[Curve], step: float) -> PairMatches:
    out = []
    for o in optimised:
        for c in contiguous:
            m = step_matching(o, c, step)
            if m is not None:
                out.append(m)
    return PairMatches(out)
