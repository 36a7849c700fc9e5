"""The streamed affinity pass (one layer at a time, hidden states spilled to disk) equals the in-memory one.

Both passes run the same operations on the same values, so in float64 they agree to float64
rounding; the bound asserted is 1e-12 relative to each edge's largest score (observed: 0, bit
for bit).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dtpshard.affinity.file import Affinity, edges_for_delay
from dtpshard.affinity.offload import HiddenStates, plan
from dtpshard.affinity.scorer import ScoreOptions, compute_affinity
from dtpshard.cli import main
from dtpshard.core.memory import GIB
from dtpshard.model.checkpoint import open_checkpoint, read_shape
from dtpshard.model.dense import DenseModel, StreamedDense

OPTIONS = [ScoreOptions(), ScoreOptions(group_unit=True, rho="jacobian"), ScoreOptions(rho="ablation")]
KINDS = {(0, 1): "up", (1, 2): "down", (0, 2): "attention->attention", (1, 3): "FFN->FFN", (0, 3): "attention->FFN δ=3"}


def assert_same(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for e, S in ref.items():
        np.testing.assert_allclose(got[e], S, rtol=0, atol=1e-12 * S.max(), err_msg=str(e))


@pytest.mark.parametrize("family", ["llama_tied", "qwen2", "qwen3", "mistral"])
def test_streamed_pass_equals_in_memory(tiny_dirs, tmp_path, family):
    """δ = 3 over 3 layers has every edge kind; the last micro-batch is partial (3 blocks of 2)."""
    ckpt = open_checkpoint(tiny_dirs[family])
    ids = torch.randint(0, ckpt.shape.vocab, (3, 9), generator=torch.Generator().manual_seed(1))
    dense = DenseModel.from_checkpoint(ckpt, dtype=torch.float64)
    streamed = StreamedDense(ckpt, dtype=torch.float64)
    assert torch.equal(streamed.forward(ids), dense.forward(ids))
    for opts in OPTIONS:
        ref = compute_affinity(dense, ids, delay=3, opts=opts, micro_batch=2)
        assert set(KINDS) <= set(ref) and sorted(ref) == sorted(edges_for_delay(6, 3))
        assert_same(compute_affinity(streamed, ids, delay=3, opts=opts, micro_batch=2), ref)
        spill = HiddenStates(budget=0, spill_dir=tmp_path)
        assert_same(compute_affinity(streamed, ids, delay=3, opts=opts, micro_batch=2, hidden=spill), ref)
        assert spill.spilled > 0 and spill.in_memory == 0
        assert not list(tmp_path.iterdir())  # anonymous files, nothing left behind


def test_streamed_pass_reads_each_layer_once_and_no_head(tiny_dirs):
    ckpt = open_checkpoint(tiny_dirs["llama"])
    reads: list[tuple[str, slice | None]] = []
    get = ckpt.files.get
    ckpt.files.get = lambda name, rows=None: reads.append((name, rows)) or get(name, rows)
    ids = torch.randint(0, ckpt.shape.vocab, (2, 7), generator=torch.Generator().manual_seed(2))
    compute_affinity(StreamedDense(ckpt, dtype=torch.float64), ids, delay=2, micro_batch=1)
    names = [n for n, _ in reads]
    layer_names = [n for n in names if n.startswith("model.layers.")]
    in_layers = [k for k in ckpt.files.keys() if k.startswith("model.layers.")]
    assert len(layer_names) == len(set(layer_names)) == len(in_layers)
    assert "lm_head.weight" not in names and "model.norm.weight" not in names
    assert all(rows is not None for n, rows in reads if n == "model.embed_tokens.weight")
    # layers are read in order: layer i+1 only after everything of layer i
    order = [int(n.split(".")[2]) for n in layer_names]
    assert order == sorted(order)


def test_plan_streams_what_does_not_fit(tiny_dirs):
    shape = read_shape(tiny_dirs["llama"])
    roomy = plan(shape, tokens=64, delay=1, dtype=torch.float32, budget=GIB)
    assert not roomy.offload and roomy.hidden <= roomy.hidden_budget
    tight = plan(shape, tokens=64, delay=1, dtype=torch.float32, budget=roomy.weights)
    assert tight.offload and tight.window < tight.weights and tight.hidden <= tight.hidden_budget
    assert "one layer at a time" in tight.describe() and "in memory" in tight.describe()
    none = plan(shape, tokens=64, delay=1, dtype=torch.float32, budget=0)
    assert none.offload and none.hidden_budget == 0 and "spilled to disk" in none.describe()
    forced = plan(shape, tokens=64, delay=1, dtype=torch.float32, budget=0, offload=False)
    assert not forced.offload and forced.hidden_budget == 0


def test_command_offload_and_spill_write_the_same_file(tiny_dirs, tmp_path, capsys):
    model = tiny_dirs["qwen3"]
    base = ["affinity", str(model), "--blocks", "3", "--seq-len", "8", "--delay", "2", "--no-progress",
            "--micro-batch", "2", "--dtype", "float64"]
    runs = {"memory": ["--no-offload"], "offload": ["--offload"],
            "auto": ["--memory-budget", "1e-9", "--spill-dir", str(tmp_path / "spill")]}
    files, logs = {}, {}
    for name, extra in runs.items():
        files[name] = tmp_path / f"{name}.safetensors"
        assert main(base + ["--out", str(files[name])] + extra) == 0
        logs[name] = capsys.readouterr().err
    assert "whole model in memory" in logs["memory"] and "hidden states in memory" in logs["memory"]
    assert "one layer at a time" in logs["offload"]
    assert "one layer at a time" in logs["auto"] and "spilled to disk" in logs["auto"]
    assert not list((tmp_path / "spill").iterdir())
    ref = Affinity.load(files["memory"])
    for name in ("offload", "auto"):
        got = Affinity.load(files[name])
        assert got.options == ref.options and got.tokens == ref.tokens
        for e, S in ref.edges.items():
            np.testing.assert_array_equal(got.edges[e], S, err_msg=f"{name} {e}")


def test_command_bad_budget_or_spill_dir_give_one_line(tiny_dirs, tmp_path, capsys):
    base = ["affinity", str(tiny_dirs["llama"]), "--out", str(tmp_path / "a.safetensors"), "--no-progress",
            "--blocks", "2", "--seq-len", "8"]
    blocker = tmp_path / "file"
    blocker.write_text("")
    for extra, needle in ((["--memory-budget", "-1"], "--memory-budget -1: must be a finite number >= 0"),
                          (["--memory-budget", "1e-9", "--spill-dir", str(blocker)], "is a file")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "a.safetensors").exists()
