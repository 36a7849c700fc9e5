"""`dtpshard layout`: every kind from an affinity file, contiguous/random from a model directory,
and one clear line for each bad input."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from dtpshard.affinity.file import Affinity, edges_for_delay
from dtpshard.cli import main
from dtpshard.core.layout import Layout
from dtpshard.core.shape import UnitShape
from dtpshard.layouts.score import colocated_score
from tiny import with_nan

MODEL = UnitShape(4, 8, 2, 24)


def write_affinity(path, model=MODEL, delay=1, seed=0):
    rng = np.random.default_rng(seed)
    modules = 2 * model.layers
    f = [rng.standard_normal((model.units(m), 3)) for m in range(modules)]
    edges = {(a, b): np.exp(f[a] @ f[b].T) for a, b in edges_for_delay(modules, delay)}
    Affinity(model, delay, edges).save(path)
    return path


@pytest.fixture
def aff(tmp_path):
    return write_affinity(tmp_path / "aff.safetensors")


KINDS = ["optimised", "contiguous", "random", "anti", "heads-only", "neurons-only"]


def test_every_kind_writes_a_scored_layout(aff, tmp_path, capsys):
    js = {}
    for kind in KINDS:
        out = tmp_path / f"{kind}.json"
        assert main(["layout", str(aff), "--devices", "4", "--delay", "1", "--kind", kind, "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        layout = Layout.load(out)
        assert layout.devices == 4 and layout.delay == 1 and layout.kind == kind
        s = layout.score
        assert s["n_edges"] == 7 and s["random_expectation"] == pytest.approx(7 / 4) and s["seconds"] >= 0
        assert s["J"] == pytest.approx(colocated_score(Affinity.load(aff), layout)["J"], rel=1e-12)
        assert f"J = {s['J']:.6f}" in printed and "random expectation 1.7500" in printed and " s" in printed
        js[kind] = s["J"]
    assert js["anti"] < min(js["contiguous"], js["random"]) <= max(js["contiguous"], js["random"]) < js["optimised"]
    assert Layout.load(tmp_path / "contiguous.json").is_identity()


def test_layers_restarts_and_score_round_trip(aff, tmp_path, capsys):
    out = tmp_path / "k2.json"
    assert main(["layout", str(aff), "--layers", "2", "--restarts", "2", "--out", str(out)]) == 0
    layout = Layout.load(out)
    assert layout.score["optimised_layers"] == [0, 2]
    assert all((layout.kv_perms[i] == np.arange(8)).all() and (layout.ffn_perms[i] == np.arange(24)).all()
               for i in (1, 3))
    capsys.readouterr()
    assert main(["score", str(aff), str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["J"] == pytest.approx(layout.score["J"], rel=1e-12)


def test_random_seed(aff, tmp_path):
    paths = [tmp_path / f"r{i}.json" for i in range(3)]
    for p, seed in zip(paths, ["3", "3", "4"]):
        assert main(["layout", str(aff), "--kind", "random", "--seed", seed, "--out", str(p)]) == 0
    a, b, c = (Layout.load(p) for p in paths)
    assert all((x == y).all() for x, y in zip(a.ffn_perms, b.ffn_perms))
    assert any((x != y).any() for x, y in zip(a.ffn_perms, c.ffn_perms))
    assert a.seed == 3


def test_delay_two_uses_every_edge(tmp_path):
    aff = write_affinity(tmp_path / "aff2.safetensors", delay=2)
    out = tmp_path / "d2.json"
    assert main(["layout", str(aff), "--delay", "2", "--devices", "2", "--kv-search", "exhaustive",
                 "--out", str(out)]) == 0
    layout = Layout.load(out)
    assert layout.delay == 2 and layout.score["n_edges"] == len(edges_for_delay(8, 2)) == 13


def test_model_directory_source(tiny_dirs, tmp_path, capsys):
    pytest.importorskip("dtpshard.model.checkpoint")
    from dtpshard.model.checkpoint import read_shape

    model_dir = tiny_dirs["llama"]
    shape = read_shape(model_dir).unit_shape()
    out = tmp_path / "c.json"
    assert main(["layout", str(model_dir), "--kind", "contiguous", "--devices", "2", "--out", str(out)]) == 0
    layout = Layout.load(out)
    assert layout.model == shape and layout.is_identity() and "J" not in layout.score
    assert "not scored" in capsys.readouterr().out
    assert main(["layout", str(model_dir), "--kind", "random", "--seed", "1", "--devices", "2",
                 "--out", str(out)]) == 0
    assert not Layout.load(out).is_identity()
    _one_line_error(capsys, ["layout", str(model_dir), "--kind", "optimised", "--devices", "2", "--out", str(out)],
                    "needs an affinity file")


def _one_line_error(capsys, argv, needle):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtpshard layout: error:") and err.count("\n") == 1, err
    assert needle in err, err


def test_bad_inputs(aff, tmp_path, capsys):
    out = str(tmp_path / "x.json")
    _one_line_error(capsys, ["layout", str(aff), "--devices", "3", "--out", out], "devices=3 does not divide")
    _one_line_error(capsys, ["layout", str(aff), "--devices", "0", "--out", out], "--devices 0")
    _one_line_error(capsys, ["layout", str(aff), "--delay", "2", "--out", out], "no edge.0.2, needed at delay 2")
    _one_line_error(capsys, ["layout", str(aff)], "missing --out")
    _one_line_error(capsys, ["layout", str(aff), "--layers", "9", "--out", out], "--layers 9")
    _one_line_error(capsys, ["layout", str(tmp_path / "nope"), "--out", out], "no such model directory")
    with_nan(aff, tmp_path / "nan.safetensors", (2, 3), (0, 0))
    _one_line_error(capsys, ["layout", str(tmp_path / "nan.safetensors"), "--out", out], "NaN")
    other = Affinity.load(aff)  # tensors of this shape, metadata of another model
    other.model = replace(MODEL, neurons=32)
    other.save(tmp_path / "other.safetensors")
    _one_line_error(capsys, ["layout", str(tmp_path / "other.safetensors"), "--out", out], "expected [8, 32]")
    zero = Affinity.load(aff)
    zero.edges[(1, 2)][:] = 0
    zero.save(tmp_path / "zero.safetensors")
    _one_line_error(capsys, ["layout", str(tmp_path / "zero.safetensors"), "--out", out], "total mass 0")
    assert not (tmp_path / "x.json").exists()


def test_only_the_edges_the_delay_needs_are_loaded_and_memory_is_checked(tmp_path, capsys, monkeypatch):
    """A δ = 1 layout from a δ = 2 file reads no FFN -> FFN edge; what does not fit is one line."""
    path = write_affinity(tmp_path / "d2.safetensors", delay=2)
    modules = 2 * MODEL.layers
    assert set(Affinity.load(path, delay=1).edges) == set(edges_for_delay(modules, 1))
    assert set(Affinity.load(path).edges) == set(edges_for_delay(modules, 2))
    need_1 = 8 * sum(MODEL.units(a) * MODEL.units(b) for a, b in edges_for_delay(modules, 1))
    monkeypatch.setattr("dtpshard.core.memory.available_bytes", lambda: need_1 + 8 * 24 * 8)
    out = tmp_path / "x.json"
    assert main(["layout", str(path), "--delay", "1", "--out", str(out)]) == 0 and out.exists()
    capsys.readouterr()
    _one_line_error(capsys, ["layout", str(path), "--delay", "2", "--out", str(tmp_path / "y.json")],
                    "of memory, more than the")
    assert not (tmp_path / "y.json").exists()
