"""Data-parallel distillation with 2 CPU processes (gloo): the same curves as one process with the
same global batch, resume after a kill, and a dead rank ends the run with one clear line."""
import json
import os
import subprocess
import sys

import pytest
import torch

from dtpshard.cli import main
from dtpshard.core.layout import Layout
from dtpshard.model.dtp import DTPModel
from test_distill import args_for, random_docs, rows_without_wall

STEPS = {"steps": 6, "eval-every": 3, "checkpoint-every": 2}


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    text = root / "docs.txt"
    text.write_text("\n\n".join(random_docs(300, 1)))
    model = tiny_dirs["qwen3"]
    Layout.random(DTPModel.from_pretrained(model, 1, 0).shape, 2, 1, seed=4).save(root / "layout.json")
    return {"root": root, "model": model, "text": text, "layout": root / "layout.json"}


def ddp_args(setup, out, **over):
    return args_for(setup, out, **{**STEPS, "micro-batch": 1, "grad-accum": 2, **over})


@pytest.fixture(scope="module")
def single(setup):
    """One process, micro-batch 2 × accumulation 2: the same global batch of 4 as 2 × (1 × 2)."""
    run = setup["root"] / "single"
    assert main(args_for(setup, run, **STEPS)) == 0
    return run


@pytest.fixture(scope="module")
def two(setup):
    run = setup["root"] / "two"
    assert main(ddp_args(setup, run) + ["--nproc", "2"]) == 0
    return run


def assert_same_curves(a, b, rel=1e-5):
    ra, rb = rows_without_wall(a), rows_without_wall(b)
    assert [(r["kind"], r["step"], r["tokens"]) for r in ra] == [(r["kind"], r["step"], r["tokens"]) for r in rb]
    for x, y in zip(ra, rb):
        for k in set(x) - {"kind", "step", "tokens"}:
            assert y[k] == pytest.approx(x[k], rel=rel, abs=1e-7), (x["step"], k)


def test_two_processes_match_one_process_with_the_same_global_batch(single, two):
    cfg = json.loads((two / "config.json").read_text())
    assert cfg["world_size"] == 2 and cfg["global_batch"] == 4 and cfg["micro_batch"] == 1
    assert_same_curves(single, two)
    assert (two / "DONE").is_file()
    a = DTPModel.from_pretrained(single / "final").state_dict()
    b = DTPModel.from_pretrained(two / "final").state_dict()
    for name in a:
        # all-reduce order changes the float rounding of summed grads
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)


def test_resume_after_a_kill(setup, two, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    monkeypatch.setenv("DTPSHARD_TEST_CRASH", "step:3@0")
    assert main(ddp_args(setup, run) + ["--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "rank 0 of 2 died (exit code 17)" in err and "resume" in err
    assert not (run / "DONE").exists()
    monkeypatch.delenv("DTPSHARD_TEST_CRASH")
    assert main(ddp_args(setup, run) + ["--nproc", "2"]) == 0
    assert rows_without_wall(run) == rows_without_wall(two)


def test_a_failed_rank_ends_the_run_with_a_clear_error(setup, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    monkeypatch.setenv("DTPSHARD_TEST_CRASH", "step:2@1")
    # --timeout bounds the wait anyway; the launcher notices the death long before
    assert main(ddp_args(setup, run, **{"timeout": 120}) + ["--nproc", "2"]) == 2
    lines = [s for s in capsys.readouterr().err.splitlines() if s.startswith("dtpshard distill: error")]
    assert len(lines) == 1 and "rank 1 of 2 died" in lines[0]
    assert not (run / "DONE").exists()


def test_a_user_error_on_the_ranks_is_reported_once(setup, two, capsys):
    assert main(ddp_args(setup, two, lr=5e-3) + ["--nproc", "2"]) == 2
    lines = [s for s in capsys.readouterr().err.splitlines() if s.startswith("dtpshard distill: error")]
    assert len(lines) == 1 and "lr 0.001 (now 0.005)" in lines[0] and "rank" in lines[0]


def test_torchrun_launch_matches(setup, single, tmp_path):
    run = tmp_path / "torchrun"
    env = {**os.environ, "PYTHONPATH": os.environ["PYTHONPATH"], "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "dtpshard", *ddp_args(setup, run)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_curves(single, run)
    assert done.stdout.count("student:") == 1  # rank 0 speaks
