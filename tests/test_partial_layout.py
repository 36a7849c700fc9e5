"""`dtpshard layout --delayed`: the set is chosen under the layout and recorded in its file, the
least sensitive modules by measurement, and the flags that cannot apply are refused in one line
before anything is written."""
import json

import pytest
import torch

from dtpshard.cli import main
from dtpshard.core.layout import Layout
from dtpshard.core.settings import DEFAULT, DTPSettings
from dtpshard.layouts.delayed import measure_for_layout, sensitivity_ids
from tiny import save_tiny

TEXT = ["The quick brown fox jumps over the lazy dog. " * 40]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial-layout")
    (root / "calib.txt").write_text(TEXT[0])
    return save_tiny(root / "dense", "llama", seed=3), root / "calib.txt"


def _layout(model, out, *flags):
    return main(["layout", str(model), "--kind", "contiguous", "--devices", "2", "--out", str(out), *flags])


def test_sensitivity_delays_the_least_sensitive_modules(dense, tmp_path):
    model, text = dense
    out = tmp_path / "half.json"
    assert _layout(model, out, "--delayed", "0.5", "--text", str(text), "--blocks", "2", "--seq-len", "16") == 0
    layout = Layout.load(out)
    kl = layout.score["delayed"]["sensitivity"]["kl"]
    M = layout.model.modules
    assert len(kl) == M and len(layout.delayed) == M // 2
    assert sorted(layout.delayed) == sorted(sorted(range(M), key=lambda m: kl[m])[:M // 2])
    # the recorded measurement is the one the library makes under this layout's permutation
    ids = sensitivity_ids(model, [str(text)], blocks=2, seq_len=16)
    again = measure_for_layout(model, Layout.load(out), DTPSettings(2, 1, DEFAULT.stage3), ids)
    assert torch.allclose(torch.tensor(again["kl"]), torch.tensor(kl), rtol=1e-5, atol=1e-9)
    assert json.loads(out.read_text())["delayed"] == list(layout.delayed)


def test_upper_and_listed_sets_need_no_model(dense, tmp_path):
    model, _ = dense
    assert _layout(model, tmp_path / "u.json", "--delayed", "0.5", "--delayed-by", "upper") == 0
    M = Layout.load(tmp_path / "u.json").model.modules
    assert Layout.load(tmp_path / "u.json").delayed == tuple(range(M - M // 2, M))
    assert _layout(model, tmp_path / "l.json", "--delayed", "1-3") == 0
    assert Layout.load(tmp_path / "l.json").delayed == (1, 2, 3)


@pytest.mark.parametrize("flags, says", [
    (["--model", "{model}"], "--model is read only to measure sensitivity"),
    (["--delayed", "1-3", "--model", "{model}"], "--model is read only to measure sensitivity"),
    (["--delayed", "0.5", "--delayed-by", "upper", "--model", "{model}"], "--model is read only"),
    (["--delayed", "0.0", "--delayed-by", "upper"], "must be in (0, 1]"),
    (["--delayed", "3-1"], "--delayed"),
    (["--delayed", "0-99"], "outside"),
    (["--delayed", "10-20", "--delayed-by", "upper"], "--delayed-by upper: it chooses a share's modules"),
    (["--delayed-by", "random"], "--delayed-by random: it chooses a share's modules"),
])
def test_flags_that_cannot_apply_are_refused_in_one_line(dense, tmp_path, capsys, flags, says):
    model, _ = dense
    out = tmp_path / "refused.json"
    assert _layout(model, out, *[f.format(model=model) for f in flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not out.exists()
