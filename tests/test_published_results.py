"""The published SmolLM2 study (docs/results/smollm2-l3-d1/) is what `dtpshard report` writes from
its own metrics: the numbers the README quotes come from these files, not from an edited report."""
import shutil
from pathlib import Path

from dtpshard.cli import main

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "smollm2-l3-d1"


def test_published_report_is_regenerated_from_its_metrics(tmp_path):
    copy = tmp_path / "study"
    shutil.copytree(RESULTS, copy, ignore=shutil.ignore_patterns("figures", "README.md"))
    assert main(["report", str(copy)]) == 0
    assert (copy / "report.md").read_text() == (RESULTS / "report.md").read_text()
    figures = [sorted(p.name for p in (d / "figures").iterdir()) for d in (copy, RESULTS)]
    assert figures[0] == figures[1]
