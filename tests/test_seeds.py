"""The report's "Layout or seed" section (dtpshard/studies/seeds.py) on synthetic experiments: ICC(1)
by hand, J's correlations on the seed mean and on seed 0, the split test, and the figure."""
import math

import numpy as np
import pytest

from dtpshard.studies.report import load_study, write_report
from dtpshard.studies.seeds import bootstrap_icc, icc1, j_correlations, seeded_random, split_test
from test_report import make_experiment

# four random layouts, three seeds each: KL rises as J falls, with seed noise around each layout
RANDOM = {f"random-{i}": ("random", J, {s: [1.5, 1.0, kl + 0.02 * (s - 1) * (i + 1)] for s in range(3)})
          for i, (J, kl) in enumerate([(6.0, 0.40), (5.5, 0.45), (5.0, 0.55), (4.5, 0.60)])}
PLAN = {"optimised": ("optimised", 9.0, {0: [1.0, 0.5, 0.30], 1: [1.1, 0.5, 0.32]}),
        "contiguous": ("contiguous", 5.0, {0: [1.2, 0.7, 0.42], 1: [1.3, 0.7, 0.40]}), **RANDOM}
ZERO = {name: 1.5 for name in PLAN}


def test_icc1_by_hand():
    # grand 3.5; MSB = 3·(1.5² + 1.5²) = 13.5; MSW = 4 / 4 = 1; ICC = (13.5 − 1) / (13.5 + 2·1)
    assert icc1([[1, 2, 3], [4, 5, 6]]) == pytest.approx(12.5 / 15.5)
    assert icc1([[1, 1], [2, 2], [3, 3]]) == pytest.approx(1.0)  # seeds agree: only the layout matters
    assert icc1([[1, 2], [1, 2], [1, 2]]) < 0  # no layout effect: at or below 0
    # unequal groups: n0 = (N − Σ n_i²/N)/(g − 1) = (5 − 13/5)/1 = 2.4
    g = [[1.0, 2.0, 3.0], [5.0, 7.0]]
    grand = 18 / 5
    msb = (3 * (2 - grand) ** 2 + 2 * (6 - grand) ** 2) / 1
    msw = (2 + 2) / 3
    assert icc1(g) == pytest.approx((msb - msw) / (msb + 1.4 * msw))
    apart = [[k, k + 0.1, k - 0.1] for k in range(10)]  # layouts far apart, seeds close: ICC near 1
    ci = bootstrap_icc(apart, resamples=500)
    assert ci is not None and 0.9 < ci.low <= icc1(apart) <= ci.high <= 1.0


def test_split_test_is_exact():
    diff, p, exact = split_test([0.1, 0.2, 0.9, 1.0])
    assert exact
    assert diff == pytest.approx(0.15 - 0.95)
    assert p == pytest.approx(2 / 6)  # {0,1} and {2,3} are the two splits as extreme, of 6


def test_seed_section(tmp_path):
    d = make_experiment(tmp_path / "exp", plan=PLAN, zero_kl=ZERO)
    study = load_study(d)
    seeded = seeded_random(study)
    assert [i.name for i, _ in seeded] == ["random-0", "random-1", "random-2", "random-3"]  # by J, highest first
    mean, first = j_correlations(study)
    assert mean.n == first.n == 6
    kl = {"optimised": 0.31, "contiguous": 0.41, **{n: RANDOM[n][2][1][2] for n in RANDOM}}
    J = {n: PLAN[n][1] for n in PLAN}
    assert mean.r == pytest.approx(np.corrcoef([J[n] for n in kl], [kl[n] for n in kl])[0, 1])
    write_report(d)
    md = (d / "report.md").read_text()
    assert "## Layout or seed" in md and "figures/seeds.png" in md and (d / "figures" / "seeds.png").is_file()
    groups = [[RANDOM[n][2][s][2] for s in range(3)] for n in RANDOM]
    line = next(ln for ln in md.splitlines() if ln.startswith("- ICC(1) on KL "))
    assert f"{icc1(groups):+.3f}" in line
    line = next(ln for ln in md.splitlines() if ln.startswith("- ICC(1) on log KL"))
    assert f"{icc1([[math.log(v) for v in g] for g in groups]):+.3f}" in line


def test_no_section_with_one_seed_per_layout(tmp_path):
    d = make_experiment(tmp_path / "exp")  # test_report's plan: random layouts with one seed
    write_report(d)
    assert "Layout or seed" not in (d / "report.md").read_text()
    assert not (d / "figures" / "seeds.png").exists()


def test_an_icc_of_exactly_zero_is_kept_by_the_bootstrap(monkeypatch):
    """Issue 46: `icc1(...) or np.nan` turned an ICC of 0.0 into a missing resample."""
    import dtpshard.studies.seeds as seeds

    monkeypatch.setattr(seeds, "icc1", lambda groups: 0.0)
    ci = bootstrap_icc([[1.0, 2.0], [3.0, 4.0]], resamples=20)
    assert ci is not None and (ci.low, ci.high, ci.resamples) == (0.0, 0.0, 20)
