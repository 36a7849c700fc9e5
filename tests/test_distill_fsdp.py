"""Sharded distillation (--fsdp) with 2 CPU processes (gloo): the same curves and student as one
process with the same global batch, resume after a kill, each rank holding half the state."""
import dataclasses
import json

import pytest
import torch

from dtpshard.cli import main
from dtpshard.core.launch import launch_local, root_cause
from dtpshard.model.dtp import DTPModel
from dtpshard.training.evaluate import evaluate
from dtpshard.training.recipe import FROZEN
from test_distill import rows_without_wall
from test_distill_ddp import assert_same_curves, ddp_args, setup, single  # noqa: F401 - fixtures
from tiny import copy_owned


@pytest.fixture(scope="module")
def sharded(setup):  # noqa: F811
    run = setup["root"] / "fsdp"
    assert main(ddp_args(setup, run) + ["--nproc", "2", "--fsdp"]) == 0
    return run


def test_two_sharded_processes_match_one_process(setup, single, sharded, capsys):  # noqa: F811
    cfg = json.loads((sharded / "config.json").read_text())
    assert cfg["fsdp"] is True and cfg["world_size"] == 2 and cfg["global_batch"] == 4
    assert_same_curves(single, sharded)  # rel 1e-5: reduce-scatter order changes the rounding of summed grads
    assert (sharded / "DONE").is_file() and not (sharded / "checkpoint.dcp").exists()
    a = DTPModel.from_pretrained(single / "final").state_dict()
    b = DTPModel.from_pretrained(sharded / "final").state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)
    capsys.readouterr()
    assert main(["eval", str(sharded / "final"), "--text", str(setup["text"]), "--seq-len", "32", "--blocks", "2",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["devices"] == 2


def test_resume_after_a_kill_while_checkpointing(setup, sharded, tmp_path, monkeypatch, capsys):  # noqa: F811
    run = tmp_path / "run"
    monkeypatch.setenv("DTPSHARD_TEST_CRASH", "checkpoint:4@0")  # step 4's shards all written, never renamed
    assert main(ddp_args(setup, run) + ["--nproc", "2", "--fsdp"]) == 2
    assert "rank 0 of 2 died (exit code 17)" in capsys.readouterr().err
    assert (run / "checkpoint.dcp" / "LATEST").read_text().strip() == "step-00000002"
    monkeypatch.delenv("DTPSHARD_TEST_CRASH")
    assert main(ddp_args(setup, run) + ["--nproc", "2", "--fsdp"]) == 0
    assert rows_without_wall(run) == rows_without_wall(sharded)


def test_a_run_refuses_to_resume_with_another_fsdp_setting(setup, single, capsys):  # noqa: F811
    from test_distill import args_for
    from test_distill_ddp import STEPS

    assert main(args_for(setup, single, **STEPS) + ["--fsdp"]) == 2
    assert "fsdp false (now true)" in capsys.readouterr().err


def test_a_run_from_before_the_flag_is_not_refused(setup, single, tmp_path, capsys):  # noqa: F811
    from test_distill import args_for
    from test_distill_ddp import STEPS

    old = tmp_path / "old"
    copy_owned(single, old)
    cfg = json.loads((old / "config.json").read_text())
    del cfg["fsdp"]
    (old / "config.json").write_text(json.dumps(cfg))
    assert main(args_for(setup, old, **STEPS)) == 0
    assert "already finished" in capsys.readouterr().err


def _shard_sizes(teacher, out):
    """One rank: build the sharded models, take one optimizer step, write the local byte counts."""
    import torch.distributed as dist

    from dtpshard.model.checkpoint import open_checkpoint
    from dtpshard.training import fsdp
    from dtpshard.training.ddp import Dist
    from dtpshard.training.loop import _evaluate, _optimizer, accumulate
    from dtpshard.training.recipe import DistillConfig, resolve
    from dtpshard.training.strategy import Sharded

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = resolve(DistillConfig(teacher=teacher, out=out, devices=2, delay=1, seq_len=8, micro_batch=1, grad_accum=1,
                                fsdp=True))
    strategy = Sharded(Dist(rank, world), "fp32")
    t_net, s_net = strategy.build(cfg, open_checkpoint(teacher), None)
    # 3 blocks on 2 ranks: rank 1 scores one block and makes a second, uncounted forward in lockstep
    ev = torch.randint(0, s_net.model.shape.vocab, (3, 9), generator=torch.Generator().manual_seed(1))
    scores = _evaluate(s_net, t_net, ev, dataclasses.replace(cfg, eval_micro_batch=1), Dist(rank, world), strategy)
    named, opt, _ = _optimizer(cfg, s_net.model)
    batch = torch.randint(0, s_net.model.shape.vocab, (1, 9), generator=torch.Generator().manual_seed(0))
    accumulate(s_net, strategy, t_net, [batch], cfg, "cpu")
    opt.step()
    sizes = {"student": fsdp.local_bytes(s_net.parameters()), "teacher": fsdp.local_bytes(t_net.parameters()),
             "trained": fsdp.local_bytes(p for _, p in named),
             "grads": fsdp.local_bytes(p.grad for _, p in named),
             "optimizer": fsdp.local_bytes(fsdp.optimizer_tensors(opt)), "eval": scores}
    (out / f"rank{rank}.json").write_text(json.dumps(sizes))
    dist.destroy_process_group()


def test_each_rank_holds_half_the_state_and_evaluates_in_lockstep(setup, tmp_path):  # noqa: F811
    exits = launch_local(2, _shard_sizes, (setup["model"], tmp_path))
    assert [e.code for e in exits] == [0, 0], root_cause(exits)
    model = DTPModel.from_pretrained(setup["model"], 2, 1)
    full = sum(p.nbytes for p in model.parameters())
    trained = sum(p.nbytes for n, p in model.named_parameters() if n not in FROZEN)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        # dim-0 shards: each rank holds ceil(rows / 2) rows of each tensor at most
        assert full / 2 * 0.9 <= r["student"] <= full / 2 * 1.1 and r["teacher"] == r["student"]
        assert trained / 2 * 0.9 <= r["grads"] == r["trained"] <= trained / 2 * 1.1
        step_counters = len(list(model.parameters()))  # one fp32 scalar per trained tensor, at most
        assert 2 * r["trained"] <= r["optimizer"] <= 2 * r["trained"] + 4 * step_counters  # exp_avg, exp_avg_sq
    assert sum(r["student"] for r in ranks) == full and sum(r["optimizer"] for r in ranks) >= 2 * trained
    ev = torch.randint(0, model.shape.vocab, (3, 9), generator=torch.Generator().manual_seed(1))
    alone = evaluate(model, DTPModel.from_pretrained(setup["model"], 1, 0), ev, micro_batch=1)
    for r in ranks:
        assert r["eval"]["tokens"] == alone["tokens"] == 24
        assert r["eval"]["kl"] == pytest.approx(alone["kl"], rel=1e-5, abs=1e-7)
        assert r["eval"]["ppl"] == pytest.approx(alone["ppl"], rel=1e-5)
