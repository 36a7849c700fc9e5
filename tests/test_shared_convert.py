"""`dtpshard convert --shared`: the layout, the run and the student share the neurons; the
refusals come before stage 1 and write nothing; a rerun with another sharing is refused."""
import json

import pytest

from dtpshard.cli import main
from dtpshard.core.layout import Layout
from dtpshard.model.dtp import DTPModel
from test_convert import args_for, setup  # noqa: F401 (the fixture)


@pytest.fixture(scope="module")
def shared_out(setup):  # noqa: F811
    out = setup["root"] / "shared"
    assert main(args_for(setup, out, shared=0.1)) == 0
    return out


def test_convert_shares_the_neurons_in_layout_run_and_student(shared_out):
    n = 10  # the smallest n >= 0.1 x 96 leaving 96 - n divisible by 2
    layout = Layout.load(shared_out / "layout.json")
    assert layout.shared == n and layout.shared_by == "fo"
    assert json.loads((shared_out / "run" / "config.json").read_text())["model"]["shared"] == n
    assert json.loads((shared_out / "convert.json").read_text())["layout"]["shared"] == 0.1
    student = DTPModel.from_pretrained(shared_out / "student")
    assert student.shape.shared == n and (student.devices, student.delay) == (2, 1)
    score = layout.score
    assert score["J"] >= score["contiguous_J"]


def test_a_rerun_with_other_sharing_is_refused(setup, shared_out, capsys):  # noqa: F811
    assert main(args_for(setup, shared_out, shared=0.2)) == 2
    err = capsys.readouterr().err
    assert "shared" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("fraction,what", [(0.99, "leaves no sharded neuron"), (1.5, "--shared")])
def test_a_bad_fraction_is_refused_before_anything_is_written(setup, tmp_path, capsys, fraction, what):  # noqa: F811
    out = tmp_path / "out"
    assert main(args_for(setup, out, shared=fraction)) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("note:")]
    assert len(err) == 1 and what in err[0], err
    assert not out.exists()
