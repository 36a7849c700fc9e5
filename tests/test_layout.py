"""The layout file (docs/design.md §3): JSON round trip, device queries, and one precise line for
every malformed file."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from dtpshard.core.errors import UserError
from dtpshard.core.layout import FORMAT, Layout, as_layout
from dtpshard.core.shape import UnitShape

MODEL = UnitShape(3, 4, 2, 12)


def good(**edits) -> dict:
    obj = Layout.random(MODEL, devices=2, delay=1.5, seed=3).to_json()
    obj.update(edits)
    return obj


def load_error(tmp_path, obj_or_text) -> str:
    path = tmp_path / "bad.json"
    path.write_text(obj_or_text if isinstance(obj_or_text, str) else json.dumps(obj_or_text))
    with pytest.raises(UserError) as e:
        Layout.load(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg  # one line, naming the file
    return msg


def test_json_round_trip(tmp_path):
    lay = Layout.random(MODEL, devices=2, delay=1.5, seed=7)
    lay.score = {"J": 1.25, "n_edges": 5}
    path = tmp_path / "l.json"
    lay.save(path)
    back = Layout.load(path)
    assert back.to_json() == lay.to_json() == json.loads(path.read_text())
    assert (back.devices, back.delay, back.kind, back.seed, back.model, back.score) == (
        2, 1.5, "random", 7, MODEL, {"J": 1.25, "n_edges": 5})
    for a, b in zip(back.kv_perms + back.ffn_perms, lay.kv_perms + lay.ffn_perms):
        assert np.array_equal(a, b)
    assert not back.is_identity()
    assert json.loads(path.read_text())["format"] == FORMAT
    assert as_layout(path).to_json() == lay.to_json() and as_layout(lay) is lay and as_layout(None) is None
    assert not list(tmp_path.glob(".*"))  # the atomic write left no temporary file


def test_random_is_seeded_and_contiguous_is_identity():
    a, b, c = (Layout.random(MODEL, 2, seed=s).to_json() for s in (1, 1, 2))
    assert a == b and a["layers"] != c["layers"]
    assert Layout.contiguous(MODEL, 2).is_identity()
    for perm in Layout.random(MODEL, 4, seed=0).kv_perms:
        assert sorted(perm.tolist()) == list(range(4))


def test_devices_of_units():
    lay = Layout.contiguous(MODEL, devices=4)
    lay.kv_perms[0] = np.array([2, 0, 3, 1])  # position p holds original group perm[p]
    assert lay.kv_device(0).tolist() == [1, 3, 0, 2]  # group 2 sits at position 0 -> device 0
    assert lay.ffn_device(1).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_check_model_refuses_another_shape():
    lay = Layout.contiguous(MODEL, 2)
    lay.check_model(MODEL)
    for key, value in (("layers", 4), ("kv_groups", 2), ("heads_per_group", 4), ("neurons", 16)):
        with pytest.raises(UserError, match=f"{key}={getattr(MODEL, key)} but the model has {key}={value}"):
            lay.check_model(replace(MODEL, **{key: value}))


def perm_edit(obj, layer, key, values):
    obj["layers"][layer][key] = values
    return obj


BAD = {
    "duplicate index": (lambda: perm_edit(good(), 1, "kv_perm", [0, 1, 1, 3]),
                        "layer 1 kv_perm: index 1 appears 2 times and 2 is missing"),
    "missing index (out of range)": (lambda: perm_edit(good(), 2, "ffn_perm", list(range(1, 13))),
                                     "layer 2 ffn_perm: index 12 out of range 0..11"),
    "negative index": (lambda: perm_edit(good(), 0, "kv_perm", [0, 1, 2, -1]),
                       "layer 0 kv_perm: index -1 out of range 0..3"),
    "wrong length": (lambda: perm_edit(good(), 0, "ffn_perm", list(range(11))),
                     "layer 0 ffn_perm: length 11, expected 12"),
    "not integers": (lambda: perm_edit(good(), 0, "kv_perm", [0, 1, 2, 3.0]),
                     "layer 0 kv_perm: must be a list of integers"),
    "missing perm": (lambda: {**good(), "layers": [{"kv_perm": [0, 1, 2, 3]}] * 3},
                     "layer 0 ffn_perm: must be a list of integers"),
    "too few layers": (lambda: {**good(), "layers": good()["layers"][:2]}, "2 layers listed, model has 3"),
    "too many layers": (lambda: {**good(), "layers": good()["layers"] * 2}, "6 layers listed, model has 3"),
    "L does not divide G": (lambda: good(devices=3), "devices=3 does not divide kv_groups=4"),
    "L does not divide N": (lambda: {**good(devices=4), "model": {**MODEL.to_json(), "neurons": 10}},
                            "devices=4 does not divide neurons=10"),
    "unknown format": (lambda: good(format="dtpshard.layout/2"),
                       "format='dtpshard.layout/2', expected 'dtpshard.layout/1'"),
    "no format": (lambda: {k: v for k, v in good().items() if k != "format"}, "format=None"),
    "missing devices": (lambda: {k: v for k, v in good().items() if k != "devices"}, "missing field 'devices'"),
    "devices zero": (lambda: good(devices=0), "devices=0 must be a positive integer"),
    "devices bool": (lambda: good(devices=True), "devices=True must be a positive integer"),
    "negative delay": (lambda: good(delay=-1), "delay=-1 must be a number >= 0"),
    "model not integers": (lambda: good(model={**MODEL.to_json(), "neurons": "12"}),
                           "model must give positive integer"),
    "model zero": (lambda: good(model={**MODEL.to_json(), "kv_groups": 0}), "model must give positive integer"),
    "layer not an object": (lambda: good(layers=[[0, 1, 2, 3]] * 3), "layer 0 is not an object"),
    "score not an object": (lambda: good(score=[1, 2]), "score must be an object"),
    "not an object": (lambda: [1, 2, 3], "not a JSON object"),
    "bad JSON": (lambda: '{"format": "dtpshard.layout/1", "devices": 2,', "not valid JSON"),
    "NaN delay": (lambda: json.dumps(good()).replace('"delay": 1.5', '"delay": NaN'), "delay=nan"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_every_malformed_file_is_one_precise_line(tmp_path, case):
    make, expected = BAD[case]
    assert expected in load_error(tmp_path, make())


def test_unreadable_files(tmp_path):
    with pytest.raises(UserError, match="layout file not found"):
        Layout.load(tmp_path / "nope.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(UserError, match="not a text"):
        Layout.load(tmp_path / "bin.json")
    with pytest.raises(UserError, match="is a directory, not a regular file"):
        Layout.load(tmp_path)


def test_constructors_refuse_bad_devices():
    with pytest.raises(UserError, match="devices=5 does not divide kv_groups=4"):
        Layout.random(MODEL, 5)
    with pytest.raises(UserError, match="devices=0 must be at least 1"):
        Layout.contiguous(MODEL, 0)


def test_a_recorded_layout_hash_is_checked_under_either_key(tmp_path):
    from dtpshard.core.layout import HASH_KEY

    layout = Layout.random(UnitShape(layers=2, kv_groups=4, heads_per_group=2, neurons=16), devices=2, seed=1)
    for key in (HASH_KEY, "sha256"):  # "sha256": files that recorded it under the older key
        obj = {**layout.to_json(), key: layout.content_sha256()}
        assert Layout.from_json(obj).content_sha256() == layout.content_sha256()
        with pytest.raises(UserError, match="the file was edited"):
            Layout.from_json({**obj, key: "0" * 16})
