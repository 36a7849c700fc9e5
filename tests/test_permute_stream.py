"""`dtpshard permute` on a checkpoint as the hub ships it: sharded, an older config.json, tokenizer,
README, an extra non-weight .safetensors. The output mirrors the input (shards, index, metadata,
dtypes), copies every other file byte for byte, and a killed run leaves nothing behind."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dtpshard.cli import main
from dtpshard.core.errors import UserError
from dtpshard.core.io import remove_stale_temporaries
from dtpshard.core.layout import Layout
from dtpshard.core.owned import MARK
from dtpshard.core.permutation import apply_layout
from dtpshard.core.shape import shape_from_hf_config
from dtpshard.layouts.permute import LAYOUT_JSON
from dtpshard.model.dtp import DTPModel
from test_permute import TOL, ids_for, no_identity_layout
from tiny import tiny_hf_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
# As Llama-3 checkpoints on the hub have it: transformers 5 rewrites both fields when it saves.
LLAMA3_ROPE = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 64, "rope_type": "llama3"}


def save_hub_style(path: Path, dtype: torch.dtype) -> Path:
    """A tiny Llama saved in 3 shards + index, with an old-style config.json and the usual extras."""
    model = tiny_hf_model("llama", seed=5).to(dtype)
    model.save_pretrained(str(path), max_shard_size=f"{50 * dtype.itemsize}KB")
    assert len(shards(path)) >= 3
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in ("dtype", "rope_parameters")}
    cfg.update(torch_dtype=str(dtype).removeprefix("torch."), rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
               transformers_version="4.43.0")
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tiny_tokenizer(model.config.vocab_size).save_pretrained(str(path))
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (path / "README.md").write_text("---\nlicense: other\n---\n# tiny\n")
    (path / "LICENSE").write_bytes(b"no license\r\n\x00binary-ish")
    (path / "original").mkdir()
    (path / "original" / "params.json").write_text('{"dim": 64}')
    # An affinity file saved next to the model (`dtpshard affinity MODEL --out MODEL/a.safetensors`).
    save_file({"model.edge.0.1": torch.rand(4, 96)}, str(path / "a.safetensors"), metadata={"kind": "affinity"})
    return path


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """dtype -> (source dir, layout file); the layout moves every layer's groups and neurons."""
    root = tmp_path_factory.mktemp("hub")
    lay = no_identity_layout(shape_from_hf_config(tiny_hf_model("llama").config), seed=7)
    lay.save(root / "layout.json")
    made = {}

    def get(dtype):
        if dtype not in made:
            made[dtype] = (save_hub_style(root / str(dtype), dtype), root / "layout.json")
        return made[dtype]

    return get


def shards(path: Path) -> list[str]:
    return sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))


def files_under(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def read_shards(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in shards(path) for k, v in load_file(str(path / f)).items()}


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager",
                                                local_files_only=True).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_checkpoint_is_mirrored(hub, dtype, tmp_path, capsys):
    from transformers import AutoConfig

    src, layout_file = hub(dtype)
    saved = tmp_path / "saved"  # what the old path did to config.json: the test would catch it
    AutoConfig.from_pretrained(str(src)).save_pretrained(str(saved))
    assert (saved / "config.json").read_bytes() != (src / "config.json").read_bytes()

    out = tmp_path / "out"
    assert main(["permute", str(src), str(layout_file), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    before, after = files_under(src), files_under(out)
    weights = shards(src)
    assert (f"check: all 30 tensors of {len(weights)} weight file(s) read back equal, bit for bit, to the source (21 "
            f"gathered by the layout's indices, 9 copied); {len(before) - len(weights)} other file(s) copied byte "
            "for byte") in printed, printed
    assert after.keys() == before.keys() | {LAYOUT_JSON, MARK}  # + the mark of a directory permute made
    for name in before.keys() - set(weights):  # index, config, tokenizer, README, a.safetensors, original/...
        assert after[name] == before[name], name
    assert json.loads(after[LAYOUT_JSON]) == json.loads(layout_file.read_text())

    shape = shape_from_hf_config(AutoConfig.from_pretrained(str(src)))
    expected = apply_layout(read_shards(src), shape, Layout.load(layout_file))
    got = read_shards(out)
    assert got.keys() == expected.keys()
    for k in expected:
        assert got[k].dtype == dtype and torch.equal(got[k], expected[k]), k
    for f in weights:  # each shard holds the same tensors, metadata and byte count as its source
        with safe_open(str(src / f), "pt") as a, safe_open(str(out / f), "pt") as b:
            assert a.metadata() == b.metadata() == {"format": "pt"} and list(a.keys()) == list(b.keys())
        assert (out / f).stat().st_size == (src / f).stat().st_size

    original, permuted = load_hf(src), load_hf(out)
    assert original.config.rope_parameters["rope_type"] == "llama3"
    ids = ids_for(shape.vocab, B=2, T=24, seed=3)
    with torch.no_grad():
        assert (permuted(ids).logits - original(ids).logits).abs().max().item() <= TOL
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_readers_ignore_other_safetensors_files(hub, tmp_path, capsys):
    src, layout_file = hub(torch.float32)
    ids = ids_for(384, B=1, T=8)
    dense = load_hf(src)(ids).logits
    # Every reader goes through the same file lookup: the affinity file is not a weight file.
    assert (DTPModel.from_pretrained(src, devices=2, delay=0)(ids).logits - dense).abs().max().item() <= TOL
    single = tmp_path / "single"
    single.mkdir()
    save_file(read_shards(src), str(single / "model.safetensors"), metadata={"format": "pt"})
    (single / "config.json").write_bytes((src / "config.json").read_bytes())
    (single / "a.safetensors").write_bytes((src / "a.safetensors").read_bytes())
    assert torch.equal(DTPModel.from_pretrained(single, devices=2, delay=0)(ids).logits,
                       DTPModel.from_pretrained(src, devices=2, delay=0)(ids).logits)
    assert main(["permute", str(single), str(layout_file), "--out", str(tmp_path / "o")]) == 0  # one file in, one out
    assert sorted(p.name for p in (tmp_path / "o").glob("*.safetensors")) == ["a.safetensors", "model.safetensors"]
    assert not (tmp_path / "o" / "model.safetensors.index.json").exists()
    (single / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"no model.safetensors or model.safetensors.index.json \(a.safetensors is "
                                        r"not model weights\)"):
        DTPModel.from_pretrained(single)
    (single / "model.safetensors.index.json").write_text("[1]")
    with pytest.raises(UserError, match="not a safetensors index"):
        DTPModel.from_pretrained(single)
    (single / "model.safetensors.index.json").write_text('{"weight_map": {"lm_head.weight": "../model.safetensors"}}')
    with pytest.raises(UserError, match=r"weight file '../model.safetensors' is not a file of"):
        DTPModel.from_pretrained(single)


# -- interrupted runs ----------------------------------------------------------------------------
CHILD = """
import sys, time
from pathlib import Path
import dtpshard.layouts.permute as permute
from dtpshard.cli import main
write, marker = permute.permute_file, Path(sys.argv[1])
def stalls_in_the_second_shard(src, dst, gathers):
    if "00002" in src.name:
        dst.write_bytes(b"half a shard")
        marker.write_text("writing")
        time.sleep(120)
    return write(src, dst, gathers)
permute.permute_file = stalls_in_the_second_shard
sys.exit(main(["permute", *sys.argv[2:]]))
"""


def test_killed_permute_leaves_nothing_behind(hub, tmp_path, capsys):
    src, layout_file = hub(torch.float32)
    out, marker = tmp_path / "out", tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(marker), str(src), str(layout_file), "--out", str(out)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.05)
        tmp = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
        assert len(tmp) == 1 and (tmp[0] / shards(src)[0]).is_file()  # caught in the middle of writing
    finally:
        child.kill()  # SIGKILL: no chance to clean up, the next run does
        child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL and not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")] == [tmp[0].name]
    assert main(["permute", str(src), str(layout_file), "--out", str(out)]) == 0
    assert "read back equal" in capsys.readouterr().out
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    expected = apply_layout(read_shards(src), shape_from_hf_config(load_hf(src).config), Layout.load(layout_file))
    got = read_shards(out)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_terminated_permute_removes_its_temporary(hub, tmp_path, monkeypatch, capsys, sig):
    import dtpshard.layouts.permute as permute

    src, layout_file = hub(torch.float32)
    write, seen = permute.permute_file, []

    def signalled_in_the_second_shard(src_, dst, gathers):
        seen.append(dst)
        if len(seen) == 2:
            dst.write_bytes(b"half a shard")
            os.kill(os.getpid(), sig)
            time.sleep(30)  # the handler interrupts this
        return write(src_, dst, gathers)

    monkeypatch.setattr(permute, "permute_file", signalled_in_the_second_shard)
    on_term = signal.getsignal(signal.SIGTERM)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even in the background
    try:
        if sig == signal.SIGTERM:
            with pytest.raises(SystemExit) as e:
                main(["permute", str(src), str(layout_file), "--out", str(tmp_path / "out")])
            assert e.value.code == 128 + signal.SIGTERM
        else:
            assert main(["permute", str(src), str(layout_file), "--out", str(tmp_path / "out")]) == 130
            assert capsys.readouterr().err == "dtpshard permute: interrupted\n"
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(seen) == 2 and seen[0].parent.name.startswith(".out.tmp-")
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is on_term  # restored


def test_stale_temporaries_of_live_processes_are_kept(tmp_path):
    from dtpshard.core.temporary import temporary_name

    live = tmp_path / temporary_name("out", "-abc", pid=os.getppid())  # our parent: alive
    live.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / temporary_name("out", "-xyz", pid=int(dead.stdout))
    stale.mkdir()
    (stale / "x").write_text("x")
    others = [tmp_path / ".out.tmp-notapid", tmp_path / ".other.tmp-1-a", tmp_path / "out.tmp-1-a",
              tmp_path / f".out.tmp-{int(dead.stdout)}-xyz"]  # a dead pid, but no check: a name someone else chose
    for p in others:
        p.mkdir()
    remove_stale_temporaries(tmp_path / "out")
    assert live.is_dir() and not stale.exists() and all(p.is_dir() for p in others)


def test_damaged_shard_is_one_line(hub, tmp_path, capsys):
    import shutil

    src, layout_file = hub(torch.float32)
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    second = shards(src)[1]
    (broken / second).write_bytes((src / second).read_bytes()[:100])
    assert main(["permute", str(broken), str(layout_file), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(rf"{second}: not a readable safetensors file", err[0]), err
    assert not (tmp_path / "o").exists() and not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    with pytest.raises(UserError, match=f"{second}: not a readable safetensors file"):  # refused at open
        DTPModel.from_pretrained(broken)
