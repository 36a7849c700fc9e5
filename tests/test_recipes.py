"""Distillation recipes (training/recipes.py): the names, what each step trains on, the stream
distance and the curriculum's start against the teacher, and each recipe's run resuming bit for
bit after a kill."""
import json
import os
import subprocess
import sys
from typing import get_args

import pytest
import torch

from dtpshard.cli import main
from dtpshard.core.layout import Layout
from dtpshard.model.dtp import DTPModel
from dtpshard.training import rundir
from dtpshard.training.losses import stream_distance
from dtpshard.training.recipe import Student, Teacher
from dtpshard.training.recipes import RECIPES, Phase, RecipeName, recipe_for
from test_distill import args_for, rows_without_wall, setup  # noqa: F401 (the fixture)
from tiny import tiny_hf_model

OTHERS = [n for n in RECIPES if n != "paper"]


def test_every_name_is_a_recipe_and_a_choice():
    assert tuple(RECIPES) == get_args(RecipeName)
    assert all(r.name == n and (r.__doc__ or "").strip() for n, r in RECIPES.items())


def test_paper_is_the_paper_loss_at_every_step():
    assert {recipe_for("paper").phase(s, 50, 1.0) for s in range(50)} == {Phase(1.0, 1.0, 0.0)}


def test_streams_first_then_the_paper_loss():
    phases = [recipe_for("streams").phase(s, 50, 1.0) for s in range(50)]
    assert phases[:10] == [Phase(1.0, 0.0, 1.0)] * 10 and phases[10:] == [Phase(1.0)] * 40


def test_the_curriculum_ramps_delay_from_zero_in_few_levels():
    delays = [recipe_for("curriculum").phase(s, 50, 1.5).delay for s in range(50)]
    assert delays[0] == 0 and delays[15:] == [1.5] * 35
    assert delays == sorted(delays) and set(delays) == {0, 0.375, 0.75, 1.125, 1.5}


@pytest.fixture(scope="module")
def pair():
    """A tiny dense teacher and its student on a random layout, L = 2 (the student's own weights)."""
    hf = tiny_hf_model("llama")
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    layout = Layout.random(DTPModel.from_state_dict(hf.config, sd, devices=1, delay=0).shape, devices=2, delay=1,
                           seed=1)
    teacher = DTPModel.from_state_dict(hf.config, sd, devices=1, delay=0).eval()
    student = DTPModel.from_state_dict(hf.config, sd, layout=layout, devices=2, delay=1).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    return teacher, student, ids


def test_the_stream_distance_is_zero_when_the_student_is_the_teacher(pair):
    teacher, student, ids = pair
    h, streams = Teacher(teacher)(ids, streams=True)
    assert len(streams) == teacher.shape.modules and torch.equal(h, teacher.hidden(ids))
    with student.delayed(0):  # δ = 0: every device's stream is the dense one (the layout permutes units only)
        _, _, _, zero = Student(student)(ids, h, ids, 0.1, streams=streams)
    _, _, _, late = Student(student)(ids, h, ids, 0.1, streams=streams)
    assert float(zero) < 1e-6 * float(late) and float(late) > 1e-3  # a cosine's rounding
    x = torch.randn(2, 3, 4, 8)
    cos = (x[1] * x[0]).sum(-1) / (x[1].norm(dim=-1) * x[0].norm(dim=-1))
    assert float(stream_distance(x, x[:1])) == pytest.approx(float((1 - cos).sum() / 2))
    assert float(stream_distance(3 * x[:1], x[:1])) == pytest.approx(0, abs=1e-5)  # the scale is not matched


def test_the_curriculum_starts_at_the_teachers_function(pair):
    teacher, student, ids = pair
    start = recipe_for("curriculum").phase(0, 50, student.delay)
    with student.delayed(start.delay):
        torch.testing.assert_close(student(ids).logits, teacher(ids).logits, rtol=1e-4, atol=1e-5)
    assert student.delay == 1 and not torch.allclose(student(ids).logits, teacher(ids).logits, atol=1e-3)


def _cli(args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": os.environ["PYTHONPATH"], "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "dtpshard", *args], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("name", OTHERS)
def test_each_recipe_is_deterministic_and_resumes_bit_for_bit(setup, tmp_path, name):  # noqa: F811
    """Killed after step 2 and resumed from step 1's checkpoint: inside streams' stream-only
    steps (0, 1 of 12) and the curriculum's ramp (0 to 3)."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    every = {"checkpoint-every": 1}
    assert main(args_for(setup, straight, recipe=name, **every)) == 0
    first = _cli(args_for(setup, killed, recipe=name, **every), {"DTPSHARD_TEST_CRASH": "step:2"})
    assert first.returncode == 17, first.stderr
    assert _cli(args_for(setup, killed, recipe=name, **every)).returncode == 0
    rows = rows_without_wall(straight)
    assert rows_without_wall(killed) == rows
    assert json.loads((straight / "config.json").read_text())["recipe"] == name
    train = [r for r in rows if r["kind"] == "train"]
    phases = [recipe_for(name).phase(s, 12, 1) for s in range(12)]
    assert [r["delay"] for r in train] == [p.delay for p in phases]
    assert [r["stream"] > 0 for r in train] == [p.streams > 0 for p in phases]


def test_an_unknown_recipe_is_refused_in_one_line(setup, tmp_path, capsys):  # noqa: F811
    assert main(args_for(setup, tmp_path / "run", recipe="fast")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--recipe" in err[0] and "paper" in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_resume_with_another_recipe_is_refused(setup, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    first = _cli(args_for(setup, run, recipe="streams"), {"DTPSHARD_TEST_CRASH": "step:5"})
    assert first.returncode == 17, first.stderr
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.name != ".lock"}  # a dead process's lock
    assert main(args_for(setup, run, recipe="curriculum")) == 2
    err = capsys.readouterr().err
    assert "recipe" in err and len(err.strip().splitlines()) == 1, err
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.name != ".lock"} == before
    assert not rundir.is_done(run)


def test_stream_matching_trains_adapters_against_their_frozen_base(setup, tmp_path):  # noqa: F811
    """An adapter run's teacher is its own frozen weights run dense: their streams are the targets."""
    run = tmp_path / "run"
    assert main(args_for(setup, run, recipe="layerwise", adapters=2, steps=3, **{"eval-every": 3})) == 0
    train = [r for r in rundir.read_metrics(run) if r["kind"] == "train"]
    assert len(train) == 3 and all(r["stream"] > 0 for r in train)
    assert (run / "final" / "model.safetensors").is_file() or list((run / "final").glob("*.safetensors"))


def test_the_memory_plan_counts_the_teachers_streams(setup, tmp_path):  # noqa: F811
    """6 modules (3 layers) x 2 x 32 tokens x hidden 64: the teacher's fp32 stream and L = 2 saved differences."""
    import dataclasses

    from dtpshard.training.memory import plan_for
    from dtpshard.training.recipe import DistillConfig, resolve

    cfg = resolve(DistillConfig(teacher=setup["model"], out=tmp_path / "run", layout=setup["layout"],
                                recipe="streams", seq_len=32, micro_batch=2))
    assert plan_for(cfg, 1, "cpu").parts["streams"] == 6 * 64 * 64 * (4 + 4 * 2)
    assert "streams" not in plan_for(dataclasses.replace(cfg, recipe="paper"), 1, "cpu").parts
