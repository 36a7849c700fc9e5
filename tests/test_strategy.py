"""Distillation at the users' sizes (training/strategy.py, memory.py, model/shards.py), on a 2-process
gloo mesh: sharded loading equals loading whole, the student saved in shards loads back, bf16-mixed
trains like fp32, two torchrun "nodes" on this machine, a corrupt sharded checkpoint, the memory plan."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from dtpshard.cli import main
from dtpshard.core.launch import free_port, launch_local, root_cause
from dtpshard.core.layout import Layout
from dtpshard.model.dtp import DTPModel
from test_distill import random_docs, rows_without_wall
from test_distill_ddp import assert_same_curves, ddp_args, setup  # noqa: F401 - fixture
from tiny import tiny_hf_model


@pytest.fixture(scope="module")
def bf16_shards(tmp_path_factory):
    """A bf16 checkpoint in several safetensors files (with an index), with a tokenizer and a layout."""
    from tiny import tiny_tokenizer

    root = tmp_path_factory.mktemp("bf16")
    hf = tiny_hf_model("qwen2", seed=7).to(torch.bfloat16)
    hf.save_pretrained(str(root / "model"), max_shard_size="60KB")
    tiny_tokenizer(hf.config.vocab_size).save_pretrained(str(root / "model"))
    Layout.random(DTPModel.from_pretrained(root / "model", 1, 0).shape, 2, 1, seed=2).save(root / "layout.json")
    assert len(list((root / "model").glob("model-*.safetensors"))) > 1
    return root


def _compare_loads(model, layout, out):
    """One rank: the sharded build against the whole model loaded in fp32, then sharded."""
    import torch.distributed as dist

    from dtpshard.model.checkpoint import open_checkpoint
    from dtpshard.training import fsdp
    from dtpshard.training.ddp import Dist
    from dtpshard.training.recipe import DistillConfig, Student, Teacher, resolve
    from dtpshard.training.strategy import Sharded

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = resolve(DistillConfig(teacher=model, out=out, layout=layout, fsdp=True))
    ckpt = open_checkpoint(model)
    new = Sharded(Dist(rank, world), "fp32").build(cfg, ckpt, Layout.load(layout))
    mesh = fsdp.mesh_for("cpu", world)
    sd = ckpt.state_dict(torch.float32)  # today's path: the whole model, permuted, then sharded
    old = (Teacher(DTPModel.from_state_dict(ckpt.hf_config, sd, devices=1, delay=0)),
           Student(DTPModel.from_state_dict(ckpt.hf_config, {k: v.clone() for k, v in sd.items()}, layout=layout)))
    for net, frozen in zip(old, (True, False)):
        fsdp.shard(net, mesh, frozen)
    same = {}
    for which, a, b in (("teacher", new[0], old[0]), ("student", new[1], old[1])):
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        assert pa.keys() == pb.keys()
        same[which] = {n: bool(torch.equal(pa[n].to_local(), pb[n].to_local())) and
                       pa[n].to_local().dtype == torch.float32 for n in pa}
    (out / f"rank{rank}.json").write_text(json.dumps(same))
    dist.destroy_process_group()


def test_sharded_load_equals_the_whole_load_shard_by_shard(bf16_shards, tmp_path):
    exits = launch_local(2, _compare_loads, (bf16_shards / "model", bf16_shards / "layout.json", tmp_path))
    assert [e.code for e in exits] == [0, 0], root_cause(exits)
    for r in range(2):
        same = json.loads((tmp_path / f"rank{r}.json").read_text())
        for which in ("teacher", "student"):
            assert same[which] and all(same[which].values()), (r, which, same[which])


def _args(bf16_shards, text, out, *extra):
    return ["distill", str(bf16_shards / "model"), "--out", str(out), "--layout", str(bf16_shards / "layout.json"),
            "--text", str(text), "--eval-text", str(text), "--steps", "4", "--seq-len", "16", "--micro-batch", "1",
            "--grad-accum", "2", "--eval-every", "2", "--eval-blocks", "2", "--lr", "1e-3", "--warmup", "1",
            "--no-progress", *extra]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "docs.txt"
    path.write_text("\n\n".join(random_docs(200, 3)))
    return path


def test_sharded_save_loads_back_in_dtpshard_and_transformers(bf16_shards, text, tmp_path):
    from transformers import AutoModelForCausalLM

    one, two = tmp_path / "one", tmp_path / "two"
    assert main(_args(bf16_shards, text, one, "--grad-accum", "4", "--save-dtype", "float32")) == 0
    assert main(_args(bf16_shards, text, two, "--nproc", "2", "--fsdp", "--max-shard-size", "100KB",
                      "--save-dtype", "float32")) == 0
    shards = sorted(p.name for p in (two / "final").glob("*.safetensors"))
    assert len(shards) > 1 and (two / "final" / "model.safetensors.index.json").is_file(), shards
    a = DTPModel.from_pretrained(one / "final").state_dict()
    b = DTPModel.from_pretrained(two / "final").state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)
    hf = AutoModelForCausalLM.from_pretrained(str(two / "final"), dtype=torch.float32,
                                              trust_remote_code=True).state_dict()  # a student: remote code
    for name, t in b.items():
        assert torch.equal(hf[name], t), name  # the same tensors under transformers' names
    # the teacher is bf16: by default so is its student
    assert main(_args(bf16_shards, text, tmp_path / "auto", "--steps", "1")) == 0
    assert DTPModel.from_pretrained(tmp_path / "auto" / "final").dtype == torch.bfloat16


def test_bf16_mixed_trains_like_fp32(bf16_shards, text, tmp_path):
    runs = {}
    for precision in ("fp32", "bf16-mixed"):
        run = tmp_path / precision
        assert main(_args(bf16_shards, text, run, "--nproc", "2", "--fsdp", "--precision", precision,
                          "--steps", "6")) == 0
        assert json.loads((run / "config.json").read_text())["precision"] == precision
        runs[precision] = [r for r in rows_without_wall(run) if r["kind"] == "train"]
    for a, b in zip(runs["fp32"], runs["bf16-mixed"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=0.05), (a["step"], a["loss"], b["loss"])
    assert runs["bf16-mixed"] != runs["fp32"]  # it did compute in bf16


def test_grad_checkpointing_composes_with_fsdp(setup, tmp_path):  # noqa: F811
    plain, ckpt = tmp_path / "plain", tmp_path / "ckpt"
    assert main(ddp_args(setup, plain) + ["--nproc", "2", "--fsdp"]) == 0
    assert main(ddp_args(setup, ckpt) + ["--nproc", "2", "--fsdp", "--grad-checkpointing"]) == 0
    assert_same_curves(plain, ckpt)


def test_two_torchrun_nodes_on_this_machine(setup, tmp_path):  # noqa: F811
    """torchrun --nnodes 2 --nproc-per-node 1, a c10d rendezvous on localhost: two agents for two nodes."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert main(ddp_args(setup, ref) + ["--nproc", "2", "--fsdp"]) == 0
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "dtpshard-test",
           "-m", "dtpshard", *ddp_args(setup, run)[0:], "--fsdp"]
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    outs = [a.communicate(timeout=600) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], [o[1][-2000:] for o in outs]
    assert json.loads((run / "config.json").read_text())["world_size"] == 2
    assert_same_curves(ref, run)
    assert sum("student:" in o[0] for o in outs) == 1  # global rank 0 alone reports


def test_corrupt_sharded_checkpoint_is_one_line(setup, tmp_path, monkeypatch, capsys):  # noqa: F811
    run = tmp_path / "run"
    monkeypatch.setenv("DTPSHARD_TEST_CRASH", "step:3")  # dies after step 3; the checkpoint of step 2 stays
    assert main(ddp_args(setup, run) + ["--nproc", "2", "--fsdp"]) == 2
    monkeypatch.delenv("DTPSHARD_TEST_CRASH")
    step = run / "checkpoint.dcp" / (run / "checkpoint.dcp" / "LATEST").read_text().strip()
    for f in step.glob("*.distcp"):
        f.write_bytes(b"not a checkpoint")
    capsys.readouterr()
    assert main(ddp_args(setup, run) + ["--nproc", "2", "--fsdp"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unreadable sharded checkpoint" in err and "--force" in err and "Traceback" not in err, err
    assert len([ln for ln in err.splitlines() if ln.startswith("dtpshard distill: error:")]) == 1, err


def test_plan_refuses_an_impossible_run_before_reading_any_weight(tmp_path, capfd):
    from transformers import LlamaConfig

    model = tmp_path / "config-only"  # no weights at all: only config.json can be read
    LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=2048).save_pretrained(str(model))
    base = ["distill", str(model), "--out", str(tmp_path / "run"), "--devices", "2", "--seq-len", "64",
            "--device", "cpu", "--plan-world", "8"]

    def plan(*flags):
        assert main(base + ["--plan", "--json", "--plan-memory", "1000GB", *flags]) == 0
        return json.loads(capfd.readouterr().out)

    replicated, sharded = plan(), plan("--fsdp")
    assert replicated["fits"] and set(replicated["parts"]) >= {"teacher", "student", "gradients", "optimizer",
                                                                "activations", "communication"}
    parts = replicated["parts"]
    assert parts["optimizer"] == 2 * parts["gradients"]  # AdamW: two moments per trained weight
    assert sharded["parts"]["student"] * 8 == pytest.approx(parts["student"], rel=1e-6)
    between = str((replicated["total"] + sharded["total"]) // 2)
    assert main(base + ["--plan", "--plan-memory", between]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more than the" in err[0] and "it would fit with --fsdp" in err[0], err
    # a real run is refused the same way, before anything is loaded (there are no weights to load)
    assert main([*base[:-2], "--plan-memory", "10MB"]) == 2
    assert "more than the" in capfd.readouterr().err and not (tmp_path / "run").exists()


def test_memory_record_sits_next_to_the_plan(setup, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    assert main(ddp_args(setup, run) + ["--nproc", "2", "--fsdp"]) == 0
    rec = json.loads((run / "memory.json").read_text())
    assert rec["plan"]["setup"]["world"] == 2 and rec["plan"]["setup"]["sharded"]
    assert set(rec["measured"]) == {"setup", "training", "saving"}
    assert all(len(v) == 2 and all(isinstance(x, int) and x > 0 for x in v) for v in rec["measured"].values())
    shutil.rmtree(run)
