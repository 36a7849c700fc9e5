"""Issue 46, class "reported success on something wrong": a resume compares everything that defines
the teacher's function (training/inputs.py): its weights, its whole config.json as parsed and its
tokenizer. The sweep's case: `convert` resumed over a teacher whose rope_theta was edited."""
import json
import shutil

import pytest

from dtpshard.cli import main
from test_convert import args_for as convert_args
from test_distill import random_docs
from test_faults import DISTILL


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("record")
    text = root / "docs.txt"
    text.write_text("\n\n".join(random_docs(200, 1)))
    return {"root": root, "model": tiny_dirs["llama"], "text": text}


def _edit(path, **values):
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data))


def one_line(capsys, *words):
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("[convert]")]
    assert len(err) == 1 and all(w in err[0] for w in words), (words, err)


@pytest.mark.parametrize("command", ["distill", "convert"])
def test_an_edited_teacher_config_is_not_resumed(setup, tmp_path, capsys, command):
    teacher = shutil.copytree(setup["model"], tmp_path / "teacher")
    config = json.loads((teacher / "config.json").read_text())  # as transformers 4 wrote it: a top-level θ
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    (teacher / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    if command == "distill":
        argv = ["distill", str(teacher), "--out", str(out), "--text", str(setup["text"]), "--devices", "2", *DISTILL]
    else:
        argv = convert_args({**setup, "model": teacher}, out)
    assert main(argv) == 0
    capsys.readouterr()
    config = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps(config, indent=4, sort_keys=True))  # the same config, rewrapped
    assert main(argv) == 0
    capsys.readouterr()
    _edit(teacher / "config.json", rope_theta=500000.0)  # one student, two teachers: refused
    assert main(argv) == 2
    one_line(capsys, f"the teacher's config {teacher / 'config.json'} changed", "--force")


def test_another_tokenizer_is_not_resumed(setup, tmp_path, capsys):
    teacher = shutil.copytree(setup["model"], tmp_path / "teacher")
    out = tmp_path / "out"
    argv = ["distill", str(teacher), "--out", str(out), "--text", str(setup["text"]), "--devices", "2", *DISTILL]
    assert main(argv) == 0
    capsys.readouterr()
    _edit(teacher / "tokenizer.json", normalizer={"type": "Lowercase"})
    assert main(argv) == 2
    one_line(capsys, "tokenizer", "changed")
