"""The published studies (docs/results/*/) are what `dtpshard report` writes from their own
metrics: the numbers the README quotes come from these files, not from an edited report."""
import shutil
from pathlib import Path

import pytest

from dtpshard.cli import main

ROOT = Path(__file__).resolve().parents[1]
STUDIES = ["smollm2-l3-d1", "smollm2-l3-d1-long", "smollm2-l3-d2", "smollm2-l3-d1-random16", "smollm2-l3-d1-seeds",
           "smollm2-l3-d1-adapters", "smollm2-l3-d1-adapters-long", "smollm2-l3-d1-shared"]


@pytest.mark.parametrize("name", STUDIES)
def test_published_report_is_regenerated_from_its_metrics(name, tmp_path, monkeypatch):
    results = ROOT / "docs" / "results" / name
    copy = tmp_path / "study"
    shutil.copytree(results, copy, ignore=shutil.ignore_patterns("figures", "README.md"))
    monkeypatch.chdir(ROOT)  # the δ = 2 study's [report] compare names the δ = 1 study from here
    assert main(["report", str(copy)]) == 0
    assert (copy / "report.md").read_text() == (results / "report.md").read_text()
    figures = [sorted(p.name for p in (d / "figures").iterdir()) for d in (copy, results)]
    assert figures[0] == figures[1]


def test_a_relative_compare_from_elsewhere_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    copy = tmp_path / "study"
    shutil.copytree(ROOT / "docs" / "results" / "smollm2-l3-d2", copy, ignore=shutil.ignore_patterns("README.md"))
    monkeypatch.chdir(tmp_path)  # [report] compare names docs/results/smollm2-l3-d1, relative to the repository
    assert main(["report", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "no such experiment directory" in err and str(tmp_path) in err and "Traceback" not in err
