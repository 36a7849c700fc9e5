"""The co-located score J (docs/design.md §3) and `dtpshard score`."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dtpshard.affinity.file import Affinity, edges_for_delay
from dtpshard.cli import main
from dtpshard.core.errors import UserError
from dtpshard.core.layout import Layout
from dtpshard.core.shape import UnitShape
from dtpshard.layouts.score import colocated_score, layout_devices, perm_from_devices
from tiny import with_nan

MODEL = UnitShape(3, 4, 2, 8)


def random_affinity(model=MODEL, delay=1, seed=0) -> Affinity:
    rng = np.random.default_rng(seed)
    modules = 2 * model.layers
    edges = {(a, b): rng.lognormal(0, 1.5, (model.units(a), model.units(b)))
             for a, b in edges_for_delay(modules, delay)}
    return Affinity(model, delay, edges)


def brute_force_j(aff: Affinity, layout: Layout) -> float:
    """J straight from the definition: loop over every pair on the same device."""
    total = 0.0
    for (a, b) in edges_for_delay(2 * layout.layers, layout.delay):
        s = aff.edges[(a, b)]
        dev_a = layout.kv_device(a // 2) if a % 2 == 0 else layout.ffn_device(a // 2)
        dev_b = layout.kv_device(b // 2) if b % 2 == 0 else layout.ffn_device(b // 2)
        for u in range(s.shape[0]):
            for v in range(s.shape[1]):
                if dev_a[u] == dev_b[v]:
                    total += s[u, v] / s.sum()
    return total


@pytest.mark.parametrize("delay,devices", [(1, 2), (1, 4), (2, 2), (3, 4)])
def test_j_matches_definition(delay, devices):
    aff = random_affinity(delay=delay, seed=delay)
    for seed in range(3):
        layout = Layout.random(MODEL, devices, delay, seed=seed)
        score = colocated_score(aff, layout)
        assert score["J"] == pytest.approx(brute_force_j(aff, layout), rel=1e-12)
        assert score["n_edges"] == len(edges_for_delay(2 * MODEL.layers, delay))
        assert score["random_expectation"] == pytest.approx(score["n_edges"] / devices)
        assert sum(e["colocated"] for e in score["edges"]) == pytest.approx(score["J"], rel=1e-12)


def test_hand_computed_contiguous():
    model = UnitShape(1, 2, 1, 2)
    s = np.array([[1.0, 2.0], [3.0, 10.0]])  # heads -> neurons; L = 2: pairs (0,0) and (1,1)
    aff = Affinity(model, 1, {(0, 1): s})
    contiguous = colocated_score(aff, Layout.contiguous(model, 2, 1))
    assert contiguous["J"] == pytest.approx((1 + 10) / 16)
    swapped = Layout.contiguous(model, 2, 1)
    swapped.ffn_perms[0] = np.array([1, 0])  # neuron 1 on device 0, neuron 0 on device 1
    assert colocated_score(aff, swapped)["J"] == pytest.approx((2 + 3) / 16)
    assert contiguous["layers"][0]["up"] == pytest.approx(11 / 16) and contiguous["layers"][0]["down"] is None


def test_single_device_reaches_maximum():
    aff = random_affinity(delay=2)
    score = colocated_score(aff, Layout.random(MODEL, 1, 2, seed=3))
    assert score["J"] == pytest.approx(score["n_edges"]) and score["max"] == score["n_edges"]


def test_random_layouts_average_the_expectation():
    aff = random_affinity(seed=5)
    js = np.array([colocated_score(aff, Layout.random(MODEL, 4, 1, seed=s))["J"] for s in range(400)])
    expectation = len(aff.edges) / 4
    stderr = js.std(ddof=1) / np.sqrt(len(js))
    assert abs(js.mean() - expectation) < 4 * stderr
    assert js.std() > 0.01  # the layouts really differ


def test_relabelling_devices_leaves_j_unchanged():
    aff = random_affinity(delay=2, seed=7)
    layout = Layout.random(MODEL, 4, 2, seed=11)
    relabel = np.array([2, 0, 3, 1])
    devs = [relabel[d] for d in layout_devices(layout)]
    moved = Layout(4, 2, "relabelled", MODEL,
                   [perm_from_devices(devs[2 * i], 4) for i in range(3)],
                   [perm_from_devices(devs[2 * i + 1], 4) for i in range(3)])
    assert not all((a == b).all() for a, b in zip(moved.ffn_perms, layout.ffn_perms))
    assert colocated_score(aff, moved)["J"] == pytest.approx(colocated_score(aff, layout)["J"], rel=1e-12)
    # relabelling one module only is a different layout, and J notices
    devs[1] = relabel[devs[1]]
    one = Layout(4, 2, "x", MODEL, moved.kv_perms,
                 [perm_from_devices(devs[2 * i + 1], 4) for i in range(3)])
    assert colocated_score(aff, one)["J"] != pytest.approx(colocated_score(aff, layout)["J"], rel=1e-6)


def test_perm_from_devices_round_trip():
    rng = np.random.default_rng(0)
    dev = rng.permutation(np.arange(12) // 4)
    perm = perm_from_devices(dev, 3)
    layout = Layout(3, 1, "x", UnitShape(1, 3, 1, 12),
                    [np.arange(3)], [perm])
    assert (layout.ffn_device(0) == dev).all()
    assert (perm_from_devices(np.arange(12) // 4, 3) == np.arange(12)).all()
    with pytest.raises(ValueError):
        perm_from_devices(np.zeros(12, dtype=int), 3)


def test_zero_mass_edge_is_refused():
    aff = random_affinity()
    aff.edges[(0, 1)] = np.zeros_like(aff.edges[(0, 1)])
    with pytest.raises(UserError, match="edge.0.1 has total mass 0"):
        colocated_score(aff, Layout.contiguous(MODEL, 2, 1))



@pytest.mark.parametrize("bad,match", [(np.nan, "NaN or infinite"), (np.inf, "NaN or infinite"),
                                       (-np.inf, "NaN or infinite"), (-1e-3, "negative scores")])
def test_non_finite_or_negative_scores_are_refused(bad, match):
    aff = random_affinity()
    aff.edges[(1, 2)][2, 1] = bad
    with pytest.raises(UserError, match=f"edge.1.2 (contains|has) {match}"):
        colocated_score(aff, Layout.contiguous(MODEL, 2, 1))

# -- the command ---------------------------------------------------------------------------------
def _files(tmp_path, model=MODEL, delay=1, devices=2, layout_model=None, layout_delay=None):
    aff = tmp_path / "aff.safetensors"
    random_affinity(model, delay).save(aff)
    lay = tmp_path / "layout.json"
    Layout.random(layout_model or model, devices, delay if layout_delay is None else layout_delay, seed=1).save(lay)
    return aff, lay


def test_score_cmd_json(tmp_path, capsys):
    aff, lay = _files(tmp_path)
    assert main(["score", str(aff), str(lay), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = colocated_score(Affinity.load(aff), Layout.load(lay))
    assert out["J"] == pytest.approx(want["J"])
    assert out["n_edges"] == 5 and out["random_expectation"] == pytest.approx(2.5)
    assert [row["layer"] for row in out["layers"]] == [0, 1, 2]
    assert all(0 <= row["up"] <= 1 for row in out["layers"])
    assert [row["down"] is None for row in out["layers"]] == [False, False, True]
    assert main(["score", str(aff), str(lay)]) == 0
    text = capsys.readouterr().out
    assert f"J = {want['J']:.6f}" in text and "random expectation 2.5000" in text


def _one_line_error(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtpshard score: error:") and err.count("\n") == 1, err
    assert needle in err, err


def test_score_cmd_bad_inputs(tmp_path, capsys):
    other = UnitShape(3, 4, 2, 16)
    aff, lay = _files(tmp_path, layout_model=other)
    _one_line_error(capsys, ["score", str(aff), str(lay)], "neurons=16 but the affinity file")
    aff, lay = _files(tmp_path, layout_delay=2)
    _one_line_error(capsys, ["score", str(aff), str(lay)], "no edge.0.2, needed at delay 2")
    random_affinity().save(tmp_path / "good.safetensors")
    with_nan(tmp_path / "good.safetensors", tmp_path / "nan.safetensors", (1, 2), (3, 1))
    _one_line_error(capsys, ["score", str(tmp_path / "nan.safetensors"), str(lay)], "NaN")
    _one_line_error(capsys, ["score", str(tmp_path / "missing.safetensors"), str(lay)], "not found")
