"""A study with partial-student arms (issue 61) end to end on a tiny model: the layouts chosen by
sensitivity, upper and random, sensitivity.json, the runs, and the report's section with its
figure; a bench's decode.json read into the goals."""
import json

import pytest

from dtpshard.cli import main
from dtpshard.studies.delayed import arms, decode_gains
from dtpshard.studies.study import load_study
from test_experiment import config_text, corpus


def test_partial_arms_end_to_end(tmp_path, tiny_dirs, capsys):
    text = corpus(tmp_path / "corpus.txt")
    base = config_text(tiny_dirs["llama"], text, ce_weight=0.0)
    base = base[:base.index("[[arms]]")]
    arms_toml = "".join(f'[[arms]]\nkind = "optimised"\ndelayed = {share}\ndelayed_by = "{by}"\nseeds = [0]\n'
                        for share, by in ((0.5, "sensitivity"), (0.5, "upper"), (0.25, "random"), (1.0, "sensitivity")))
    arms_toml += '[[arms]]\nkind = "optimised"\ndelayed = 0.5\nlr = 5e-4\nce_weight = 0.1\nseeds = [0]\n'
    (tmp_path / "study.toml").write_text(base + arms_toml)
    out = tmp_path / "exp"
    assert main(["experiment", str(tmp_path / "study.toml"), "--out", str(out)]) == 0
    layouts = {p.stem: json.loads(p.read_text()) for p in (out / "layouts").glob("*.json")}
    assert sorted(layouts) == ["optimised-delayed100", "optimised-delayed25-random", "optimised-delayed50",
                               "optimised-delayed50-upper"]
    sens = json.loads((out / "sensitivity.json").read_text())["optimised"]["kl"]
    assert len(sens) == 6 and min(sens) > 0
    least = sorted(range(6), key=lambda m: (sens[m], m))[:3]
    assert layouts["optimised-delayed50"]["delayed"] == sorted(least)
    assert layouts["optimised-delayed50-upper"]["delayed"] == [3, 4, 5]
    assert len(layouts["optimised-delayed25-random"]["delayed"]) == 2
    assert "delayed" not in layouts["optimised-delayed100"]  # every module: the full student
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert "optimised-delayed50-lr0.0005-ce0.1-s0" in runs and "optimised-delayed50-s0" in runs
    for name in runs:
        cfg = json.loads((out / "runs" / name / "config.json").read_text())
        assert cfg["delayed"] == layouts[name.split("-lr")[0].removesuffix("-s0")].get("delayed")
    study = load_study(out)
    got = {a.layout: (a.share, a.by) for a in arms(study)}
    assert got["optimised-delayed50"] == (0.5, "sensitivity") and got["optimised-delayed100"] == (1.0, "sensitivity")
    md = (out / "report.md").read_text()
    assert "## Partial students" in md and "| optimised-delayed50 | 0.0005 | 0.1 |" in md
    assert "No decode measurement" in md and (out / "figures" / "delayed.png").is_file()
    assert "| optimised-delayed50 | 50% | sensitivity |" in md
    assert "| optimised-delayed100 | 100% | – |" in md  # every module delayed: chosen by no rule
    assert "## Distillation recipes" not in md  # the pilot is the partial section's, not the recipe study's
    rows = [{"tp": 2, "batch": 1, "latency_ms": 0.5, "tp_tok_s": 100.0, "dtp_tok_s": 100.0 + 40 * s,
             "dtp_per_tp": 1 + 0.4 * s, "delayed": s} for s in (1.0, 0.5, 0.25)]
    (out / "decode.json").write_text(json.dumps(rows))
    assert decode_gains(load_study(out)) == {1: pytest.approx({1.0: 0.4, 0.5: 0.2, 0.25: 0.1})}
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "each partial student at least 0.9 × share × that" in md and "): met." in md


def test_arms_added_with_new_seeds_grow_the_studys_teacher_cache(tmp_path, tiny_dirs, capsys):
    """A study with a teacher cache gains an arm of another seed: its own cache is rebuilt for
    every seed's blocks (it was refused as "holds something else" before)."""
    text = corpus(tmp_path / "corpus.txt")
    base = config_text(tiny_dirs["llama"], text)
    base = base[:base.index("[[arms]]")].replace('device = "cpu"', 'device = "cpu"\nteacher_cache_k = 8')
    one = '[[arms]]\nkind = "contiguous"\nseeds = [0]\n'
    (tmp_path / "study.toml").write_text(base + one)
    out = tmp_path / "exp"
    assert main(["experiment", str(tmp_path / "study.toml"), "--out", str(out)]) == 0
    first = json.loads((out / "teacher-cache" / "plan.json").read_text())["blocks"]
    (tmp_path / "study.toml").write_text(base + one + '[[arms]]\nkind = "contiguous"\nseeds = [1]\n')
    assert main(["experiment", str(tmp_path / "study.toml"), "--out", str(out)]) == 0
    assert json.loads((out / "teacher-cache" / "plan.json").read_text())["blocks"] > first
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["contiguous-s0", "contiguous-s1"]
