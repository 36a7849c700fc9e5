"""`dtpshard experiment` end to end on a tiny random model, its resume, and its config checks."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dtpshard.cli import main
from dtpshard.studies.study import load_study

ROOT = Path(__file__).resolve().parents[1]


def corpus(path: Path) -> Path:
    rng = random.Random(0)
    words = "the a model device layer neuron head sum delay partial stream token layout edge score of to and".split()
    path.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(20, 50))) + "."
                                for _ in range(300)))
    return path


def config_text(model: Path, text: Path, **extra_training) -> str:
    training = {"steps": 2, "seq_len": 16, "micro_batch": 2, "grad_accum": 1, "warmup": 1, "lr": 1e-3,
                "eval_every": 1, "checkpoint_every": 1, "progress": False, **extra_training}
    lines = [f'model = "{model}"', "devices = 2", "delay = 1", 'device = "cpu"',
             "[calibration]", f'text = ["{text}"]', "blocks = 2", "seq_len = 16",
             "[evaluation]", f'text = ["{text}"]', "blocks = 2", "[training]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in training.items()]
    lines += ["[[arms]]", 'kind = "optimised"', "seeds = [0]",
              "[[arms]]", 'kind = "contiguous"', "seeds = [0]",
              "[[arms]]", 'kind = "random"', "layout_seeds = [3]", "seeds = []",
              "[[arms]]", 'kind = "anti"', "seeds = []"]
    return "\n".join(lines) + "\n"


@pytest.fixture
def study(tmp_path, tiny_dirs):
    cfg = tmp_path / "study.toml"
    cfg.write_text(config_text(tiny_dirs["llama"], corpus(tmp_path / "corpus.txt")))
    return cfg


def _eval_rows(run: Path):
    return [json.loads(li) for li in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in li]


def test_experiment_end_to_end(study, tmp_path, capsys):
    out = tmp_path / "exp"
    assert main(["experiment", str(study), "--out", str(out)]) == 0
    layouts = {p.stem: json.loads(p.read_text()) for p in (out / "layouts").glob("*.json")}
    assert sorted(layouts) == ["anti", "contiguous", "optimised", "random-3"]
    J = {k: v["score"]["J"] for k, v in layouts.items()}
    assert J["optimised"] > J["contiguous"] > J["anti"]  # ascent from contiguous; anti descends
    assert layouts["random-3"]["seed"] == 3
    for lay in layouts.values():  # each edge's co-located fraction, which a side-by-side report reads
        assert sum(e["colocated"] for e in lay["score"]["edges"]) == pytest.approx(lay["score"]["J"], rel=1e-9)
    assert all({"up", "down"} <= set(i.edge_fractions) for i in load_study(out).layouts.values())
    zero = json.loads((out / "zeroshot.json").read_text())
    assert sorted(zero) == sorted(layouts)
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert runs == ["contiguous-s0", "optimised-s0"]  # random and anti: scored, not distilled
    for name in runs:
        run = out / "runs" / name
        assert (run / "DONE").is_file()
        rows = _eval_rows(run)
        assert [r["step"] for r in rows] == [0, 1, 2]
        # the recorded zero-shot KL is the run's own step-0 evaluation (same blocks, same student)
        assert rows[0]["eval_kl"] == pytest.approx(zero[name.rsplit("-s", 1)[0]]["kl"], rel=1e-6)
    md = (out / "report.md").read_text()
    assert "| optimised | 1 | 1 |" in md and "| anti | anti |" in md
    assert all((out / "figures" / f"{f}.png").is_file() for f in ("curves", "j_vs_kl", "up_edge"))
    captured = capsys.readouterr()  # progress on stderr, the report's path alone on stdout
    assert captured.out.strip() == str(out / "report.md") and "[experiment]" in captured.err


def test_interrupted_experiment_resumes_and_skips_finished_arms(study, tmp_path):
    out = tmp_path / "exp"
    # die inside the first arm
    env = dict(os.environ, DTPSHARD_TEST_CRASH="step:2", PYTHONPATH=os.environ["PYTHONPATH"])
    died = subprocess.run([sys.executable, "-m", "dtpshard", "experiment", str(study), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert died.returncode != 0, died.stderr
    first = out / "runs" / "optimised-s0"
    assert (out / "affinity.safetensors").is_file() and not (first / "DONE").exists()
    assert not (out / "runs" / "contiguous-s0").exists() and not (out / "report.md").exists()
    affinity_mtime = (out / "affinity.safetensors").stat().st_mtime_ns

    assert main(["experiment", str(study), "--out", str(out)]) == 0
    assert (out / "affinity.safetensors").stat().st_mtime_ns == affinity_mtime  # computed once
    for name in ("optimised-s0", "contiguous-s0"):
        assert (out / "runs" / name / "DONE").is_file()
        assert [r["step"] for r in _eval_rows(out / "runs" / name)] == [0, 1, 2]
    before = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*") if p.is_file()}

    assert main(["experiment", str(study), "--out", str(out)]) == 0  # everything done: nothing redone
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*") if p.is_file()} == before


def test_other_config_refused_unless_force(study, tmp_path, capsys):
    out = tmp_path / "exp"
    changed = tmp_path / "changed.toml"
    changed.write_text(study.read_text().replace("devices = 2", "devices = 1"))
    from dtpshard.studies.experiment import _prepare_dir, load_config

    _prepare_dir(out, load_config(study), force=False)
    (out / "layouts").mkdir()
    _prepare_dir(out, load_config(study), force=False)  # the same config: resumed, nothing removed
    assert (out / "layouts").is_dir()
    quiet = tmp_path / "quiet.toml"  # only how it runs changes (progress bar): still the same experiment
    quiet.write_text(study.read_text().replace("progress = false", "progress = true"))
    _prepare_dir(out, load_config(quiet), force=False)
    with pytest.raises(Exception, match=r"other settings \(devices\)"):
        _prepare_dir(out, load_config(changed), force=False)
    _prepare_dir(out, load_config(changed), force=True)  # starts over: the old layouts are gone
    assert not (out / "layouts").exists()


@pytest.mark.parametrize("edit, named", [
    (lambda t: "colour = 1\n" + t, "unknown key 'colour'"),
    (lambda t: t.replace("[training]", "[training]\nlearning_rate = 0.1"), "unknown key 'training.learning_rate'"),
    (lambda t: t.replace("blocks = 2\nseq_len", "blocks = 2\nsize = 3\nseq_len"), "unknown key 'calibration.size'"),
    (lambda t: t.replace('kind = "anti"', 'kind = "anti"\ncolour = "red"'), "unknown key 'arms[3].colour'"),
    (lambda t: t.replace("devices = 2", 'devices = "two"'), "devices = 'two': must be an integer"),
    (lambda t: t.replace("lr = 0.001", "lr = -0.001"), "training.lr = -0.001: must be a number > 0 and at most 1"),
    (lambda t: t.replace("steps = 2", "steps = 0"), "training.steps = 0: must be an integer from 1 to 2^31"),
    (lambda t: t.replace("steps = 2", "steps = 2.5"), "training.steps = 2.5: must be an integer"),
    (lambda t: t.replace("blocks = 2\nseq_len", "blocks = 0\nseq_len"),
     "calibration.blocks = 0: must be an integer >= 1"),
    (lambda t: t.replace('kind = "anti"', 'kind = "best"'), "arms[3].kind = 'best'"),
    (lambda t: t.replace("layout_seeds = [3]", "layout_seeds = [3, 3]"), "arms[2].layout_seeds = [3, 3]: repeats"),
    (lambda t: t.replace('kind = "anti"', 'kind = "anti"\nlayout_seeds = [1]'), "arms[3].layout_seeds: only random"),
    (lambda t: t.replace("delay = 1", "delay = -1"), "delay = -1: must be a finite number >= 0"),
    (lambda t: t.replace("[calibration]", "calibration = 3\n[x]"), "calibration = 3: must be a table"),
    (lambda t: t.replace("devices = 2", "devices = [2"), "not valid TOML"),
])
def test_bad_config_refused_naming_the_key(study, tmp_path, capsys, edit, named):
    bad = tmp_path / "bad.toml"
    bad.write_text(edit(study.read_text()))
    out = tmp_path / "exp"
    assert main(["experiment", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1, err
    assert not out.exists()  # refused before anything is written


def test_yaml_config_is_read_and_checked(study, tmp_path, capsys):
    import tomllib

    import yaml

    from dtpshard.studies.experiment import load_config

    raw = tomllib.loads(study.read_text())
    good = tmp_path / "study.yaml"
    good.write_text(yaml.safe_dump(raw))
    assert load_config(good) == load_config(study)
    raw["training"]["eval_evry"] = 3
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump(raw))
    assert main(["experiment", str(bad), "--out", str(tmp_path / "exp")]) == 2
    assert "unknown key 'training.eval_evry'" in capsys.readouterr().err


def test_model_that_the_devices_do_not_divide_is_refused(study, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(study.read_text().replace("devices = 2", "devices = 3"))  # 4 KV groups
    assert main(["experiment", str(bad), "--out", str(tmp_path / "exp")]) == 2
    assert "devices=3 does not divide" in capsys.readouterr().err
    assert not (tmp_path / "exp").exists()


def test_directory_from_before_proxies_still_resumes(study):
    """Experiments written before `proxies` existed store no layout proxy: they resume unchanged."""
    import copy

    from dtpshard.studies.config import record
    from dtpshard.studies.experiment import _compared, load_config

    new = record(load_config(study))
    old = copy.deepcopy(new)
    old.pop("proxies")
    for arm in old["arms"]:
        for lay in arm["layouts"]:
            lay.pop("proxy")
    assert any(lay.get("proxy") for arm in new["arms"] for lay in arm["layouts"])  # the new form has them
    assert _compared(json.loads(json.dumps(old))) == _compared(json.loads(json.dumps(new)))


def test_config_json_reads_back_as_the_same_typed_experiment(study):
    """config.json records the typed Experiment and reads back to it; the published study's record,
    written when config.json listed only the training keys given, reads as the shipped study with
    the recipe's defaults filled in, so rerunning it resumes."""
    from dtpshard.studies.config import read_record, record
    from dtpshard.studies.demo import STUDY
    from dtpshard.studies.experiment import _compared, load_config
    from dtpshard.training.settings import Recipe

    cfg = load_config(study)
    assert read_record(json.loads(json.dumps(record(cfg)))) == cfg
    assert cfg.training.min_lr_ratio == Recipe().min_lr_ratio and cfg.training.text == cfg.calibration.text
    published = json.loads((ROOT / "docs" / "results" / "smollm2-l3-d1" / "config.json").read_text())
    assert "precision" not in published["training"] and read_record(published).training.precision == "auto"
    assert read_record(published) == load_config(STUDY)
    assert _compared(published) == _compared(record(load_config(STUDY)))


def test_the_sixteen_random_layouts_study_extends_the_published_one():
    """smollm2_random16.toml is the δ = 1 study (every setting, every layout and run of its
    published config.json) with twelve random layouts and random-3's second seed added: what lets
    its directory reuse the published runs."""
    import dataclasses

    from dtpshard.studies.config import read_record
    from dtpshard.studies.experiment import load_config

    published = read_record(json.loads((ROOT / "docs" / "results" / "smollm2-l3-d1" / "config.json").read_text()))
    extended = load_config(ROOT / "dtpshard" / "configs" / "smollm2_random16.toml")
    assert dataclasses.replace(extended, arms=[]) == dataclasses.replace(published, arms=[])

    def runs(cfg):
        return {(spec.name, seed): spec for arm in cfg.arms for spec in arm.layouts for seed in arm.seeds}

    old, new = runs(published), runs(extended)
    assert all(new.get(k) == spec for k, spec in old.items())
    added = sorted(set(new) - set(old))
    assert added == sorted([("random-3", 1)] + [(f"random-{s}", 0) for s in range(4, 16)])
    assert all(new[k].kind == "random" and new[k].seed == int(k[0].split("-")[1]) for k in added)


def test_hand_edited_scores_are_recomputed_and_timings_refused_in_one_line(study, tmp_path, capsys):
    out = tmp_path / "exp"
    assert main(["experiment", str(study), "--out", str(out)]) == 0
    scores = json.loads((out / "scores.json").read_text())
    (out / "scores.json").write_text(json.dumps({**scores, "optimised": 5, "anti": {"first-order": "x"}}))
    assert main(["experiment", str(study), "--out", str(out)]) == 0
    assert json.loads((out / "scores.json").read_text()) == scores  # the same J, computed again
    (out / "timings.json").write_text(json.dumps({"layouts": "x"}))
    capsys.readouterr()
    assert main(["experiment", str(study), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("timings.json: 'layouts' must be a number, found \"x\"") and "Traceback" not in err
