"""`dtpshard distill` on a tiny model: the run directory contract, the recipe's invariants,
resume after a real kill, held-out data, refusals."""
import dataclasses
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dtpshard.cli import main
from dtpshard.commands.training import distill_cmd
from dtpshard.core.layout import Layout
from dtpshard.core.shape import UnitShape
from dtpshard.model.dtp import DTPModel
from dtpshard.training import rundir
from dtpshard.training.distill import DistillConfig, lr_factor, resolve, train_blocks_for
from dtpshard.training.evaluate import eval_blocks_for, evaluate
from tiny import command_line, copy_owned

ROOT = Path(__file__).resolve().parents[1]
TRAIN_KEYS = {"kind", "step", "tokens", "loss", "kl", "ce", "lr", "grad_norm", "wall"}
EVAL_KEYS = {"kind", "step", "tokens", "eval_kl", "eval_ppl", "eval_top1", "wall"}


def random_docs(n, seed, words=(30, 60)):
    """Documents of random letter-words: any 12 tokens in a row identify their document."""
    rng = random.Random(seed)
    return [" ".join("".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 7)))
                     for _ in range(rng.randint(*words))) for _ in range(n)]


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    text = root / "docs.txt"
    text.write_text("\n\n".join(random_docs(300, 0)))
    model = tiny_dirs["llama"]
    layout = Layout.random(DTPModel.from_pretrained(model, 1, 0).shape, devices=2, delay=1, seed=3)
    layout.save(root / "layout.json")
    return {"root": root, "model": model, "text": text, "layout": root / "layout.json"}


def args_for(s, out, **over):
    opts = {"layout": s["layout"], "steps": 12, "seq-len": 32, "micro-batch": 2, "grad-accum": 2, "lr": 1e-3,
            "warmup": 2, "eval-every": 4, "eval-blocks": 4, "checkpoint-every": 3, "text": s["text"],
            "eval-text": s["text"]}
    return command_line("distill", s["model"], out, opts, **over)


@pytest.fixture(scope="module")
def straight(setup):
    """One uninterrupted run (in process, through the CLI)."""
    run = setup["root"] / "straight"
    assert main(args_for(setup, run)) == 0
    return run


def rows_without_wall(run):
    return [{k: v for k, v in r.items() if k != "wall"} for r in rundir.read_metrics(run)]


def test_run_directory_contract(setup, straight):
    cfg = json.loads((straight / "config.json").read_text())
    assert {f.name for f in dataclasses.fields(DistillConfig)} <= set(cfg)
    assert cfg["model"]["layers"] == 3 and cfg["layout_kind"] == "random" and cfg["layout"] == str(setup["layout"])
    assert cfg["devices"] == 2 and cfg["delay"] == 1 and cfg["global_batch"] == 4 and cfg["tokens_per_step"] == 128
    rows = rundir.read_metrics(straight)
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 13)) and all(set(r) == TRAIN_KEYS for r in train)
    assert [r["step"] for r in evals] == [0, 4, 8, 12] and all(set(r) == EVAL_KEYS for r in evals)
    assert [r["tokens"] for r in train] == [128 * k for k in range(1, 13)]
    assert all(math.isfinite(r[k]) for r in train for k in ("loss", "kl", "ce", "grad_norm"))
    assert all(r["loss"] == pytest.approx(r["kl"] + 0.1 * r["ce"], rel=1e-5) for r in train)
    assert (straight / "DONE").is_file() and not (straight / "checkpoint.pt").exists()
    assert not [p for p in straight.iterdir() if p.name.startswith(".")]


def test_final_student_loads_and_evaluates_like_the_last_eval_row(setup, straight, capsys):
    final = straight / "final"
    student = DTPModel.from_pretrained(final)
    assert student.dtp_settings() == {"devices": 2, "delay": 1, "stage3": "sqrt"}
    block = json.loads((final / "config.json").read_text())["dtp"]  # the student says what it is
    assert block == {"family": "llama", "devices": 2, "delay": 1, "stage3": "sqrt",
                     "layout_sha256": Layout.load(setup["layout"]).content_sha256()}
    assert main(["eval", str(final), "--teacher", str(setup["model"]), "--text", str(setup["text"]),
                 "--blocks", "4", "--seq-len", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    last = rundir.read_metrics(straight)[-1]
    assert last["kind"] == "eval" and out["kl"] == pytest.approx(last["eval_kl"], rel=1e-5)
    assert out["ppl"] == pytest.approx(last["eval_ppl"], rel=1e-5)


def test_kl_falls_and_frozen_parameters_do_not_change(setup, straight):
    evals = [r["eval_kl"] for r in rundir.read_metrics(straight) if r["kind"] == "eval"]
    assert evals[-1] < 0.8 * evals[0], evals
    start = DTPModel.from_pretrained(setup["model"], 2, 1, layout=setup["layout"]).state_dict()
    final = DTPModel.from_pretrained(straight / "final").state_dict()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(final[name], start[name]), name
    trained = [n for n in start if not torch.equal(final[n], start[n])]
    assert len(trained) == len(start) - 2  # every other tensor (norms included) was trained


def test_eval_at_step_zero_equals_direct_evaluation(setup, straight):
    first = rundir.read_metrics(straight)[0]
    blocks, _ = eval_blocks_for(setup["model"], text=[str(setup["text"])], blocks=4, seq_len=32)
    student = DTPModel.from_pretrained(setup["model"], 2, 1, layout=setup["layout"])
    r = evaluate(student, DTPModel.from_pretrained(setup["model"], 1, 0), blocks, micro_batch=2)
    assert first["kind"] == "eval" and first["step"] == 0
    assert first["eval_kl"] == pytest.approx(r["kl"], rel=1e-6)
    assert first["eval_ppl"] == pytest.approx(r["ppl"], rel=1e-6)


def test_tensor_parallel_student_starts_at_kl_zero(setup, tmp_path):
    run = tmp_path / "tp"
    assert main(args_for(setup, run, delay=0, steps=1, layout=None, devices=2)) == 0
    first, train = rundir.read_metrics(run)[:2]
    assert abs(first["eval_kl"]) < 1e-6 and abs(train["kl"]) < 1e-6  # fp32 rounding; δ = 1 starts near 0.1


def test_model_card_names_no_place_on_this_machine(setup, straight):
    """The card is made to be uploaded: the teacher by its name, the run's records relative to the
    card, any other file (the layout, the text) by its name; no absolute path, no home directory."""
    card = (straight / "final" / "README.md").read_text()
    assert not re.findall(r"(?<![\w:/.~-])/[\w.-]+/", card) and "~/" not in card, card
    for place in (setup["root"], setup["model"], Path.home()):
        assert str(place) not in card
    assert "`../config.json`" in card and "`../metrics.jsonl`" in card
    assert "`llama` (llama family)" in card and "`layout.json`, kind random" in card and "text:docs.txt" in card


def test_lr_schedule(straight):
    assert [lr_factor(i, 10, 4, 0.1) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    decay = [lr_factor(i, 10, 4, 0.1) for i in range(4, 10)]
    assert all(a > b for a, b in zip(decay, decay[1:])) and decay[-1] == pytest.approx(0.1)
    lrs = [r["lr"] for r in rundir.read_metrics(straight) if r["kind"] == "train"]
    assert lrs == pytest.approx([1e-3 * lr_factor(i, 12, 2, 0.1) for i in range(12)], rel=1e-12)


def test_cli_flags_are_the_config_fields():
    from dtpshard.cli import options

    flags = {o.key: o.default for o in options(distill_cmd) if o.key != "json"}
    fields = {f.name: f.default for f in dataclasses.fields(DistillConfig)}
    assert set(flags) == set(fields)  # the recipe is written once: DistillConfig
    assert all(flags[n] == d for n, d in fields.items() if d is not dataclasses.MISSING)


def test_training_and_calibration_never_see_eval_documents(setup, tiny_dirs):
    from dtpshard.data.blocks import is_eval_doc, load_texts, make_blocks
    from dtpshard.model.checkpoint import load_tokenizer

    tok = load_tokenizer(setup["model"])
    specials = {tok.bos_token_id, tok.eos_token_id}

    def grams(rows, n=12):
        out = set()
        for r in rows:
            r = list(map(int, r))
            out |= {tuple(r[i:i + n]) for i in range(len(r) - n + 1) if not specials & set(r[i:i + n])}
        return out

    cfg = resolve(DistillConfig(teacher=setup["model"], out=setup["root"] / "x", text=[str(setup["text"])],
                                steps=20, seq_len=32, micro_batch=2, grad_accum=2))
    stream, _ = train_blocks_for(cfg, 1, tok)
    train = stream.window(0, len(stream))
    calib = make_blocks(tok, load_texts([str(setup["text"])], role="calibration"), 33, 50)
    ev, _ = eval_blocks_for(setup["model"], text=[str(setup["text"])], blocks=8, seq_len=32)
    docs = setup["text"].read_text().split("\n\n")
    assert len(docs) == 300 and 0 < sum(map(is_eval_doc, docs)) < 300
    eval_doc_grams = grams(tok(d, add_special_tokens=False)["input_ids"] for d in docs if is_eval_doc(d))
    assert grams(ev) and grams(ev) <= eval_doc_grams  # the check can see eval documents...
    assert not grams(train) & eval_doc_grams and not grams(calib) & eval_doc_grams  # ...and finds none here


def _cli(args, env_extra=None, **kw):
    env = {**os.environ, "PYTHONPATH": os.environ["PYTHONPATH"], "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "dtpshard", *args], env=env, capture_output=True, text=True,
                          timeout=600, **kw)


# a kill between steps: also test_resume_after_sigkill_at_an_arbitrary_moment (by default)
@pytest.mark.parametrize("crash", [pytest.param("step:5", marks=pytest.mark.slow), "checkpoint:6"])
def test_resume_after_a_kill_equals_the_straight_run(setup, straight, tmp_path, crash):
    run = tmp_path / "run"
    first = _cli(args_for(setup, run), {"DTPSHARD_TEST_CRASH": crash})
    assert first.returncode == 17, first.stderr  # died without any cleanup
    assert not (run / "DONE").exists()
    if crash.startswith("checkpoint"):  # killed after writing the temporary, before the rename
        assert [p.name for p in run.iterdir() if ".tmp-" in p.name]
        assert torch.load(run / "checkpoint.pt", weights_only=False)["step"] == 3
    second = _cli(args_for(setup, run))
    assert second.returncode == 0, second.stderr
    assert rows_without_wall(run) == rows_without_wall(straight)
    assert not [p for p in run.iterdir() if p.name.startswith(".")]
    walls = [r["wall"] for r in rundir.read_metrics(run)]
    assert walls == sorted(walls)  # wall time adds up across the resume


def test_resume_after_sigkill_at_an_arbitrary_moment(setup, straight, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.environ["PYTHONPATH"], "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dtpshard", *args_for(setup, run, **{"checkpoint-every": 1})],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while len(rundir.read_metrics(run)) < 6 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "DONE").exists()
    second = _cli(args_for(setup, run, **{"checkpoint-every": 1}))
    assert second.returncode == 0, second.stderr
    assert rows_without_wall(run) == rows_without_wall(straight)


def test_finished_run_is_not_redone(setup, straight, tmp_path, capsys):
    run = tmp_path / "done"
    copy_owned(straight, run)
    before = (run / "metrics.jsonl").read_bytes()
    assert main(args_for(setup, run)) == 0
    assert "already finished" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_bytes() == before


def _one_error_line(capsys, *what):
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith("note:")]
    assert len(err) == 1 and all(w in err[0] for w in what), err
    return err[0]


def test_other_settings_are_refused_unless_force(setup, straight, tmp_path, capsys):
    run = tmp_path / "other"
    copy_owned(straight, run)
    assert main(args_for(setup, run, lr=2e-3, seed=1)) == 2
    line = _one_error_line(capsys, "lr 0.001 (now 0.002)", "seed 0 (now 1)", "--force")
    assert "steps" not in line
    Layout.random(DTPModel.from_pretrained(setup["model"], 1, 0).shape, 2, 1, seed=9).save(tmp_path / "l.json")
    assert main(args_for(setup, run, layout=tmp_path / "l.json")) == 2
    _one_error_line(capsys, "layout content changed")
    assert main(args_for(setup, run, lr=2e-3, steps=2, **{"eval-every": 1}) + ["--force"]) == 0
    assert json.loads((run / "config.json").read_text())["lr"] == 2e-3
    assert [r["step"] for r in rundir.read_metrics(run) if r["kind"] == "train"] == [1, 2]


def test_bad_inputs_one_line_exit_2(setup, tmp_path, capsys):
    out = tmp_path / "bad"
    other = Layout.contiguous(UnitShape(3, 4, 2, 64), devices=2)
    other.save(tmp_path / "other.json")
    assert main(args_for(setup, out, layout=tmp_path / "other.json")) == 2
    _one_error_line(capsys, "neurons=64")
    assert main(args_for(setup, out, layout=None, devices=3)) == 2
    _one_error_line(capsys, "devices=3")
    assert main(args_for(setup, out, layout=None, devices=2, delay=7)) == 2
    _one_error_line(capsys, "delay=7")
    assert main(args_for(setup, out, devices=4)) == 2  # the layout was made for L = 2
    _one_error_line(capsys, "devices=2")
    (tmp_path / "empty.txt").write_text("\n\n")
    assert main(args_for(setup, out, text=tmp_path / "empty.txt")) == 2
    _one_error_line(capsys, "empty.txt")
    assert main(args_for(setup, out, steps=0)) == 2
    _one_error_line(capsys, "--steps 0")
    assert not out.exists()  # nothing half-written


def test_json_summary_and_tensorboard(setup, tmp_path, capsys):
    """--json: one object on stdout; --tensorboard: the metrics.jsonl rows as scalars, also after a
    kill and resume (the events written after the checkpoint are purged, as the rows are)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, tb = tmp_path / "run", tmp_path / "tb"
    args = args_for(setup, run, steps=4, **{"eval-every": 2, "checkpoint-every": 2, "tensorboard": tb})
    assert _cli(args, {"DTPSHARD_TEST_CRASH": "step:3"}).returncode == 17  # after step 3's row, before its checkpoint
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = rundir.read_metrics(run)
    last = [r for r in rows if r["kind"] == "eval"][-1]
    assert out == {"student": str(run / "final"), "metrics": str(run / "metrics.jsonl"), "steps": 4,
                   "eval_kl": last["eval_kl"], "eval_ppl": last["eval_ppl"]}
    events = EventAccumulator(str(tb))
    events.Reload()
    assert {"train/loss", "train/kl", "train/ce", "train/lr", "train/grad_norm", "eval/kl", "eval/ppl"} <= set(
        events.Tags()["scalars"])
    kl = [(e.step, e.value) for e in events.Scalars("train/kl")]
    assert kl == [(r["step"], pytest.approx(r["kl"], rel=1e-6)) for r in rows if r["kind"] == "train"]
    assert [e.step for e in events.Scalars("eval/ppl")] == [0, 2, 4]
