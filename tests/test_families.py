"""Every family is one definition (dtpshard/core/family.py), checked against transformers' own
models: the tensors a checkpoint holds, the dense model calibration runs, and the pipeline's first
stages (affinity, layout) on each. Phi-3 stores qkv_proj and gate_up_proj fused and has a sliding
window; Granite has four multipliers. The other stages are covered family by family elsewhere:
the DTP forward (test_model.py), permute (test_permute.py), distill and the remote-code student
(test_remote.py), the runtime (test_runtime.py), vLLM (test_vllm.py)."""
from __future__ import annotations

import json

import pytest
import torch

from dtpshard.cli import main
from dtpshard.core.family import FAMILY, join_fused, split_fused, stored_shapes
from dtpshard.core.shape import shape_from_hf_config
from dtpshard.model.checkpoint import open_checkpoint
from dtpshard.model.dense import DenseModel, StreamedDense
from tiny import FAMILIES, tiny_hf_model

NEW = ("phi3", "granite")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_spec_names_what_transformers_holds(family):
    """stored_shapes is transformers' own state dict, name for name and shape for shape; the
    canonical form round-trips to it bit for bit."""
    hf = tiny_hf_model(family)
    shape = shape_from_hf_config(hf.config)
    sd = {k: v for k, v in hf.state_dict().items() if not (shape.tied and k == "lm_head.weight")}
    assert {k: list(v.shape) for k, v in sd.items()} == stored_shapes(shape)
    canonical = split_fused(sd, shape)
    assert set(canonical) == set(stored_shapes(shape, fused=False))
    back = join_fused(canonical, shape)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    assert FAMILY[shape.family].fused or canonical.keys() == sd.keys()


@pytest.mark.parametrize("family", NEW)
def test_dense_model_matches_transformers(tiny_dirs, family):
    """Calibration's dense model, whole and streamed a layer at a time, computes transformers' logits."""
    hf = tiny_hf_model(family)
    ckpt = open_checkpoint(tiny_dirs[family])
    ids = torch.randint(0, 384, (2, 19), generator=torch.Generator().manual_seed(1))  # past Phi-3's window
    with torch.no_grad():
        ref = hf(ids).logits
        for dense in (DenseModel.from_checkpoint(ckpt), StreamedDense(ckpt)):
            assert (dense.forward(ids) - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", NEW)
def test_affinity_and_optimised_layout(tiny_dirs, tmp_path, capsys, family):
    model = tiny_dirs[family]
    aff = tmp_path / "a.safetensors"
    assert main(["affinity", str(model), "--out", str(aff), "--blocks", "2", "--seq-len", "16", "--no-progress",
                 "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["layout", str(aff), "--devices", "2", "--delay", "1", "--kind", "optimised", "--out",
                 str(tmp_path / "l.json"), "--json"]) == 0
    score = json.loads(capsys.readouterr().out)["score"]
    assert score["J"] > score["random_expectation"] and score["history"][-1] > score["history"][0]
