import math

import numpy as np
import pytest
from scipy.stats import pearsonr

from dtpshard.studies.stats import correlate, first_reach, make_curve, mean_curve, mean_sd, step_matching


def test_mean_and_sample_sd():
    m = mean_sd([0.30, 0.303, 0.306])
    assert m.mean == pytest.approx(0.303)
    assert m.sd == pytest.approx(np.std([0.30, 0.303, 0.306], ddof=1))  # n - 1, not n
    assert m.sd != pytest.approx(np.std([0.30, 0.303, 0.306], ddof=0))
    assert m.format() == "0.303 ± 0.003"
    one = mean_sd([0.5, None])
    assert one.n == 1 and one.sd is None and one.format() == "0.500"
    assert mean_sd([]).format() == "–"


def test_curve_interpolates_between_evaluations():
    c = make_curve([0, 100, 200], [1.0, 0.6, 0.5])
    assert c.at(50) == pytest.approx(0.8)
    assert c.at(150) == pytest.approx(0.55)
    assert c.at(250) is None and c.at(-1) is None
    again = make_curve([0, 100, 100], [1.0, 0.7, 0.6])  # a re-evaluated step keeps its last value
    assert again.at(100) == pytest.approx(0.6)


def test_first_reach_interpolates_inside_the_crossing_segment():
    c = make_curve([0, 100, 200, 300], [1.0, 0.6, 0.4, 0.35])
    assert first_reach(c, 0.5) == pytest.approx(150.0)  # halfway between 0.6 and 0.4
    assert first_reach(c, 0.6) == pytest.approx(100.0)
    assert first_reach(c, 2.0) == 0.0
    assert first_reach(c, 0.1) is None
    bumpy = make_curve([0, 100, 200, 300], [1.0, 0.45, 0.55, 0.4])
    assert first_reach(bumpy, 0.5) == pytest.approx(100 * (1.0 - 0.5) / (1.0 - 0.45))  # the first crossing


def test_step_matching_multiplier():
    # contiguous reaches 0.415 at step 1000; optimised gets there between 300 (0.45) and 400 (0.38)
    cont = make_curve([0, 500, 1000], [1.2, 0.5, 0.415])
    opt = make_curve([0, 100, 200, 300, 400, 1000], [1.1, 0.8, 0.6, 0.45, 0.38, 0.30])
    m = step_matching(opt, cont, 1000)
    want = 300 + 100 * (0.45 - 0.415) / (0.45 - 0.38)
    assert m.target == pytest.approx(0.415)
    assert m.reached == pytest.approx(want)
    assert m.multiplier == pytest.approx(1000 / want)
    assert m.format() == f"{want:.0f} ({1000 / want:.1f}×)"
    never = step_matching(cont, opt, 1000)  # contiguous never reaches optimised@1000
    assert never.reached is None and never.multiplier is None
    assert step_matching(opt, cont, 2000) is None  # contiguous not evaluated there


def test_mean_curve_uses_the_steps_every_seed_has():
    a = make_curve([0, 10, 20], [1.0, 0.8, 0.6])
    b = make_curve([0, 10], [0.9, 0.7])  # an unfinished seed
    m = mean_curve([a, b])
    assert m.steps.tolist() == [0, 10]
    assert m.values.tolist() == pytest.approx([0.95, 0.75])


def test_correlation_matches_scipy_and_least_squares():
    rng = np.random.default_rng(3)
    x = rng.uniform(5, 20, 17)
    y = 0.5 - 0.01 * x + rng.normal(0, 0.02, 17)
    fit = correlate(list(x), list(y))
    ref = pearsonr(x, y)
    assert fit.r == pytest.approx(ref.statistic, abs=1e-12)
    assert fit.p == pytest.approx(ref.pvalue, rel=1e-9)
    slope, intercept = np.linalg.lstsq(np.stack([x, np.ones_like(x)], 1), y, rcond=None)[0]
    assert fit.slope == pytest.approx(slope) and fit.intercept == pytest.approx(intercept)
    assert fit.n == 17


def test_correlation_degenerate_inputs():
    assert correlate([1.0, 2.0], [3.0, 1.0]).r is None  # two points: a line, no r
    assert correlate([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]).slope is None  # constant x
    fit = correlate([1.0, 2.0, None, 3.0, 4.0], [2.0, 4.0, 5.0, math.nan, 8.0])
    assert fit.n == 3 and fit.r == pytest.approx(1.0)


def test_bootstrap_pearson_is_the_percentile_bootstrap():
    from scipy.stats import bootstrap

    from dtpshard.studies.stats import bootstrap_pearson

    rng = np.random.default_rng(1)
    x = rng.normal(size=14)
    y = -0.8 * x + rng.normal(scale=0.6, size=14)
    ci = bootstrap_pearson(x, y, resamples=4000, seed=3)
    # a literal loop over the same resamples (same generator, same draws)
    idx = np.random.default_rng(3).integers(0, 14, size=(4000, 14))
    rs = np.array([np.corrcoef(x[i], y[i])[0, 1] if np.ptp(x[i]) > 0 and np.ptp(y[i]) > 0 else np.nan for i in idx])
    rs = rs[np.isfinite(rs)]
    assert (ci.low, ci.high) == pytest.approx(tuple(np.quantile(rs, [0.025, 0.975])), abs=1e-12)
    assert ci.resamples == rs.size
    # and scipy's percentile bootstrap of the same statistic agrees up to resampling noise
    ref = bootstrap((x, y), lambda a, b: pearsonr(a, b).statistic, paired=True, vectorized=False,
                    n_resamples=4000, method="percentile", rng=np.random.default_rng(0)).confidence_interval
    assert ci.low == pytest.approx(ref.low, abs=0.05) and ci.high == pytest.approx(ref.high, abs=0.05)
    assert ci.low < pearsonr(x, y).statistic < ci.high


def test_bootstrap_pearson_degenerate_inputs():
    from dtpshard.studies.stats import bootstrap_pearson

    assert bootstrap_pearson([1, 2], [3, 4]) is None  # fewer than 3 pairs
    assert bootstrap_pearson([1, 1, 1], [1, 2, 3]) is None  # r undefined in every resample
    ci = bootstrap_pearson([1, 2, 3, None, 4], [2, 4, 6, 1, 8])  # missing pairs dropped; a perfect line
    assert ci.low == pytest.approx(1.0) and ci.high == pytest.approx(1.0)


def test_step_matching_over_seed_pairs():
    from dtpshard.studies.stats import pair_matching

    steps = [0, 10, 20]
    opt = [make_curve(steps, [3.0, 1.0, 0.5]), make_curve(steps, [3.0, 1.2, 0.6])]
    cont = [make_curve(steps, [3.0, 1.5, 1.0]), make_curve(steps, [3.0, 1.4, 0.4])]
    pm = pair_matching(opt, cont, 20)
    assert len(pm.matches) == 4
    # by hand: the first step each optimised curve reaches each contiguous curve's KL at step 20
    expected = [20 / (0 + 10 * (3.0 - 1.0) / (3.0 - 1.0)), None,  # opt0 vs cont0 reaches 1.0 at 10; 0.4 never
                20 / (10 + 10 * (1.2 - 1.0) / (1.2 - 0.6)), None]
    got = [m.multiplier for m in pm.matches]
    assert got[0] == pytest.approx(expected[0]) and got[2] == pytest.approx(expected[2])
    assert got[1] is None and got[3] is None and pm.unreached == 2
    lo, hi = min(expected[0], expected[2]), max(expected[0], expected[2])
    assert pm.format() == f"{lo:.1f}–{hi:.1f}× over 2 seed pairs; 2 of 4 pairs never reached it"
    start = pair_matching([make_curve(steps, [0.5, 0.45, 0.42])], cont, 20)  # below 1.0 from step 0, never 0.4
    assert start.at_start == 1 and start.unreached == 1 and start.format() == "1 of 2 pairs at the start; " \
                                                                               "1 of 2 pairs never reached it"


def test_paired_bootstrap_of_a_difference_of_correlations():
    from dtpshard.studies.stats import bootstrap_pearson_difference

    rng = np.random.default_rng(2)
    y = rng.normal(size=16)
    xa = -y + rng.normal(scale=0.3, size=16)  # a good predictor of y
    xb = xa + rng.normal(scale=0.5, size=16)  # the same plus noise: worse
    ci = bootstrap_pearson_difference(xa, xb, y, resamples=3000, seed=5)
    idx = np.random.default_rng(5).integers(0, 16, size=(3000, 16))
    d = np.array([np.corrcoef(xa[i], y[i])[0, 1] - np.corrcoef(xb[i], y[i])[0, 1] for i in idx])
    assert (ci.low, ci.high) == pytest.approx(tuple(np.quantile(d, [0.025, 0.975])), abs=1e-12)
    assert ci.high < 0  # xa's r is more negative, resolved by the paired resamples
    assert bootstrap_pearson_difference(xa[:2], xb[:2], y[:2]) is None


def test_rank_correlation_is_spearman():
    from scipy.stats import spearmanr

    from dtpshard.studies.stats import rank_correlate

    x = [29.5, 20.0, 12.6, 21.7, 19.7, 25.0]
    y = [0.73, 1.02, 4.60, 0.93, 3.69, 0.85]  # monotone but far from a line: Pearson is bent, ρ is not
    rk = rank_correlate(x, y)
    ref = spearmanr(x, y)
    assert rk.rho == pytest.approx(ref.statistic) and rk.p == pytest.approx(ref.pvalue) and rk.n == 6
    assert rk.rho < pearsonr(x, y).statistic
    assert rank_correlate([1, 2, None, 3], [3, 2, 9, 1]).rho == pytest.approx(-1.0)
    assert rank_correlate([1, 2], [1, 2]).rho is None and rank_correlate([1, 1, 1], [1, 2, 3]).rho is None
