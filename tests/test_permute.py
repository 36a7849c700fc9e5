"""Applying a layout (docs/design.md §3): the dense function is unchanged (against transformers' own
model), the DTP function at δ ≥ 1 is not, and `dtpshard permute` writes a checked checkpoint or
nothing at all."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dtpshard.cli import main
from dtpshard.core.errors import UserError
from dtpshard.core.layout import Layout
from dtpshard.core.permutation import apply_layout, permutation_spec, stored_indices
from dtpshard.core.shape import shape_from_hf_config
from dtpshard.layouts.permute import LAYOUT_JSON
from dtpshard.model.dtp import DTPModel
from reference import literal_dtp_logits
from tiny import FAMILIES, tiny_hf_model

TOL = 1e-4


def ids_for(vocab, B=2, T=16, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def no_identity_layout(shape, devices=4, seed=1) -> Layout:
    """A random layout in which no layer keeps its groups or its neurons in place."""
    lay = Layout.random(shape, devices, delay=1, seed=seed)
    lay.kv_perms = [np.roll(p, 1) if (p == np.arange(len(p))).all() else p for p in lay.kv_perms]  # p = 1/24
    assert not any((p == np.arange(len(p))).all() for p in lay.kv_perms + lay.ffn_perms)
    return lay


def hf_with(hf, state_dict):
    from transformers import AutoModelForCausalLM

    new = AutoModelForCausalLM.from_config(hf.config, attn_implementation="eager")
    new.load_state_dict(state_dict, strict=True)
    return new.eval()


@pytest.fixture(scope="module", params=FAMILIES)
def hf(request):
    return tiny_hf_model(request.param, seed=11)


# -- the dense function is unchanged; the DTP function only at δ = 0 --------------------------
@torch.no_grad()
def test_dense_logits_unchanged_and_every_spec_entry_matters(hf):
    shape = shape_from_hf_config(hf.config)
    lay = no_identity_layout(shape)
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    out = apply_layout(sd, shape, lay)
    spec = permutation_spec(shape)
    moved = stored_indices(shape, lay)  # as the family stores them (Phi-3: fused tensors whole)
    for name in moved:
        assert not torch.equal(out[name], sd[name]), name
    for name in sd.keys() - moved.keys():  # norms, embeddings, head: untouched
        assert out[name] is sd[name], name
    ids = ids_for(shape.vocab)
    ref = hf(ids).logits
    other = hf_with(hf, out)
    assert (other(ids).logits - ref).abs().max().item() <= TOL
    if shape.family != "qwen2":  # the one family with every kind of entry (q/k/v biases too)
        return
    # Leaving any one kind of tensor unpermuted breaks the function: no entry of permutation_spec is idle.
    for suffix in sorted({n.split(".", 3)[3] for n in spec}):
        other.load_state_dict({k: (sd[k] if k.endswith(suffix) else v) for k, v in out.items()})
        assert (other(ids).logits - ref).abs().max().item() > 10 * TOL, suffix


@torch.no_grad()
def test_delay_zero_dtp_is_unchanged_under_any_layout(hf):
    shape = shape_from_hf_config(hf.config)
    ids = ids_for(shape.vocab, B=1, T=12)
    dense = hf(ids).logits
    for devices in (2, 4):
        plain = DTPModel.from_hf(hf, devices=devices, delay=0)(ids).logits
        for lay in (no_identity_layout(shape, devices, seed=devices), Layout.random(shape, devices, seed=9)):
            out = DTPModel.from_hf(hf, devices=devices, delay=0, layout=lay)(ids).logits
            assert (out - plain).abs().max().item() <= TOL
            assert (out - dense).abs().max().item() <= TOL


@torch.no_grad()
def test_delay_one_random_layout_changes_logits_as_the_spec_says(hf):
    shape = shape_from_hf_config(hf.config)
    lay = no_identity_layout(shape, seed=5)
    ids = ids_for(shape.vocab, B=1, T=7)
    contiguous = DTPModel.from_hf(hf, devices=4, delay=1)(ids).logits
    out = DTPModel.from_hf(hf, devices=4, delay=1, layout=lay)(ids).logits
    assert (out - contiguous).abs().max().item() > 1e-2
    # ...and it is the DTP function of the permuted dense model, by the letter of docs/design.md §1.
    permuted = hf_with(hf, apply_layout(dict(hf.state_dict()), shape, lay))
    assert (out - literal_dtp_logits(permuted, ids, 4, 1)).abs().max().item() <= TOL


def test_contiguous_layout_is_a_no_op(hf):
    shape = shape_from_hf_config(hf.config)
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    out = apply_layout(sd, shape, Layout.contiguous(shape, 4))
    assert out.keys() == sd.keys()
    for k in sd:
        assert torch.equal(out[k], sd[k]), k


# -- `dtpshard permute`: round trip ---------------------------------------------------------
@pytest.fixture(scope="module")
def permuted(tiny_dirs, tmp_path_factory):
    """family -> (source dir, layout file, permuted dir, printed output), one CLI run each."""
    root = tmp_path_factory.mktemp("permuted")
    done = {}

    def get(family):
        if family not in done:
            src = tiny_dirs[family]
            lay = no_identity_layout(shape_from_hf_config(tiny_hf_model(family).config), seed=3)
            lay.score = {"J": 0.5}
            lay.save(root / f"{family}.json")
            out, printed = root / f"{family}-out", io.StringIO()
            with contextlib.redirect_stdout(printed):
                rc = main(["permute", str(src), str(root / f"{family}.json"), "--out", str(out)])
            assert rc == 0
            done[family] = (src, root / f"{family}.json", out, printed.getvalue())
        return done[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_permute_round_trip_with_transformers(permuted, family):
    from transformers import AutoModelForCausalLM

    from dtpshard.model.checkpoint import load_tokenizer

    src, layout_file, out, printed = permuted(family)
    assert re.search(r"check: all \d+ tensors of 1 weight file\(s\) read back equal, bit for bit", printed), printed
    assert str(out) in printed
    load = dict(dtype=torch.float32, attn_implementation="eager", local_files_only=True)
    original = AutoModelForCausalLM.from_pretrained(str(src), **load).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), **load).eval()
    shape = shape_from_hf_config(original.config)
    expected = apply_layout(dict(original.state_dict()), shape, Layout.load(layout_file))
    got = reloaded.state_dict()
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    ids = ids_for(shape.vocab, B=2, T=20, seed=4)
    with torch.no_grad():
        assert (reloaded(ids).logits - original(ids).logits).abs().max().item() <= TOL
    assert json.loads((out / LAYOUT_JSON).read_text()) == json.loads(layout_file.read_text())
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert load_tokenizer(out)("hello world")["input_ids"] == load_tokenizer(src)("hello world")["input_ids"]
    assert not [p for p in out.parent.iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize("family", ["qwen2", "llama_tied"])
def test_in_memory_layout_equals_permuted_checkpoint_exactly(permuted, family):
    src, layout_file, out, _ = permuted(family)
    ids = ids_for(384, B=1, T=10)
    ref_model = DTPModel.from_pretrained(out, devices=4, delay=1)
    ref = ref_model(ids).logits
    for layout in (layout_file, Layout.load(layout_file)):
        model = DTPModel.from_pretrained(src, devices=4, delay=1, layout=layout)
        for k, v in ref_model.state_dict().items():
            assert torch.equal(model.state_dict()[k], v), k
        assert torch.equal(model(ids).logits, ref)
    assert (ref - DTPModel.from_pretrained(src, devices=4, delay=1)(ids).logits).abs().max().item() > 1e-2
    with pytest.raises(UserError, match="devices=4"):
        DTPModel.from_pretrained(src, devices=2, delay=1, layout=layout_file)


def test_permute_contiguous_writes_the_same_file(tiny_dirs, tmp_path, capsys):
    src = tiny_dirs["qwen3"]
    Layout.contiguous(shape_from_hf_config(tiny_hf_model("qwen3").config), 2).save(tmp_path / "c.json")
    assert main(["permute", str(src), str(tmp_path / "c.json"), "--out", str(tmp_path / "o"),
                 "--check", "logits", "--check-tokens", "32"]) == 0
    m = re.search(r"check: max \|logits\(permuted\) - logits\(original\)\| = (\S+) = (\S+) x max \|logit\| (\S+) "
                  r"over 32 tokens \(fp32, relative tolerance 0.0001\)", capsys.readouterr().out)
    assert m and float(m.group(1)) == 0 and float(m.group(3)) > 0.1
    assert (src / "model.safetensors").read_bytes() == (tmp_path / "o" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_logits_check_passes_a_real_permutation(permuted, family, tmp_path, capsys):
    src, layout_file, _, _ = permuted(family)
    assert main(["permute", str(src), str(layout_file), "--out", str(tmp_path / "o"), "--check", "logits"]) == 0
    m = re.search(r"logits\(original\)\| = (\S+) = (\S+) x max \|logit\| (\S+) over 256 tokens",
                  capsys.readouterr().out)
    assert m and 0 < float(m.group(1)) <= TOL and float(m.group(3)) > 0.1
    assert main(["permute", str(src), str(layout_file), "--out", str(tmp_path / "n"), "--check", "none"]) == 0
    assert "check: none (--check none): nothing was read back" in capsys.readouterr().out
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("o", "n"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- `dtpshard permute`: refusals ----------------------------------------------------------
@pytest.fixture
def env(tiny_dirs, tmp_path):
    src = tiny_dirs["qwen3"]
    shape = shape_from_hf_config(tiny_hf_model("qwen3").config)
    good = tmp_path / "good.json"
    no_identity_layout(shape, seed=2).save(good)
    return src, shape, good, tmp_path


def refused(capsys, args, out, expected, exists=False):
    rc = main(["permute", *map(str, args), "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtpshard permute: error: "), captured.err
    assert expected in lines[0], lines[0]
    assert out.exists() == exists
    if out.parent.is_dir():
        assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]


def write_json(path, obj):
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def test_refuses_layouts_for_another_model(env, capsys):
    src, shape, good, tmp = env
    other = replace(shape, layers=2)
    Layout.random(other, 4).save(tmp / "layers.json")
    refused(capsys, [src, tmp / "layers.json"], tmp / "o", "layers=2 but the model has layers=3")
    other = replace(shape, kv_groups=2, heads_per_group=4)
    Layout.random(other, 2).save(tmp / "kv.json")
    refused(capsys, [src, tmp / "kv.json"], tmp / "o", "kv_groups=2 but the model has kv_groups=4")
    Layout.random(replace(shape, neurons=48), 4).save(tmp / "n.json")
    refused(capsys, [src, tmp / "n.json"], tmp / "o", "neurons=48 but the model has neurons=96")


def test_refuses_bad_layout_files(env, capsys):
    src, shape, good, tmp = env
    obj = json.loads(good.read_text())
    cases = [
        ({**obj, "layers": [{**obj["layers"][0], "kv_perm": [0, 0, 1, 2]}] + obj["layers"][1:]},
         "layer 0 kv_perm: index 0 appears 2 times and 3 is missing"),
        ({**obj, "layers": obj["layers"][:1] + [{**obj["layers"][1], "ffn_perm": list(range(95))}] + obj["layers"][2:]},
         "layer 1 ffn_perm: length 95, expected 96"),
        ({**obj, "devices": 3}, "devices=3 does not divide kv_groups=4"),
        ({**obj, "format": "other/1"}, "format='other/1'"),
        ({**obj, "layers": obj["layers"][:2]}, "2 layers listed, model has 3"),
        ("{not json", "not valid JSON"),
    ]
    for i, (bad, expected) in enumerate(cases):
        refused(capsys, [src, write_json(tmp / f"bad{i}.json", bad)], tmp / "o", expected)
    refused(capsys, [src, tmp / "missing.json"], tmp / "o", "layout file not found")


def test_refuses_missing_model_files(env, capsys):
    src, shape, good, tmp = env
    for missing, expected in (("config.json", "no config.json"),
                              ("model.safetensors", "no model.safetensors or model.safetensors.index.json")):
        broken = tmp / f"no-{missing}"
        shutil.copytree(src, broken)
        (broken / missing).unlink()
        refused(capsys, [broken, good], tmp / "o", expected)
    refused(capsys, [tmp / "nowhere", good], tmp / "o", "model directory not found")


def test_refuses_existing_output_unless_forced(env, capsys):
    src, shape, good, tmp = env
    out = tmp / "o"
    out.mkdir()
    (out / "keep").write_text("x")
    refused(capsys, [src, good], out, "exists (use --force to replace it)", exists=True)
    assert (out / "keep").read_text() == "x"
    (tmp / "afile").write_text("y")
    refused(capsys, [src, good], tmp / "afile", "exists and is not a directory", exists=True)
    refused(capsys, [src, good, "--force"], out, "is not a permuted checkpoint", exists=True)  # not permute's
    assert (out / "keep").read_text() == "x"
    out = tmp / "p"
    assert main(["permute", str(src), str(good), "--out", str(out)]) == 0
    (out / "keep").write_text("x")  # a file permute did not write: --force would swap it away, so refused
    refused(capsys, [src, good, "--force"], out, f"{out / 'keep'}: is not a file dtpshard made", exists=True)
    assert (out / "keep").read_text() == "x"
    (out / "keep").unlink()
    assert main(["permute", str(src), str(good), "--out", str(out), "--force"]) == 0  # its own output: replaced
    assert (out / "model.safetensors").is_file() and (out / LAYOUT_JSON).is_file()
    assert not [p for p in tmp.iterdir() if ".tmp" in p.name or ".old" in p.name]
    refused(capsys, [src, good, "--force"], src, "is the source model directory", exists=True)
    refused(capsys, [src, good, "--check-tokens", "0"], tmp / "o2", "--check-tokens 0")
    refused(capsys, [src, good, "--tolerance", "0"], tmp / "o2", "--tolerance 0: must be a finite number > 0")


def test_refuses_unwritable_output(env, capsys):
    src, shape, good, tmp = env
    (tmp / "afile").write_text("y")
    refused(capsys, [src, good], tmp / "afile" / "sub", "afile")  # under a regular file: even root cannot
    if os.geteuid() == 0:
        return  # root ignores directory permissions
    ro = tmp / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        refused(capsys, [src, good], ro / "o", "not writable")
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("check", ["construction", "logits"])
def test_failed_check_writes_nothing(env, capsys, monkeypatch, check):
    import dtpshard.layouts.permute as permute

    src, shape, good, tmp = env
    write = permute.permute_file

    def forgets_down_proj(src_, dst, gathers):  # a bug the check must catch
        return write(src_, dst, {k: v for k, v in gathers.items() if not k.endswith("down_proj.weight")})

    monkeypatch.setattr(permute, "permute_file", forgets_down_proj)
    expected = {"construction": "tensor model.layers.0.mlp.down_proj.weight read back differs from the source",
                "logits": "permuted logits differ from the original by"}[check]
    refused(capsys, [src, good, "--check", check, "--check-tokens", "32"], tmp / "o", expected)


@pytest.mark.slow
def test_permute_smollm2_passes_the_check(tmp_path, capsys):
    """A real 30-layer model: fp32 rounding of the reordered sums stays under 1e-4 (measured 8e-5)."""
    smollm2 = pytest.importorskip("dtpshard.studies.smollm2")
    try:
        src = smollm2.smollm2_checkpoint()
    except UserError as e:
        pytest.skip(str(e))
    shape = shape_from_hf_config(__import__("transformers").AutoConfig.from_pretrained(str(src)))
    no_identity_layout(shape, devices=3, seed=1).save(tmp_path / "r.json")
    assert main(["permute", str(src), str(tmp_path / "r.json"), "--out", str(tmp_path / "o"), "--check", "logits"]) == 0
    m = re.search(r"\| = (\S+) = (\S+) x max \|logit\| (\S+) over 256 tokens", capsys.readouterr().out)
    assert m and float(m.group(1)) <= TOL
