"""`--json`: every command that prints a result prints exactly one JSON object on stdout."""
import json

from dtpshard.cli import main
from dtpshard.core.layout import Layout
from test_layout_cli import write_affinity


def _one_object(capsys):
    out = capsys.readouterr().out
    obj = json.loads(out)  # the whole of stdout: anything else printed there fails here
    assert isinstance(obj, dict) and out.count("\n") == 1
    return obj


def test_layout_score_and_permute(tiny_dirs, tmp_path, capsys):
    aff = tmp_path / "a.safetensors"
    write_affinity(aff)
    assert main(["layout", str(aff), "--devices", "4", "--out", str(tmp_path / "l.json"), "--json"]) == 0
    out = _one_object(capsys)
    layout = Layout.load(tmp_path / "l.json")
    assert out["score"]["J"] == layout.score["J"] > out["score"]["random_expectation"]
    assert out["kind"] == "optimised" and out["layout_sha256"] == layout.content_sha256()
    assert main(["score", str(aff), str(tmp_path / "l.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["J"] == out["score"]["J"]

    src = tiny_dirs["qwen3"]
    assert main(["layout", str(src), "--kind", "random", "--devices", "2", "--out", str(tmp_path / "r.json"),
                 "--json"]) == 0
    assert "J" not in _one_object(capsys)["score"]
    assert main(["permute", str(src), str(tmp_path / "r.json"), "--out", str(tmp_path / "p"), "--json"]) == 0
    out = _one_object(capsys)
    assert out["check"]["passed"] and out["check"]["kind"] == "construction" and out["check"]["tensors"] > 0
    assert main(["permute", str(src), str(tmp_path / "r.json"), "--out", str(tmp_path / "p"), "--force",
                 "--check", "logits", "--json"]) == 0
    out = _one_object(capsys)
    assert out["check"]["passed"] and 0 <= out["check"]["max_abs_diff"] <= out["check"]["tolerance"] * \
        out["check"]["max_abs_logit"]
    assert out["out"] == str(tmp_path / "p") and out["devices"] == 2
