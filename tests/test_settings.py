"""One resolver for a run's DTP settings (core/settings.py): flags, then the student's record, then
the layout, then the defaults; every command that takes those flags uses it."""
from __future__ import annotations

import json

import pytest

from dtpshard.cli import main
from dtpshard.core.errors import UserError
from dtpshard.core.layout import Layout
from dtpshard.core.settings import DEFAULT, resolve_dtp
from dtpshard.core.shape import UnitShape
from dtpshard.model.checkpoint import read_shape
from dtpshard.model.dtp import DTPModel

SHAPE = UnitShape(layers=3, kv_groups=4, heads_per_group=2, neurons=96)


def test_precedence_flags_record_layout_defaults():
    layout = Layout.random(SHAPE, devices=2, delay=2, seed=0)
    record = {"devices": 2, "delay": 1.5, "stage3": "one"}
    assert resolve_dtp(SHAPE) == DEFAULT
    assert resolve_dtp(SHAPE, layout=layout).delay == 2 and resolve_dtp(SHAPE, layout=layout).devices == 2
    assert resolve_dtp(SHAPE, layout=layout, record=record).delay == 1.5
    assert resolve_dtp(SHAPE, layout=layout, record=record).stage3 == "one"
    assert resolve_dtp(SHAPE, delay=0, layout=layout, record=record).delay == 0
    assert resolve_dtp(SHAPE, delay=2.0).delay == 2 and isinstance(resolve_dtp(SHAPE, delay=2.0).delay, int)
    with pytest.raises(UserError, match="made for devices=2, the model runs devices=4"):
        resolve_dtp(SHAPE, devices=4, layout=layout)
    with pytest.raises(UserError, match="stage3='half': must be one of sqrt, one"):
        resolve_dtp(SHAPE, stage3="half")
    with pytest.raises(UserError, match="does not divide"):
        resolve_dtp(SHAPE, devices=3)


@pytest.fixture(scope="module")
def delay2(tiny_dirs, tmp_path_factory):
    model = tiny_dirs["qwen2"]
    path = tmp_path_factory.mktemp("settings") / "d2.json"
    Layout.random(read_shape(model), devices=2, delay=2, seed=1).save(path)
    return model, path


def _json_out(capfd, argv: list[str]) -> dict:
    assert main(argv) == 0, capfd.readouterr().err
    return json.loads(capfd.readouterr().out.strip().splitlines()[-1])


def test_every_command_takes_delay_from_a_delay_2_layout(delay2, tmp_path, capfd):
    model, layout = str(delay2[0]), str(delay2[1])
    assert DTPModel.from_pretrained(model, layout=layout).dtp_settings() == {"devices": 2, "delay": 2,
                                                                           "stage3": "sqrt"}
    got = _json_out(capfd, ["generate", model, "--layout", layout, "--prompt", "import torch",
                             "--max-new-tokens", "2", "--device", "cpu", "--json"])
    assert (got["devices"], got["delay"]) == (2, 2)
    got = _json_out(capfd, ["eval", model, "--layout", layout, "--teacher", model, "--blocks", "1", "--seq-len", "8",
                             "--device", "cpu", "--json"])
    assert (got["devices"], got["delay"]) == (2, 2)
    got = _json_out(capfd, ["run", model, "--layout", layout, "--prompt", "import torch", "--nproc", "2",
                             "--max-new-tokens", "2", "--json"])
    assert (got["devices"], got["delay"]) == (2, 2)
    run = tmp_path / "run"
    got = _json_out(capfd, ["distill", model, "--layout", layout, "--out", str(run), "--steps", "1", "--seq-len", "8",
                             "--micro-batch", "1", "--grad-accum", "1", "--eval-blocks", "1", "--no-progress",
                             "--device", "cpu", "--json"])
    config = json.loads((run / "config.json").read_text())
    assert (config["devices"], config["delay"]) == (2, 2)
    student = json.loads((run / "final" / "config.json").read_text())["dtp"]
    assert (student["devices"], student["delay"]) == (2, 2)
    # the student runs at its own settings by default; a flag still wins
    got = _json_out(capfd, ["eval", str(run / "final"), "--teacher", model, "--blocks", "1", "--seq-len", "8",
                             "--device", "cpu", "--json"])
    assert (got["devices"], got["delay"]) == (2, 2)
    got = _json_out(capfd, ["eval", str(run / "final"), "--delay", "1", "--blocks", "1", "--seq-len", "8",
                             "--device", "cpu", "--json"])
    assert got["delay"] == 1


def test_layout_sha256_is_the_layouts_content_hash_everywhere(delay2, tmp_path, capfd):
    model, layout = str(delay2[0]), delay2[1]
    run = tmp_path / "run"
    assert main(["distill", model, "--layout", str(layout), "--out", str(run), "--steps", "1", "--seq-len", "8",
                 "--micro-batch", "1", "--grad-accum", "1", "--eval-blocks", "1", "--no-progress",
                 "--device", "cpu"]) == 0
    want = Layout.load(layout).content_sha256()
    assert json.loads((run / "config.json").read_text())["layout_sha256"] == want
    assert json.loads((run / "final" / "distill.json").read_text())["layout_sha256"] == want
    assert json.loads((run / "final" / "config.json").read_text())["dtp"]["layout_sha256"] == want
    # the same layout saved again (other bytes: indented) keeps its hash
    again = tmp_path / "again.json"
    again.write_text(json.dumps(json.loads(layout.read_text()), indent=2))
    assert Layout.load(again).content_sha256() == want
