"""`distill --adapters RANK`: low-rank adapters over the frozen permuted weights, one copy of them.

Exactness first (the low-rank term against the merged weight, the frozen weights with the
adapters off against the dense teacher in transformers), then runs on a tiny model: step 0 is
the untrained student, only the adapters train, the saved student is merged and its update has
rank at most r, the adapters alone rebuild it, resume is bit for bit, refusals are one line."""
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dtpshard.cli import main
from dtpshard.core.layout import Layout
from dtpshard.model import adapters
from dtpshard.model.checkpoint import open_checkpoint
from dtpshard.model.dtp import DTPModel
from dtpshard.training import rundir
from test_distill import _cli, args_for, random_docs, rows_without_wall

RANK = 3


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    text = root / "docs.txt"
    text.write_text("\n\n".join(random_docs(300, 2)))
    model = tiny_dirs["llama"]
    Layout.random(DTPModel.from_pretrained(model, 1, 0).shape, 2, 1, seed=5).save(root / "layout.json")
    return {"root": root, "model": model, "text": text, "layout": root / "layout.json"}


def adapter_args(s, out, **over):
    return args_for(s, out, **{"steps": 6, "eval-every": 3, "checkpoint-every": 2, **over}) + [
        "--adapters", str(RANK)]


@pytest.fixture(scope="module")
def run(setup):
    out = setup["root"] / "run"
    assert main(adapter_args(setup, out)) == 0
    return out


def with_random_adapters(model, rank=RANK, seed=0):
    """`model` with adapters whose B is not zero (trained ones are not)."""
    adapters.attach(model, adapters.AdapterSettings(rank, alpha=2.0 * rank))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if adapters.is_adapter(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def test_the_low_rank_term_equals_the_merged_weight(tiny_dirs):
    for family in ("llama", "qwen3"):
        layout = Layout.random(DTPModel.from_pretrained(tiny_dirs[family], 1, 0).shape, 2, 1, seed=1)
        model = with_random_adapters(DTPModel.from_pretrained(tiny_dirs[family], layout=layout), seed=7)
        ids = torch.randint(0, model.shape.vocab, (2, 12), generator=torch.Generator().manual_seed(0))
        params = dict(model.named_parameters())
        whole = {n: f() for n, f in adapters.merged(params, lambda t: t.detach(), model.adapters.scale).items()}
        plain = DTPModel.from_state_dict(model.hf_config, whole, settings=model.settings)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=1e-5)
            with adapters.adapters_off(model):  # and off, the frozen weights alone
                base = DTPModel.from_pretrained(tiny_dirs[family], layout=layout)
                torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=0)


def test_with_the_adapters_off_the_frozen_weights_are_the_dense_teacher(setup):
    """The teacher of an adapter run: the permuted weights run dense equal transformers' teacher."""
    layout = Layout.load(setup["layout"])
    model = with_random_adapters(DTPModel.from_pretrained(setup["model"], layout=layout))
    from dtpshard.training.recipe import Student

    ids = torch.randint(0, model.shape.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    reference = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32).eval()
    with torch.no_grad():
        h = Student(model)(ids, teacher=True)
        torch.testing.assert_close(model.logits(h), reference(ids).logits, rtol=0, atol=1e-5)
        assert (model(ids).logits - reference(ids).logits).abs().max() > 1e-2  # the student is not


def test_step_0_is_the_untrained_student_and_only_the_adapters_train(setup, run):
    full = setup["root"] / "full"
    assert main(args_for(setup, full, steps=1, **{"eval-every": 1})) == 0
    a, b = (next(x for x in rundir.read_metrics(r) if x["kind"] == "eval") for r in (run, full))
    assert a["eval_ppl"] == b["eval_ppl"]  # B = 0: the student's own numbers are the same bits
    # the teacher is the permuted weights run dense, the other run's the dense checkpoint: rounding apart
    assert a["eval_kl"] == pytest.approx(b["eval_kl"], rel=1e-5) and a["eval_top1"] == b["eval_top1"]
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["adapters"] == RANK and cfg["adapter_targets"] == list(adapters.TARGETS)
    memory = json.loads((run / "memory.json").read_text())["plan"]
    shape = open_checkpoint(setup["model"]).shape
    assert memory["parts"]["adapters"] == 4 * adapters.trainable_count(shape, adapters.AdapterSettings(RANK))


def test_the_student_is_saved_merged_with_an_update_of_rank_r(setup, run):
    teacher = DTPModel.from_pretrained(setup["model"], layout=Layout.load(setup["layout"])).state_dict()
    student = DTPModel.from_pretrained(run / "final").state_dict()
    assert student.keys() == teacher.keys()
    adapted = {f"{n}.weight" for n, _ in adapters.projections(DTPModel.from_pretrained(setup["model"]),
                                                            adapters.DEFAULT_TARGETS)}
    for name, w in student.items():
        diff = (w - teacher[name]).double()
        if name in adapted:
            assert diff.abs().max() > 0, name
            assert torch.linalg.matrix_rank(diff, atol=1e-6).item() <= RANK, name
        else:
            assert torch.equal(w, teacher[name]), name


def test_the_adapters_alone_rebuild_the_student_in_dtpshard_and_transformers(setup, run):
    files = run / rundir.ADAPTERS
    config = json.loads((files / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK and config["lora_alpha"] == 32.0
    # issue 54: the base is the permuted teacher, which exists nowhere yet: never the teacher as it is
    assert config["base_model_name_or_path"] is None
    assert json.loads((files / "dtpshard.json").read_text())["layout"] == str(setup["layout"])
    tensors = load_file(files / "adapter_model.safetensors")
    model = DTPModel.from_pretrained(setup["model"], layout=Layout.load(setup["layout"]))
    adapters.attach(model, adapters.AdapterSettings(RANK))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if adapters.is_adapter(name):
                p.copy_(tensors[adapters.peft_name(name)])
    ids = torch.randint(0, model.shape.vocab, (2, 16), generator=torch.Generator().manual_seed(2))
    merged = DTPModel.from_pretrained(run / "final")
    remote = AutoModelForCausalLM.from_pretrained(run / "final", trust_remote_code=True, dtype=torch.float32)
    with torch.no_grad():
        want = model(ids).logits
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(remote(ids).logits, want, rtol=0, atol=1e-5)


def test_resume_after_a_kill_is_bit_for_bit(setup, run, tmp_path):
    out = tmp_path / "run"
    first = _cli(adapter_args(setup, out), {"DTPSHARD_TEST_CRASH": "step:3"})
    assert first.returncode == 17, first.stderr
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert saved["step"] == 2 and saved["student"] and all(adapters.is_adapter(n) for n in saved["student"])
    second = _cli(adapter_args(setup, out))
    assert second.returncode == 0, second.stderr
    assert rows_without_wall(out) == rows_without_wall(run)
    a, b = load_file(out / "final" / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("flags, says", [
    (["--adapters", "0"], "--adapters 0: must be"),
    (["--adapters", "100000"], "--adapters 100000: above min(rows, columns)"),
    (["--adapters", "2", "--adapter-targets", "qkv"], "--adapter-targets"),
])
def test_bad_adapter_flags_are_one_line(setup, tmp_path, capsys, flags, says):
    assert main(args_for(setup, tmp_path / "r") + flags) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_a_student_teacher_is_refused(run, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["distill", str(run / "final"), "--out", str(out), "--steps", "2", "--adapters", "2",
                 "--seq-len", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "a DTP student is not a dense teacher" in err and len(err.splitlines()) == 1
    assert not out.exists()


# -- data parallel: the adapters and their AdamW state sharded (FSDP2) or replicated (DDP) -------------
@pytest.fixture(scope="module")
def dp(tiny_dirs, tmp_path_factory):
    from test_distill_ddp import STEPS

    root = tmp_path_factory.mktemp("adapters-dp")
    text = root / "docs.txt"
    text.write_text("\n\n".join(random_docs(300, 3)))
    model = tiny_dirs["qwen3"]
    Layout.random(DTPModel.from_pretrained(model, 1, 0).shape, 2, 1, seed=6).save(root / "layout.json")
    s = {"root": root, "model": model, "text": text, "layout": root / "layout.json"}
    one = root / "one"
    assert main(args_for(s, one, **STEPS) + ["--adapters", str(RANK)]) == 0
    return s, one


@pytest.mark.parametrize("how", [["--fsdp"], []], ids=["fsdp", "ddp"])
def test_two_processes_match_one_process(dp, how):
    from test_distill_ddp import assert_same_curves, ddp_args

    s, one = dp
    out = s["root"] / f"two{''.join(how)}"
    assert main(ddp_args(s, out) + ["--nproc", "2", "--adapters", str(RANK), *how]) == 0
    assert_same_curves(one, out)
    a, b = (DTPModel.from_pretrained(r / "final").state_dict() for r in (one, out))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6)
    x, y = (load_file(r / rundir.ADAPTERS / "adapter_model.safetensors") for r in (one, out))
    assert x.keys() == y.keys() and all(torch.allclose(x[k], y[k], rtol=1e-4, atol=1e-6) for k in x)
    if how:  # the sharded checkpoint holds no frozen weight
        memory = json.loads((out / "memory.json").read_text())["plan"]
        assert memory["setup"]["sharded"] and memory["parts"]["adapters"] > 0


def test_a_sharded_adapter_run_resumes_after_a_kill_with_only_the_adapters_saved(dp, tmp_path, capsys, monkeypatch):
    from test_distill_ddp import ddp_args

    s, one = dp
    out = tmp_path / "run"
    args = ddp_args(s, out) + ["--nproc", "2", "--fsdp", "--adapters", str(RANK)]
    monkeypatch.setenv("DTPSHARD_TEST_CRASH", "step:3@1")
    assert main(args) == 2
    monkeypatch.delenv("DTPSHARD_TEST_CRASH")
    assert "died" in capsys.readouterr().err
    import torch.distributed.checkpoint as dcp

    step = out / "checkpoint.dcp" / (out / "checkpoint.dcp" / "LATEST").read_text().strip()
    names = [k for k in dcp.FileSystemReader(step).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert names and all(".adapter." in k for k in names), names[:3]
    assert main(args) == 0
    from test_distill_ddp import assert_same_curves

    assert_same_curves(one, out)


# -- a study with adapter arms, and its report ------------------------------------------------------
def test_an_experiment_trains_adapter_arms_and_reports_them(tiny_dirs, tmp_path, capsys):
    from test_experiment import config_text, corpus

    text = config_text(tiny_dirs["llama"], corpus(tmp_path / "corpus.txt"), steps=3).split("[[arms]]")[0]
    arms = [("optimised", None), ("contiguous", None), ("optimised", 2), ("contiguous", 2), ("optimised", 4)]
    for kind, rank in arms:
        text += f'[[arms]]\nkind = "{kind}"\nseeds = [0, 1]\n'
        text += "" if rank is None else f"adapters = {rank}\nlr = 3e-3\n"
    cfg = tmp_path / "study.toml"
    cfg.write_text(text)
    out = tmp_path / "exp"
    assert main(["experiment", str(cfg), "--out", str(out)]) == 0
    names = sorted(p.name for p in (out / "runs").iterdir())
    assert names == sorted(["optimised-s0", "optimised-s1", "contiguous-s0", "contiguous-s1", "optimised-r2-s0",
                            "optimised-r2-s1", "contiguous-r2-s0", "contiguous-r2-s1", "optimised-r4-s0",
                            "optimised-r4-s1"])
    assert sorted(p.name for p in (out / "layouts").iterdir()) == ["contiguous.json", "optimised.json"]
    run = json.loads((out / "runs" / "optimised-r2-s1" / "config.json").read_text())
    assert run["adapters"] == 2 and run["lr"] == 3e-3 and run["seed"] == 1
    assert json.loads((out / "runs" / "optimised-s0" / "config.json").read_text())["adapters"] is None
    report = (out / "report.md").read_text()
    section = report.split("## Adapters against full distillation")[1]
    assert "| optimised, rank 2 | 2 |" in section and "| contiguous, full | 2 |" in section
    assert "How much of full distillation's KL do adapters reach?" in section
    assert "optimised, rank 4" in section and "rank 2 → 4" in section
    assert (out / "figures" / "adapters.png").is_file() and "figures/adapters.png" in section
    # the main results count the full runs only: adapter runs are in no layout's group
    assert "2 layouts, 4 distillation runs" in report


def test_two_arms_that_name_one_layout_differently_are_refused(tiny_dirs, tmp_path, capsys):
    from test_experiment import config_text, corpus

    text = config_text(tiny_dirs["llama"], corpus(tmp_path / "corpus.txt")).split("[[arms]]")[0]
    text += '[[arms]]\nkind = "optimised"\nadapters = 2\n[[arms]]\nkind = "optimised"\nadapters = 2\n'
    cfg = tmp_path / "study.toml"
    cfg.write_text(text)
    assert main(["experiment", str(cfg), "--out", str(tmp_path / "exp")]) == 2
    assert "is trained by two arms" in capsys.readouterr().err


def test_the_merged_student_generates_the_adapter_models_tokens(setup, run, capsys):
    model = DTPModel.from_pretrained(setup["model"], layout=Layout.load(setup["layout"]))
    adapters.attach(model, adapters.AdapterSettings(RANK))
    tensors = load_file(run / rundir.ADAPTERS / "adapter_model.safetensors")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if adapters.is_adapter(name):
                p.copy_(tensors[adapters.peft_name(name)])
    ids = torch.randint(0, model.shape.vocab, (1, 8), generator=torch.Generator().manual_seed(3))
    want = model.generate(ids, max_new_tokens=12, do_sample=False)
    got = DTPModel.from_pretrained(run / "final").generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.slow
def test_the_plan_is_within_a_quarter_of_the_measured_peak_on_smollm2(tmp_path):
    """At the study's scale (SmolLM2-135M, L = 3, 2 x 256 tokens), rank 64: the plan against the
    training phase's peak resident set."""
    from dtpshard.studies.smollm2 import smollm2_checkpoint

    out = tmp_path / "run"
    assert main(["distill", str(smollm2_checkpoint()), "--out", str(out), "--devices", "3", "--delay", "1",
                 "--steps", "2", "--seq-len", "256", "--micro-batch", "2", "--grad-accum", "1", "--eval-blocks", "1",
                 "--adapters", "64", "--no-progress"]) == 0
    record = json.loads((out / "memory.json").read_text())
    peak = max(record["measured"]["training"])
    assert 0.75 <= peak / record["plan"]["total"] <= 1.25, (peak, record["plan"]["total"])


def test_peft_reads_the_adapters_over_the_permuted_teacher(setup, run, tmp_path):
    """RUN/adapters/ is a LoRA peft loads onto `dtpshard permute TEACHER LAYOUT`; merged, its
    projections are the saved student's."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaForCausalLM

    permuted = tmp_path / "permuted"
    assert main(["permute", str(setup["model"]), str(setup["layout"]), "--out", str(permuted)]) == 0
    base = LlamaForCausalLM.from_pretrained(permuted, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(base, run / rundir.ADAPTERS).merge_and_unload().state_dict()
    student = load_file(run / "final" / "model.safetensors")
    for name, w in student.items():
        torch.testing.assert_close(merged[name], w, rtol=0, atol=1e-6)


def test_a_partial_students_adapters_under_fsdp_match_one_process(dp):
    """A partial student (only modules 0, 3 and 4 delayed, from its layout) trained with adapters on
    two FSDP processes follows one process's curves, and its merged student records the set."""
    from dataclasses import replace

    from test_distill_ddp import STEPS, assert_same_curves, ddp_args

    s, _ = dp
    partial = dict(s, layout=s["root"] / "partial.json")
    replace(Layout.load(s["layout"]), delayed=(0, 3, 4)).save(partial["layout"])
    one, two = s["root"] / "partial-one", s["root"] / "partial-two"
    assert main(args_for(partial, one, **STEPS) + ["--adapters", str(RANK)]) == 0
    assert main(ddp_args(partial, two) + ["--nproc", "2", "--adapters", str(RANK), "--fsdp"]) == 0
    assert_same_curves(one, two)
    for run in (one, two):
        assert json.loads((run / "final" / "config.json").read_text())["dtp"]["delayed"] == [0, 3, 4]
        assert json.loads((run / "config.json").read_text())["delayed"] == [0, 3, 4]
