"""Every file dtpshard reads is parsed within bounds (depth, integers, size, known keys); every JSON
it writes is strict (null for a non-number); a diverged run stops with one line and keeps its last
checkpoint; non-finite weights are refused by name; an overflowing temperature decodes greedily;
refusals say what differs; an offline hub dataset is one line at once."""
import json
import re
import shutil
import sys
import time
import types

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dtpshard.cli import main
from dtpshard.core.errors import UserError
from dtpshard.core.io import dumps, loads
from dtpshard.core.layout import max_bytes
from dtpshard.core.shape import UnitShape
from test_experiment import config_text, corpus

DISTILL = ["--seq-len", "8", "--micro-batch", "1", "--grad-accum", "1", "--eval-blocks", "1", "--eval-every", "1",
           "--checkpoint-every", "1", "--device", "cpu", "--no-progress", "--devices", "2"]


def strict(text: str):
    """json.loads as a strict (RFC 8259) parser: NaN and Infinity are not JSON."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))


def one_line(capsys, *words):
    err = capsys.readouterr().err.strip().splitlines()
    err = [ln for ln in err if "error:" in ln] if len(err) > 1 else err
    assert len(err) == 1 and all(w in err[0] for w in words), err
    return err[0]


# -- bounded parsing ------------------------------------------------------------------------------
def test_bounded_json_reader():
    for text, words in (("[" * 40 + "]" * 40, "nested more than 32"), ('{"n": 99999999999999999999}', "beyond any"),
                        ("7" * 5000, "beyond any"), ('{"n": -9223372036854775808}', "beyond any")):
        with pytest.raises(UserError, match=words):
            loads(text, "f")
    assert loads('{"s": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", "n": 9223372036854775807}', "f")["n"] == 2 ** 63 - 1


@pytest.fixture
def model(tmp_path, tiny_dirs):
    dst = tmp_path / "model"
    shutil.copytree(tiny_dirs["llama"], dst)
    return dst


def _layout_case(good: dict, case: str):
    layers = good["layers"]
    return {
        "deep": {**good, "score": {"x": json.loads("[" * 40 + "]" * 40)}},
        "huge int": {**good, "seed": 10 ** 30},
        "top-level typo": {**good, "devicse": 2},
        "layer typo": {**good, "layers": [{**layers[0], "kv_prem": [0]}] + layers[1:]},
        "model typo": {**good, "model": {**good["model"], "nuerons": 96}},
        "absurd model": {**good, "model": {**good["model"], "neurons": 2 ** 40}},
    }[case]


LAYOUT_CASES = {"deep": "nested more than 32", "huge int": "beyond any", "top-level typo": "unknown key 'devicse'",
                "layer typo": "layer 0: unknown key 'kv_prem'", "model typo": "unknown key 'nuerons'",
                "absurd model": "neurons=1099511627776 is beyond any model"}


@pytest.mark.parametrize("case", list(LAYOUT_CASES) + ["too large"])
def test_layout_files_within_bounds(model, tmp_path, capsys, case):
    lay = tmp_path / "l.json"
    assert main(["layout", str(model), "--kind", "random", "--devices", "2", "--out", str(lay)]) == 0
    good = json.loads(lay.read_text())
    if case == "too large":  # padding beyond what any layout of this model needs
        need = max_bytes(UnitShape.from_json(good["model"], "x"))
        lay.write_text(json.dumps(good) + " " * need)
        words = "more than a layout of this model can need"
    else:
        lay.write_text(json.dumps(_layout_case(good, case)))
        words = LAYOUT_CASES[case]
    before = tree_bytes(tmp_path)
    for argv in (["permute", str(model), str(lay), "--out", str(tmp_path / "p")],  # the model known: cap first
                 ["eval", str(model), "--layout", str(lay), "--devices", "2", "--blocks", "1", "--seq-len", "8"]):
        assert main(argv) == 2
        one_line(capsys, str(lay), words)
    assert tree_bytes(tmp_path) == before


def tree_bytes(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_affinity_metadata_within_bounds(tmp_path):
    from safetensors.numpy import save_file as save_np

    from dtpshard.affinity.file import Affinity

    edges = {(0, 1): np.ones((2, 4), dtype=np.float32)}
    Affinity(UnitShape(1, 2, 1, 4), 1, edges, tokens=8).save(tmp_path / "a.safetensors")
    base = {"format": "dtpshard.affinity/1", "model": '{"layers": 1, "kv_groups": 2, "heads_per_group": 1, '
            '"neurons": 4}', "delay": "1", "tokens": "8", "options": "{}", "source": "x"}
    cases = {"typo": ({**base, "tokenz": "8"}, "unknown key 'tokenz'"),
             "huge tokens": ({**base, "tokens": "1" * 30}, "beyond any"),
             "deep options": ({**base, "options": "[" * 40 + "]" * 40}, "nested more than 32"),
             "model typo": ({**base, "model": base["model"][:-1] + ', "experts": 8}'}, "unknown key 'experts'"),
             "huge model": ({**base, "model": base["model"].replace('"layers": 1', '"layers": 99999999')},
                            "layers=99999999 is beyond any model")}
    for name, (meta, words) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_np({"edge.0.1": edges[(0, 1)]}, str(path), metadata=meta)
        with pytest.raises(UserError, match=words):
            Affinity.load(path)


def test_student_records_within_bounds(model, capsys):
    cases = {'{"devices": 2, "delays": 1}': "unknown DTP setting 'delays'",
             '{"devices": 2, "delay": ' + "[" * 40 + "]" * 40 + "}": "nested more than 32",
             '{"devices": 99999999999999999999999}': "beyond any"}
    for text, words in cases.items():
        (model / "dtp.json").write_text(text)
        assert main(["generate", str(model), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
        one_line(capsys, "dtp.json", words)
    (model / "dtp.json").unlink()
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "dtp": {"devices": 2, "stage": "one"}}))
    assert main(["generate", str(model), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    one_line(capsys, "config.json", "unknown DTP setting 'stage'")
    (model / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 2 ** 30}))
    assert main(["layout", str(model), "--kind", "random", "--devices", "2", "--out", str(model.parent / "l")]) == 2
    one_line(capsys, "intermediate_size=1073741824 is beyond any model")
    (model / "config.json").write_text(json.dumps({**cfg, "vocab_size": 10 ** 30}))
    assert main(["generate", str(model), "--prompt", "hi"]) == 2
    one_line(capsys, "config.json", "beyond any")


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_study_and_config_files_within_bounds(model, tmp_path, capsys, suffix):
    text = corpus(tmp_path / "c.txt")
    good = config_text(model, text)
    study = tmp_path / f"s{suffix}"
    deep = "[" * 40 + "1" + "]" * 40
    if suffix == ".toml":
        cases = {good.replace("devices = 2", "devices = 99999999999999999999999"): "beyond any",
                 good.replace("devices = 2", f"devices = {deep}"): "nested more than 32",
                 good.replace("devices = 2", "devicse = 2"): "unknown key 'devicse'",
                 good + "#" * (1 << 20): "more than a study file can need"}
    else:
        cases = {f"model: {model}\ndevices: 99999999999999999999999\narms: [{{kind: optimised}}]\n": "beyond any",
                 f"model: {model}\ndevices: {deep}\n": "nested more than 32",
                 f"model: {model}\ndevicse: 2\narms: [{{kind: optimised}}]\n": "unknown key 'devicse'"}
    for body, words in cases.items():
        study.write_text(body)
        assert main(["experiment", str(study), "--out", str(tmp_path / "e")]) == 2
        one_line(capsys, str(study), words)
    (tmp_path / "c.yaml").write_text("steps: 99999999999999999999\n")
    assert main(["distill", str(model), "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "r")]) == 2
    one_line(capsys, "--config", "beyond any")
    assert not (tmp_path / "e").exists() and not (tmp_path / "r").exists()


def test_run_files_within_bounds(tmp_path, capsys):
    from dtpshard.training.rundir import check_run, read_metrics
    from test_report import make_experiment

    d = make_experiment(tmp_path / "exp")
    run = next((d / "runs").iterdir())
    (run / "metrics.jsonl").write_text('{"kind": "eval", "step": 99999999999999999999999, "eval_kl": 1}\n{}\n')
    assert main(["report", str(d)]) == 2
    one_line(capsys, "metrics.jsonl:1", "beyond any")
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "x": "' + "a" * 70000 + '"}\n')
    with pytest.raises(UserError, match="more than a metrics row can need"):
        read_metrics(run)
    (run / "config.json").write_text('{"format": "dtpshard.distill/1", "lr": ' + "[" * 40 + "]" * 40 + "}")
    with pytest.raises(UserError, match="nested more than 32.*use --force"):
        check_run(run, {"lr": 1}, ["lr"], False)


def test_teacher_cache_manifest_keys(tmp_path):
    from dtpshard.training.teacher_cache import TeacherCache

    (tmp_path / "manifest.json").write_text('{"format": "dtpshard.teacher-cache/1", "k": 4, "shardz": []}')
    with pytest.raises(UserError, match="unknown key 'shardz'"):
        TeacherCache(tmp_path)


# -- non-finite numbers ---------------------------------------------------------------------------
def test_dumps_is_strict_json():
    text = dumps({"a": float("nan"), "b": [1.5, float("-inf")], "c": np.float32(2.5), "d": torch.tensor(float("inf"))})
    assert strict(text) == {"a": None, "b": [1.5, None], "c": 2.5, "d": None}


def test_a_diverged_run_stops_with_one_line(model, tmp_path, capsys, monkeypatch):
    """An update that blows the weights up (`--lr 1e30` once did; a learning rate above 1 is now
    refused at the flag, so the blow-up is made by hand): its evaluation is NaN: exit 2, one line
    naming the step; no final/, no DONE, metrics.jsonl strict JSON (null, not NaN)."""
    run, text = tmp_path / "run", corpus(tmp_path / "t.txt")
    argv = ["distill", str(model), "--out", str(run), "--text", str(text), "--steps", "4", "--json", *DISTILL]
    assert main(argv + ["--lr", "1e30"]) == 2 and "--lr 1e30: must be" in capsys.readouterr().err
    step = torch.optim.AdamW.step

    def blow_up(self, *a, **k):
        out = step(self, *a, **k)
        with torch.no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    p.mul_(1e30)
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", blow_up)
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    line = out.err.strip()
    assert len(line.splitlines()) == 1 and "step 1: the evaluation KL is nan" in line and "lower --lr" in line, line
    assert not (run / "final").exists() and not (run / "DONE").exists()
    rows = [strict(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["kind"] == "eval" and rows[-1]["eval_kl"] is None


def test_a_diverged_run_keeps_its_last_checkpoint(model, tmp_path, capsys, monkeypatch):
    from dtpshard.training import loop

    calls, accumulate = [], loop.accumulate

    def nan_at_step_3(*a, **k):
        calls.append(1)
        sums = accumulate(*a, **k)
        return sums * float("nan") if len(calls) == 3 else sums

    monkeypatch.setattr(loop, "accumulate", nan_at_step_3)
    run, text = tmp_path / "run", corpus(tmp_path / "t.txt")
    assert main(["distill", str(model), "--out", str(run), "--text", str(text), "--steps", "5", *DISTILL]) == 2
    one_line(capsys, "step 3: the loss is nan", "the checkpoint after step 2 is kept", "no student was written")
    assert torch.load(run / "checkpoint.pt", weights_only=False)["step"] == 2
    assert not (run / "final").exists() and not (run / "DONE").exists()
    for row in (run / "metrics.jsonl").read_text().splitlines():
        strict(row)


def _nan_weight(model):
    sd = load_file(str(model / "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(sd, str(model / "model.safetensors"), metadata={"format": "pt"})


def test_non_finite_weights_are_refused_by_name(model, tmp_path, tiny_dirs, capsys):
    _nan_weight(model)
    text = str(corpus(tmp_path / "t.txt"))
    for argv in (["generate", str(model), "--prompt", "hi", "--devices", "2"],
                 ["eval", str(model), "--devices", "2", "--text", text, "--blocks", "1", "--seq-len", "8", "--json"],
                 ["eval", str(tiny_dirs["llama"]), "--teacher", str(model), "--devices", "2", "--text", text,
                  "--blocks", "1", "--seq-len", "8"],
                 ["affinity", str(model), "--out", str(tmp_path / "a"), "--text", text, "--blocks", "1", "--seq-len",
                  "8", "--no-progress"],
                 ["affinity", str(model), "--out", str(tmp_path / "a"), "--text", text, "--blocks", "1", "--seq-len",
                  "8", "--no-progress", "--offload"]):
        assert main(argv) == 2
        out = capsys.readouterr()
        assert out.out == ""
        lines = [ln for ln in out.err.strip().splitlines() if "error:" in ln]
        assert len(lines) == 1 and "tensor model.layers.1.mlp.up_proj.weight holds NaN values" in lines[0], out.err
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("temperature", ["1e-30", "1e-45", "1e-300"])
def test_a_vanishing_temperature_decodes_greedily(tiny_dirs, capsys, temperature):
    base = ["generate", str(tiny_dirs["llama"]), "--prompt", "the model", "--devices", "2", "--max-new-tokens", "6",
            "--json"]
    assert main(base) == 0
    greedy = strict(capsys.readouterr().out)["new_token_ids"]
    assert main(base + ["--temperature", temperature, "--top-k", "5", "--top-p", "0.9"]) == 0
    assert strict(capsys.readouterr().out)["new_token_ids"] == greedy


# -- messages say what differs ----------------------------------------------------------------------
def test_eval_names_the_field_that_differs(tmp_path, tiny_dirs, capsys):
    from tiny import save_tiny

    small = save_tiny(tmp_path / "small", "llama", vocab_size=256)
    assert main(["eval", str(small), "--teacher", str(tiny_dirs["llama"]), "--devices", "2", "--blocks", "1",
                 "--seq-len", "8", "--text", str(corpus(tmp_path / "t.txt"))]) == 2
    one_line(capsys, "another shape than", "vocab=384 vs 256")


def test_changed_data_shows_both_hashes(model, tmp_path, capsys):
    run, text = tmp_path / "run", corpus(tmp_path / "t.txt")
    args = ["distill", str(model), "--out", str(run), "--text", str(text), "--steps", "1", *DISTILL]
    assert main(args) == 0
    text.write_text(text.read_text().replace("model", "layer"))
    assert main(args) == 2
    line = one_line(capsys, "train_data", "content changed (", "sha256 ")
    old, new = re.search(r"train_data .*?sha256 (\w+), now (\w+)", line).groups()
    assert old != new and str(text) in line


def test_an_offline_hub_dataset_is_one_line_at_once(monkeypatch, tiny_dirs):
    """Offline (by the environment, or no answer from the hub) the hub is never retried: a dataset
    not in the cache is one line, in well under a second."""
    from dtpshard.data import hub
    from dtpshard.data.blocks import load_texts, make_blocks
    from dtpshard.model.checkpoint import load_tokenizer

    seen = []

    def load_dataset(path, *a, **k):
        import huggingface_hub.constants as c

        seen.append(c.HF_HUB_OFFLINE)  # the load runs in offline mode
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    import huggingface_hub.constants as c

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)  # as imported without the variable
    for var in ("HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    tok = load_tokenizer(tiny_dirs["llama"])
    for env in ({"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9"}):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        t0 = time.perf_counter()
        with pytest.raises(UserError) as e:
            make_blocks(tok, load_texts(dataset="wikitext-2", role="eval"), 8, 1)
        assert time.perf_counter() - t0 < hub.PROBE_SECONDS and "\n" not in str(e.value)
        assert "offline (" in str(e.value) and "--text FILE" in str(e.value), e.value
    assert "no network" in str(e.value)
    assert seen == [True, True] and c.HF_HUB_OFFLINE is False  # offline inside the load only
