"""vLLM serves a shared student (docs/design.md §6) at tensor-parallel size L: every rank holds the
shared neurons whole and adds their output at once; its greedy tokens are `dtpshard generate`'s
and its top logprobs DTPModel's to 1e-4 in fp32, eagerly and compiled. Skipped where vLLM's
environment is not built, as tests/test_vllm.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dtpshard.core.layout import Layout
from dtpshard.model.checkpoint import open_checkpoint
from dtpshard.model.dtp import DTPModel
from test_vllm import NEW, prompts, pytestmark, reference, run_driver  # noqa: F401 - pytestmark: the same skips
from tiny import save_tiny

CASES = [("llama", 2, 1, "eager"), ("qwen3", 2, 1.5, "compiled")]


def shared_student(root, case):
    family, devices, delay, _ = case
    teacher = save_tiny(root / f"teacher-{family}", family, head_dim=32, intermediate_size=98)
    shape = open_checkpoint(teacher).shape
    rng = np.random.default_rng(3)
    sets = [np.sort(rng.choice(shape.neurons, 10, replace=False)) for _ in range(shape.layers)]  # 88 = 2 x 44
    layout = Layout.random(shape, devices, delay, seed=1, shared=sets, shared_by="random")
    out = root / f"{family}-{devices}-{delay}"
    out.mkdir()
    DTPModel.from_pretrained(teacher, devices, delay, layout=layout).save_pretrained(out, source=teacher)
    assert json.loads((out / "config.json").read_text())["dtp"]["shared"] == 10
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_vllm_serves_a_shared_student_with_dtpshards_tokens(tmp_path, case):
    """reference(): DTPModel.generate one prompt at a time, what `dtpshard generate` runs."""
    student = shared_student(tmp_path, case)
    batch = prompts()
    compiled = case[3] == "compiled"
    spec = {"model": str(student), "tp": case[1], "dtype": "float32", "prompts": batch, "max_tokens": NEW,
            "logprobs": 5, "enforce_eager": not compiled, "inductor_code": False}
    (result,) = run_driver([spec], tmp_path, "shared", case[1])
    assert "error" not in result, result.get("error")
    tokens, logprobs = reference(student, batch)
    assert result["tokens"] == tokens
    for p, lp, tops in zip(batch, logprobs, result["logprobs"]):
        for t, top in enumerate(tops):
            for token, value in top.items():
                assert abs(lp[len(p) - 1 + t, int(token)].item() - value) < 1e-4
