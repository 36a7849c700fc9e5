"""Every configuration DTP cannot run is refused with one line naming the field and value."""
import json

import pytest
from safetensors.torch import load_file, save_file

from dtpshard.cli import main
from dtpshard.core.errors import UserError
from dtpshard.model.dtp import DTPModel
from tiny import save_tiny, tiny_config


def _config_dir(tmp_path, config):
    config.save_pretrained(str(tmp_path))
    return tmp_path


def _refusal(capsys, path, *flags):
    rc = main(["generate", str(path), "--prompt", "hi", *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("make,needle", [
    (lambda: __import__("transformers").GemmaConfig(), "model_type='gemma'"),
    (lambda: __import__("transformers").Gemma2Config(), "model_type='gemma2'"),  # post-norms
    (lambda: __import__("transformers").Qwen2MoeConfig(), "model_type='qwen2_moe'"),
    (lambda: __import__("transformers").Olmo2Config(), "model_type='olmo2'"),  # norms after the modules
    (lambda: tiny_config("granite", residual_multiplier=0.0), "residual_multiplier=0.0 must be"),
    (lambda: tiny_config("phi3", partial_rotary_factor=0.375), "partial_rotary_factor=0.375 rotates 3"),
    (lambda: tiny_config("qwen2", use_sliding_window=True, sliding_window=64), "sliding_window=64"),
    (lambda: tiny_config("llama", num_local_experts=4), "num_local_experts=4"),
    (lambda: tiny_config("llama", attention_bias=True), "attention_bias=True"),
    (lambda: tiny_config("llama", mlp_bias=True), "mlp_bias=True"),
    (lambda: tiny_config("llama", hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_refused_configs(tmp_path, capsys, make, needle):
    err = _refusal(capsys, _config_dir(tmp_path, make()))
    assert needle in err


@pytest.mark.parametrize("devices,needle", [
    (3, "devices=3 does not divide num_key_value_heads=4"),
    (0, "--devices 0: must be an integer >= 1"),  # refused while parsing
])
def test_devices_must_divide_kv_groups(tiny_dirs, capsys, devices, needle):
    assert needle in _refusal(capsys, tiny_dirs["llama"], "--devices", str(devices))


def test_devices_must_divide_neurons(tmp_path, capsys):
    path = save_tiny(tmp_path / "m", "llama", intermediate_size=98)
    assert "devices=4 does not divide intermediate_size=98" in _refusal(capsys, path, "--devices", "4")


def test_negative_delay(tiny_dirs, capsys):
    assert "--delay -1: must be a finite number >= 0" in _refusal(capsys, tiny_dirs["llama"], "--delay", "-1")


def test_fused_qkv_tensor_refused(tmp_path, tiny_dirs, capsys):
    src = tiny_dirs["llama"]
    dst = tmp_path / "fused"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(src / "model.safetensors"))
    a = "model.layers.0.self_attn."
    sd[a + "qkv_proj.weight"] = sd.pop(a + "q_proj.weight")
    save_file(sd, str(dst / "model.safetensors"))
    assert "'model.layers.0.self_attn.qkv_proj.weight'" in _refusal(capsys, dst)


def test_missing_files(tmp_path, tiny_dirs, capsys):
    assert "model directory not found" in _refusal(capsys, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    assert "no config.json" in _refusal(capsys, tmp_path / "empty")
    d = tmp_path / "noweights"
    d.mkdir()
    (d / "config.json").write_text((tiny_dirs["llama"] / "config.json").read_text())
    assert "no model.safetensors or model.safetensors.index.json" in _refusal(capsys, d)
    (d / "config.json").write_text("{not json")
    assert "config.json" in _refusal(capsys, d)


def test_python_api_raises_user_error(tiny_dirs):
    with pytest.raises(UserError, match="devices=3"):
        DTPModel.from_pretrained(tiny_dirs["qwen3"], devices=3)


def test_dtp_json_defaults(tmp_path, tiny_dirs):
    model = DTPModel.from_pretrained(tiny_dirs["qwen2"], devices=2, delay=1.5, stage3="one")
    model.save_pretrained(tmp_path / "student")
    again = DTPModel.from_pretrained(tmp_path / "student")
    assert again.dtp_settings() == {"devices": 2, "delay": 1.5, "stage3": "one"}
    assert json.loads((tmp_path / "student" / "config.json").read_text())["dtp"]["devices"] == 2
    assert (tmp_path / "student" / "tokenizer.json").is_file()
