"""Shared neurons in layouts (docs/design.md §6): the count, the choice by affinity mass, the file's
round trip, J counting a shared neuron as co-located with everything, and the refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dtpshard.affinity.file import Affinity
from dtpshard.cli import main
from dtpshard.core.errors import UserError
from dtpshard.core.layout import SHARED, Layout
from dtpshard.core.shape import UnitShape, shared_count
from dtpshard.layouts.score import colocated_score
from test_layout_cli import write_affinity

MODEL = UnitShape(4, 8, 2, 26)  # 26 neurons: not divisible by L = 4, 24 sharded ones are


def test_count_is_the_smallest_that_leaves_the_rest_divisible():
    assert shared_count(3072, 4, 0.1) == 308  # the example
    assert shared_count(3072, 4, 0.0) == 0
    assert shared_count(26, 4, 0.05) == 2 and shared_count(26, 4, 0.1) == 6
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(UserError, match="must be in"):
            shared_count(26, 4, bad)
    with pytest.raises(UserError, match="no sharded neuron"):
        shared_count(8, 4, 0.9)


def brute_j(aff: Affinity, layout: Layout) -> float:
    """J from its definition, pair by pair: a shared neuron is co-located with every unit."""
    total = 0.0
    for (a, b), s in aff.edges.items():
        da, db = layout.device(a), layout.device(b)
        s = np.asarray(s, dtype=np.float64)
        same = (da[:, None] == db[None, :]) | (da[:, None] == SHARED) | (db[None, :] == SHARED)
        total += float((s * same).sum() / s.sum())
    return total


@pytest.mark.parametrize("kind", ["optimised", "contiguous", "random", "anti", "neurons-only"])
@pytest.mark.parametrize("by", ["fo", "dn", "random"])
def test_every_kind_shares_the_same_count_and_round_trips(tmp_path, kind, by, capsys):
    aff_path = write_affinity(tmp_path / "aff.safetensors", MODEL)
    aff = Affinity.load(aff_path)
    out = tmp_path / "l.json"
    assert main(["layout", str(aff_path), "--kind", kind, "--devices", "4", "--shared", "0.1", "--shared-by", by,
                 "--out", str(out), "--seed", "2"]) == 0
    assert f"6 neurons a layer shared ({by})" in capsys.readouterr().out
    lay = Layout.load(out)
    assert (lay.shared, lay.shared_by) == (6, by)
    obj = json.loads(out.read_text())
    assert Layout.from_json(obj).to_json() == obj == lay.to_json()
    for i in range(MODEL.layers):
        sets = set(lay.shared_neurons(i).tolist())
        assert obj["layers"][i]["shared"] == sorted(sets)
        dev = lay.device(2 * i + 1)
        assert set(np.flatnonzero(dev == SHARED).tolist()) == sets
        assert np.bincount(dev[dev != SHARED], minlength=4).tolist() == [5] * 4
        if by != "random":  # the top 6 by mass (dn: the last layer falls back to fo)
            down = (2 * i + 1, 2 * i + 2)
            mass = aff.edges[down].sum(1) if by == "dn" and down in aff.edges else aff.edges[(2 * i, 2 * i + 1)].sum(0)
            assert sets == set(np.argsort(-np.asarray(mass))[:6].tolist())
    assert lay.score["J"] == pytest.approx(brute_j(aff, lay), rel=1e-10)
    assert colocated_score(aff, lay)["J"] == pytest.approx(lay.score["J"], rel=1e-10)


def test_optimised_beats_contiguous_with_the_same_shared_set(tmp_path):
    aff = write_affinity(tmp_path / "aff.safetensors", MODEL)
    js = {}
    for kind in ("optimised", "contiguous", "anti"):
        out = tmp_path / f"{kind}.json"
        assert main(["layout", str(aff), "--kind", kind, "--shared", "0.2", "--out", str(out)]) == 0
        lay = Layout.load(out)
        js[kind] = lay.score["J"]
        assert lay.shared == 6  # 0.2 x 26 = 5.2 -> 6, and 26 - 6 = 20 is divisible by 4
    assert js["anti"] < js["contiguous"] < js["optimised"]
    a, b = (Layout.load(tmp_path / f"{k}.json") for k in ("optimised", "contiguous"))
    assert all(set(a.shared_neurons(i)) == set(b.shared_neurons(i)) for i in range(MODEL.layers))


def test_hash_and_function_key_see_the_shared_count():
    plain = Layout.contiguous(UnitShape(2, 4, 1, 8), 2)
    shared = plain.with_shared(2, "random")
    assert plain.content_sha256() != shared.content_sha256()
    assert plain.function_key() != shared.function_key()


def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys):
    aff = write_affinity(tmp_path / "aff.safetensors", MODEL)
    out = tmp_path / "l.json"
    cases = {("--shared", "1"): "[0, 1)", ("--shared", "-0.5"): "[0, 1)",
             ("--shared", "0.9", "--devices", "4", "--kind", "contiguous"): None}
    for args, said in cases.items():
        assert main(["layout", str(aff), *args, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and (said is None or said in err), err
        assert not out.exists()
    # 0.99 of 8 neurons on 4 devices leaves none sharded
    small = write_affinity(tmp_path / "small.safetensors", UnitShape(2, 4, 1, 8))
    assert main(["layout", str(small), "--shared", "0.99", "--devices", "4", "--out", str(out)]) == 2
    assert "no sharded neuron" in capsys.readouterr().err and not out.exists()


def test_file_whose_shared_list_disagrees_with_its_permutation(tmp_path):
    obj = Layout.random(MODEL, 4, seed=1, shared=[np.arange(2)] * 4, shared_by="random").to_json()
    obj["layers"][1]["shared"] = [0, 5]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(UserError, match="layer 1 lists shared neurons"):
        Layout.load(path)
    obj = Layout.random(MODEL, 4, seed=1, shared=[np.arange(2)] * 4, shared_by="random").to_json()
    obj["shared"] = 3  # 23 sharded neurons on 4 devices
    path.write_text(json.dumps(obj))
    with pytest.raises(UserError, match="does not divide"):
        Layout.load(path)


def test_model_directory_shares_at_random_only(tmp_path, capsys):
    from tiny import save_tiny

    model = save_tiny(tmp_path / "m", intermediate_size=98)  # 98 = 2 + 4 x 24
    out = tmp_path / "l.json"
    assert main(["layout", str(model), "--kind", "contiguous", "--shared", "0.01", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs an affinity file" in err and "--shared-by random" in err and len(err.splitlines()) == 1
    assert not out.exists()
    assert main(["layout", str(model), "--kind", "random", "--shared", "0.01", "--shared-by", "random",
                 "--out", str(out)]) == 0
    assert Layout.load(out).shared == 2


def test_experiment_arms_take_shared(tmp_path, tiny_dirs, capsys):
    from dtpshard.model.dtp import DTPModel
    from test_experiment import config_text, corpus

    text = config_text(tiny_dirs["llama"], corpus(tmp_path / "corpus.txt"))
    text = text[:text.index("[[arms]]")] + "\n".join([
        "[[arms]]", 'kind = "optimised"', "seeds = [0]", "shared = 0.1",
        "[[arms]]", 'kind = "contiguous"', "seeds = []", "shared = 0.1", 'shared_by = "dn"',
        "[[arms]]", 'kind = "optimised"', "seeds = []"]) + "\n"
    (tmp_path / "study.toml").write_text(text)
    out = tmp_path / "exp"
    assert main(["experiment", str(tmp_path / "study.toml"), "--out", str(out)]) == 0
    layouts = {p.stem: Layout.load(p) for p in (out / "layouts").glob("*.json")}
    assert sorted(layouts) == ["contiguous-shared10", "optimised", "optimised-shared10"]
    assert (layouts["optimised-shared10"].shared, layouts["optimised-shared10"].shared_by) == (10, "fo")  # 96 -> 86
    assert (layouts["contiguous-shared10"].shared, layouts["contiguous-shared10"].shared_by) == (10, "dn")
    assert layouts["optimised"].shared == 0 and layouts["optimised-shared10"].kind == "optimised-shared10"
    student = DTPModel.from_pretrained(out / "runs" / "optimised-shared10-s0" / "final")
    assert student.shape.shared == 10
    bad = text.replace("shared = 0.1", "shared = 1.0", 1)
    (tmp_path / "bad.toml").write_text(bad)
    capsys.readouterr()
    assert main(["experiment", str(tmp_path / "bad.toml"), "--out", str(tmp_path / "exp2")]) == 2
    err = capsys.readouterr().err.strip()
    assert "shared" in err and len(err.splitlines()) == 1 and not (tmp_path / "exp2").exists()


def test_the_shared_study_file_reads_as_its_arms():
    from pathlib import Path

    from dtpshard.studies.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "dtpshard" / "configs" / "smollm2_shared.toml")
    arms = {(a.kind, a.layouts[0].shared): a.seeds for a in cfg.arms}
    assert arms == {(k, f): [0, 1, 2] for k, f in [("optimised", 0), ("optimised", 0.05), ("optimised", 0.1),
                                                     ("optimised", 0.2), ("contiguous", 0.1), ("contiguous", 0)]}
    assert [shared_count(1536, cfg.devices, f) for f in (0.05, 0.1, 0.2)] == [78, 156, 309]  # as its comment says
