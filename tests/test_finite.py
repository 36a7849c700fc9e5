"""Issue 46, class "reported success on something wrong": no tokens from NaN logits. `generate` and
`run` refuse non-finite logits in one line naming the config field most likely at fault, and
multipliers and scalings far outside any model's are refused with the other config numbers."""
import json
import math
import shutil

import pytest
import torch

from dtpshard.cli import main
from dtpshard.core.errors import UserError
from dtpshard.model.finite import check_logits, likeliest_cause


def edited(src, dst, **values):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(values)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def one_line(capsys, *words):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and all(w in err[0] for w in words), (words, err)


GENERATE = ["--devices", "2", "--delay", "1", "--prompt", "hello world", "--max-new-tokens", "4", "--device", "cpu"]


@pytest.mark.parametrize("key, value", [("embedding_multiplier", 1e300), ("residual_multiplier", 1e-300),
                                        ("attention_multiplier", -1.0), ("logits_scaling", 1e9)])
def test_a_multiplier_far_out_of_range_is_refused(tiny_dirs, tmp_path, capsys, key, value):
    """The sweep's case: a Granite embedding_multiplier of 1e300 generated tokens [0, 0, 0, 0]."""
    model = edited(tiny_dirs["granite"], tmp_path / "g", **{key: value})
    assert main(["generate", str(model), *GENERATE]) == 2
    one_line(capsys, key, "must be a number in")


def overflowing(tiny_dirs, dst):
    """A Granite checkpoint whose numbers are all finite and within range, but whose embedding
    (weights about 1e33, multiplier 1e6) overflows float32 in the forward: NaN logits."""
    from safetensors.torch import load_file, save_file

    model = edited(tiny_dirs["granite"], dst, embedding_multiplier=1e6)
    weights = model / "model.safetensors"
    sd = load_file(str(weights))
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] * 1e34
    save_file(sd, str(weights), metadata={"format": "pt"})
    return model


def test_generate_refuses_nan_logits_naming_the_field(tiny_dirs, tmp_path, capsys):
    model = overflowing(tiny_dirs, tmp_path / "g")
    assert main(["generate", str(model), *GENERATE, "--json"]) == 2
    one_line(capsys, "logits are", "embedding_multiplier=1000000.0", "no tokens reported")
    assert capsys.readouterr().out == ""


def test_run_refuses_nan_logits_naming_the_field(tiny_dirs, tmp_path, capsys):
    model = overflowing(tiny_dirs, tmp_path / "g")
    assert main(["run", str(model), "--nproc", "2", "--delay", "1", "--prompt", "hello world", "--max-new-tokens",
                 "2", "--timeout", "60"]) == 2
    err = capsys.readouterr().err
    assert "logits are" in err and "embedding_multiplier" in err and "Traceback" not in err, err


def test_the_likeliest_cause_is_the_field_farthest_from_usual():
    granite = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
               "logits_scaling": 8.0, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    assert likeliest_cause(granite).startswith("the weights")  # a real Granite's numbers: none unusual
    assert "rope_theta" in likeliest_cause({**granite, "rope_theta": 1e30})
    assert "rms_norm_eps" in likeliest_cause({**granite, "rms_norm_eps": 0.0})
    check_logits(torch.zeros(2, 5), granite)
    with pytest.raises(UserError, match=r"logits are infinite .*residual_multiplier"):
        check_logits(torch.tensor([[0.0, math.inf]]), {**granite, "residual_multiplier": 1e5})
