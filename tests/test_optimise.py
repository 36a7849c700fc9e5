"""The layout optimiser: exact block updates, monotone ascent, every layout family."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from dtpshard.affinity.file import Affinity, edges_for_delay
from dtpshard.core.errors import UserError
from dtpshard.core.layout import Layout
from dtpshard.core.shape import UnitShape
from dtpshard.layouts import assignment
from dtpshard.layouts.assignment import assign, price_start
from dtpshard.layouts.optimise import (
    Problem,
    ascend,
    balanced_assignment,
    evenly_spaced_layers,
    exhaustive_assignment,
    family_blocks,
    labelled_partitions,
    optimise_layout,
)
from dtpshard.layouts.score import colocated_score, j_of_devices


def structured_affinity(model, delay=1, seed=0, rank=3) -> Affinity:
    """Low rank plus noise, heavy-tailed: there is something for the optimiser to find."""
    rng = np.random.default_rng(seed)
    modules = 2 * model.layers
    f = [rng.standard_normal((model.units(m), rank)) for m in range(modules)]
    edges = {(a, b): np.exp(f[a] @ f[b].T + 0.3 * rng.standard_normal((model.units(a), model.units(b))))
             for a, b in edges_for_delay(modules, delay)}
    return Affinity(model, delay, edges)


def all_balanced(n_units, devices):
    """Independent of labelled_partitions: distinct orderings of a balanced label multiset."""
    base = tuple(np.arange(n_units) // (n_units // devices))
    return [np.array(p) for p in sorted(set(itertools.permutations(base)))]


def value(gain, dev):
    return gain[np.arange(len(dev)), dev].sum()


# -- the balanced assignment solver ---------------------------------------------------------------
@pytest.mark.parametrize("n_units,devices", [(4, 2), (6, 2), (6, 3), (8, 4), (8, 2), (9, 3)])
def test_balanced_assignment_equals_brute_force(n_units, devices):
    rng = np.random.default_rng(n_units * 10 + devices)
    candidates = all_balanced(n_units, devices)
    for trial in range(15):
        gain = rng.standard_normal((n_units, devices)) if trial % 2 else rng.integers(0, 3, (n_units, devices)) * 1.0
        start = rng.permutation(np.arange(n_units) // (n_units // devices)) if trial % 3 else None
        dev = balanced_assignment(gain, devices, start)
        assert (np.bincount(dev, minlength=devices) == n_units // devices).all()
        assert value(gain, dev) == pytest.approx(max(value(gain, c) for c in candidates), abs=1e-12)


@pytest.mark.parametrize("devices", [2, 3, 4, 8])
def test_balanced_assignment_equals_linear_sum_assignment(devices):
    """Against scipy's LSA on the [U, U] matrix with each device's column replicated U/L times."""
    rng = np.random.default_rng(devices)
    for trial in range(10):
        n_units = devices * int(rng.integers(2, 30))
        gain = rng.lognormal(0, 2, (n_units, devices)) * 1e-4
        if trial % 2:
            gain = np.round(gain / gain.max() * 4)  # many ties
        slots = np.repeat(gain, n_units // devices, axis=1)
        rows, cols = linear_sum_assignment(slots, maximize=True)
        dev = balanced_assignment(gain, devices, rng.permutation(np.arange(n_units) // (n_units // devices)))
        assert value(gain, dev) == pytest.approx(slots[rows, cols].sum(), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("price_after", [1, 3])
def test_price_started_assignment_equals_linear_sum_assignment(monkeypatch, price_after):
    """The price start replaces the start after `price_after` cycles: the result stays exact."""
    monkeypatch.setattr(assignment, "PRICE_AFTER", price_after)
    rng = np.random.default_rng(price_after)
    for trial in range(12):
        devices = [2, 4, 8][trial % 3]
        n_units = devices * int(rng.integers(2, 40))
        gain = rng.lognormal(0, 2, (n_units, devices)) * 1e-4
        if trial % 2:
            gain = np.round(gain / gain.max() * 3)  # ties everywhere: prices cannot balance alone
        slots = np.repeat(gain, n_units // devices, axis=1)
        rows, cols = linear_sum_assignment(slots, maximize=True)
        dev = balanced_assignment(gain, devices, rng.permutation(np.arange(n_units) // (n_units // devices)))
        assert value(gain, dev) == pytest.approx(slots[rows, cols].sum(), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("rounds", [1, 8])
def test_price_start_is_balanced(rounds):
    """Balanced with ties, and when Gauss-Seidel stops before the counts balance (the repair)."""
    rng = np.random.default_rng(rounds)
    for gain in (rng.standard_normal((96, 8)), rng.integers(0, 2, (96, 8)) * 1.0, np.ones((96, 4))):
        dev = price_start(gain, 96 // gain.shape[1], rounds=rounds)
        assert (np.bincount(dev, minlength=gain.shape[1]) == 96 // gain.shape[1]).all()


def test_assignment_at_the_70b_block_size_meets_its_dual_certificate():
    """28672 neurons on 8 devices (LSA's [U, U] matrix would be 6.6 GB): the returned prices p
    certify the optimum by LP duality, Σ_u max_d (gain - p) + U/L · Σ p = Σ_u gain[u, dev(u)]."""
    rng = np.random.default_rng(70)
    n_units, devices = 28672, 8
    low = rng.standard_normal((n_units, 3)) @ rng.standard_normal((3, devices))
    gain = np.exp(low + 0.5 * rng.standard_normal((n_units, devices))) * rng.lognormal(0, 1, (n_units, 1))
    dev, prices = assign(gain, devices)
    assert (np.bincount(dev, minlength=devices) == n_units // devices).all()
    primal = value(gain, dev)
    dual = (gain - prices).max(axis=1).sum() + n_units // devices * prices.sum()
    assert dual >= primal - 1e-9 and dual - primal <= n_units * 1e-12 * np.abs(gain).max()
    assert (dev != np.arange(n_units) // (n_units // devices)).mean() > 0.5  # a cold solve, far from its start


def test_balanced_assignment_keeps_an_optimal_start():
    gain = np.zeros((8, 4))
    start = np.array([3, 1, 0, 2, 0, 1, 2, 3])
    assert (balanced_assignment(gain, 4, start) == start).all()
    with pytest.raises(ValueError):
        balanced_assignment(gain, 4, np.zeros(8, dtype=int))


@pytest.mark.parametrize("groups,devices,count", [(8, 4, 2520), (8, 2, 70), (8, 8, 40320), (6, 3, 90)])
def test_exhaustive_kv_search_agrees_with_exact_assignment(groups, devices, count):
    parts = labelled_partitions(groups, devices)
    assert parts.shape == (count, groups) and len({tuple(p) for p in parts}) == count
    assert (np.stack([np.bincount(p, minlength=devices) for p in parts[:50]]) == groups // devices).all()
    rng = np.random.default_rng(groups + devices)
    for trial in range(10):
        gain = rng.standard_normal((groups, devices)) if trial % 2 else rng.integers(0, 2, (groups, devices)) * 1.0
        start = rng.permutation(np.arange(groups) // (groups // devices))
        exact = balanced_assignment(gain, devices, start)
        paper = exhaustive_assignment(gain, devices, start)
        assert value(gain, paper) == pytest.approx(value(gain, exact), abs=1e-12)


def test_exhaustive_search_refuses_huge_spaces():
    with pytest.raises(UserError, match="too large"):
        labelled_partitions(16, 4)


# -- block updates inside the ascent ---------------------------------------------------------------
@pytest.mark.parametrize("delay,devices", [(1, 2), (1, 3), (2, 2), (3, 3)])
def test_each_block_update_is_the_brute_force_best(delay, devices):
    """Every block of a sweep reaches the best J over all balanced assignments of that module,
    with J recomputed from scratch (so linearity of the gain is tested too, δ ≥ 2 included)."""
    model = UnitShape(2, 6, 1, 6)
    problem = Problem.build(structured_affinity(model, delay, seed=delay + devices), devices, delay)
    devs = problem.contiguous()
    rng = np.random.default_rng(0)
    devs = [rng.permutation(d) for d in devs]  # start away from the optimum
    candidates = all_balanced(6, devices)
    for m in family_blocks("optimised", 2) * 2:
        before = problem.j(devs)
        devs, _ = ascend(problem, devs, [m], max_sweeps=1)
        trial = [d.copy() for d in devs]
        best = -np.inf
        for c in candidates:
            trial[m] = c
            best = max(best, problem.j(trial))
        assert problem.j(devs) == pytest.approx(best, abs=1e-12)
        assert problem.j(devs) >= before - 1e-12


def test_cached_products_match_fresh_ones():
    """The optimiser updates edge products through the moved units only; J must not drift."""
    model = UnitShape(3, 8, 1, 64)
    problem = Problem.build(structured_affinity(model, 2, seed=1), 4, 2)
    rng = np.random.default_rng(2)
    devs = problem.contiguous()
    for step in range(60):
        m = int(rng.integers(0, 6))
        n_moves = 1 if step % 3 else 40  # small moves are incremental, large ones recomputed
        for _ in range(n_moves):
            u, v = rng.choice(len(devs[m]), 2, replace=False)
            devs[m][[u, v]] = devs[m][[v, u]]
        fresh = j_of_devices(problem.edges, devs, 4)
        assert problem.j(devs) == pytest.approx(fresh, rel=1e-12)
        gain = problem.block_gain(devs, m)
        for d in range(4):  # the gain of a unit on d is J with that unit moved to d, up to a constant
            trial = [x.copy() for x in devs]
            w = int(np.flatnonzero(devs[m] == d)[0])
            u = int(np.flatnonzero(devs[m] != d)[0])
            trial[m][[u, w]] = trial[m][[w, u]]
            change = (gain[u, d] + gain[w, devs[m][u]]) - (gain[u, devs[m][u]] + gain[w, d])
            assert j_of_devices(problem.edges, trial, 4) - fresh == pytest.approx(change, abs=1e-12)


MODEL = UnitShape(3, 24, 2, 48)


@pytest.mark.parametrize("devices,delay", [(2, 1), (3, 1), (4, 1), (8, 1), (4, 2)])
def test_optimised_beats_contiguous_and_random_anti_loses(devices, delay):
    aff = structured_affinity(MODEL, delay, seed=devices)
    opt = optimise_layout(aff, devices, delay, "optimised")
    anti = optimise_layout(aff, devices, delay, "anti")
    others = [colocated_score(aff, Layout.contiguous(MODEL, devices, delay))["J"]]
    others += [colocated_score(aff, Layout.random(MODEL, devices, delay, seed=s))["J"] for s in range(20)]
    assert opt.score["J"] > max(others) and anti.score["J"] < min(others)
    for layout in (opt, anti):  # the recorded score is the layout's real score
        assert colocated_score(aff, layout)["J"] == pytest.approx(layout.score["J"], rel=1e-12)
        assert layout.score["random_expectation"] == pytest.approx(layout.score["n_edges"] / devices)
        assert layout.score["seconds"] > 0 and 1 <= layout.score["sweeps"] <= 20
    assert all(np.diff(opt.score["history"]) >= -1e-12)  # J never decreases across sweeps
    assert opt.score["history"][-1] == pytest.approx(opt.score["J"], rel=1e-12)  # cached == fresh
    assert all(np.diff(anti.score["history"]) <= 1e-12)
    assert opt.score["history"][0] == pytest.approx(others[0])  # the paper's start: contiguous


def test_sweeps_stop_at_the_limit_or_when_flat():
    aff = structured_affinity(MODEL, 1, seed=3)
    one = optimise_layout(aff, 4, 1, "optimised", max_sweeps=1)
    assert one.score["sweeps"] == 1 and len(one.score["history"]) == 2
    full = optimise_layout(aff, 4, 1, "optimised")
    hist = full.score["history"]
    assert full.score["sweeps"] == 20 or hist[-1] - hist[-2] < 1e-9
    assert full.score["J"] >= one.score["J"]


def test_heads_only_and_neurons_only_leave_the_other_side_contiguous():
    aff = structured_affinity(MODEL, 1, seed=4)
    heads = optimise_layout(aff, 4, 1, "heads-only")
    neurons = optimise_layout(aff, 4, 1, "neurons-only")
    assert all((p == np.arange(48)).all() for p in heads.ffn_perms)
    assert any((p != np.arange(24)).any() for p in heads.kv_perms)
    assert all((p == np.arange(24)).all() for p in neurons.kv_perms)
    assert any((p != np.arange(48)).any() for p in neurons.ffn_perms)
    contiguous = colocated_score(aff, Layout.contiguous(MODEL, 4, 1))["J"]
    assert heads.score["J"] > contiguous and neurons.score["J"] > contiguous


def test_evenly_spaced_layers():
    assert evenly_spaced_layers(28, 4) == [0, 7, 14, 21]
    assert evenly_spaced_layers(10, 3) == [0, 3, 7]
    assert evenly_spaced_layers(5, 5) == [0, 1, 2, 3, 4]
    assert evenly_spaced_layers(16, 1) == [0]
    for bad in (0, 6):
        with pytest.raises(UserError, match="--layers"):
            evenly_spaced_layers(5, bad)


def test_k_layers_changes_only_those_layers():
    model = UnitShape(6, 8, 1, 16)
    aff = structured_affinity(model, 1, seed=5)
    layout = optimise_layout(aff, 4, 1, "optimised", layers=2)
    assert layout.score["optimised_layers"] == [0, 3]
    for i in range(6):
        changed = (layout.kv_perms[i] != np.arange(8)).any() or (layout.ffn_perms[i] != np.arange(16)).any()
        assert changed == (i in (0, 3)), i
    full = optimise_layout(aff, 4, 1, "optimised")
    contiguous = colocated_score(aff, Layout.contiguous(model, 4, 1))["J"]
    assert contiguous < layout.score["J"] < full.score["J"]


def test_restarts_keep_the_best_start():
    aff = structured_affinity(MODEL, 1, seed=6)
    single = optimise_layout(aff, 4, 1, "optimised")
    several = optimise_layout(aff, 4, 1, "optimised", restarts=4, seed=1)
    assert several.score["J"] >= single.score["J"] - 1e-12
    assert several.score["restarts"] == 4 and 0 <= several.score["best_restart"] < 4
    anti = optimise_layout(aff, 4, 1, "anti", restarts=3)
    assert anti.score["J"] <= optimise_layout(aff, 4, 1, "anti").score["J"] + 1e-12


def test_exhaustive_kv_option_reaches_the_same_j():
    model = UnitShape(3, 8, 1, 16)
    aff = structured_affinity(model, 1, seed=8)
    exact = optimise_layout(aff, 4, 1, "heads-only")
    paper = optimise_layout(aff, 4, 1, "heads-only", kv_search="exhaustive")
    assert paper.score["J"] == pytest.approx(exact.score["J"], abs=1e-12)


def test_relabelled_optimum_scores_the_same():
    aff = structured_affinity(MODEL, 1, seed=9)
    layout = optimise_layout(aff, 4, 1, "optimised")
    def rotate(p):  # device d's block moves to device d+1
        return np.roll(p, len(p) // 4)

    moved = Layout(4, 1, "moved", MODEL, [rotate(p) for p in layout.kv_perms],
                   [rotate(p) for p in layout.ffn_perms])
    assert colocated_score(aff, moved)["J"] == pytest.approx(layout.score["J"], rel=1e-12)


def test_delay_zero_has_no_edges_and_kinds_are_checked():
    aff = structured_affinity(MODEL, 1, seed=10)
    layout = optimise_layout(aff, 4, 0, "optimised")
    assert layout.score["n_edges"] == 0 and layout.score["J"] == 0 and layout.is_identity()
    with pytest.raises(UserError, match="does not divide"):
        optimise_layout(aff, 5, 1)
    with pytest.raises(UserError, match="no edge.0.2"):
        optimise_layout(aff, 4, 2)
    with pytest.raises(UserError, match="kind"):
        optimise_layout(aff, 4, 1, "best")
    with pytest.raises(UserError, match="kind 'random'"):  # contiguous and random are made, not optimised
        optimise_layout(aff, 4, 1, "random")
    from dtpshard.core.settings import DTPSettings
    from dtpshard.layouts.make import make_layout

    with pytest.raises(UserError, match="--layers and --restarts"):
        make_layout(aff.model, DTPSettings(4, 1, "sqrt"), "random", affinity=aff, restarts=2)
    scored = make_layout(aff.model, DTPSettings(4, 1, "sqrt"), "contiguous", affinity=aff)
    assert scored.is_identity() and scored.score["J"] == pytest.approx(colocated_score(aff, scored)["J"], rel=1e-12)
