"""A student loads as DTP wherever it loads: transformers' remote code (model_type "dtp", auto_map,
configuration_dtp.py and modeling_dtp.py importing dtpshard), never a silent dense load; the old
student format still reads in dtpshard; the model card carries the run's numbers; a permuted
checkpoint stays a plain checkpoint. Students come from 2-step distills of the tiny models.

transformers' modules cache (HF_MODULES_CACHE) is the session's temporary directory (conftest.py).
The same checks under transformers 4.56, the oldest dtpshard accepts, run in a subprocess when
DTPSHARD_TRANSFORMERS_OLD names a directory holding it (`pip install --no-deps --target DIR
"transformers==4.56.*" "tokenizers>=0.22,<=0.23.0" "huggingface_hub>=0.34,<1.0"`: 4.56 refuses
the newer tokenizers and huggingface_hub installed beside transformers 5)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtpshard.cli import main
from dtpshard.core.io import file_sha256
from dtpshard.core.layout import Layout
from dtpshard.model.checkpoint import load_tokenizer, save_checkpoint
from dtpshard.model.dtp import DTPModel
from dtpshard.model.shards import Weights
from dtpshard.model.student import AUTO_MAP, REMOTE_CODE
from dtpshard.training import rundir
from test_distill import random_docs

HERE = Path(__file__).parent
CASES = [("llama", 2, 1), ("llama", 4, 2), ("qwen3", 2, 2), ("qwen3", 4, 1), ("phi3", 2, 1), ("granite", 2, 1.5)]
PROMPT = "import torch"


def ids_for(B=2, T=11, seed=0):
    return torch.randint(0, 384, (B, T), generator=torch.Generator().manual_seed(seed))


def distill(teacher, out, root, *extra):
    args = ["distill", str(teacher), "--out", str(out), "--steps", "2", "--seq-len", "16", "--eval-blocks", "1",
            "--micro-batch", "1", "--grad-accum", "1", "--lr", "1e-3", "--warmup", "1",
            "--text", str(root / "docs.txt"), "--eval-text", str(root / "docs.txt"), "--no-progress", "--device", "cpu",
            *extra]
    assert main(args) == 0
    return out / rundir.FINAL


@pytest.fixture(scope="module")
def root(tiny_dirs, tmp_path_factory):
    """Teachers with a Hub-style README (a license in its front matter), a scored layout, text."""
    root = tmp_path_factory.mktemp("remote")
    (root / "docs.txt").write_text("\n\n".join(random_docs(120, 4)))
    for family in sorted({c[0] for c in CASES}):
        shutil.copytree(tiny_dirs[family], root / family)
        (root / family / "README.md").write_text("---\nlicense: apache-2.0\nlanguage: [en]\n---\n# tiny\n")
    layout = Layout.random(DTPModel.from_pretrained(root / "llama", 1, 0).shape, devices=2, delay=1, seed=3)
    layout.score = {"J": 12.345, "random_expectation": 10.5}  # what `dtpshard layout` records
    layout.save(root / "layout.json")
    return root


@pytest.fixture(scope="module")
def students(root):
    """(family, L, δ) -> RUN/final of a 2-step distill; llama L = 2, δ = 1 with the scored layout."""
    out = {}
    for family, devices, delay in CASES:
        run = root / f"run-{family}-{devices}-{delay}"
        extra = ["--layout", str(root / "layout.json")] if (family, devices, delay) == CASES[0] else []
        out[family, devices, delay] = distill(root / family, run, root, "--devices", str(devices), "--delay",
                                              str(delay), *extra)
    return out


def remote(path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True, **kw).eval()


def test_student_directory_is_the_new_format(students):
    import transformers.dynamic_module_utils as dmu

    assert dmu.HF_MODULES_CACHE == os.environ["HF_MODULES_CACHE"]  # the session's temporary directory
    final = students[CASES[0]]
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["model_type"] == "dtp" and cfg["architectures"] == ["DTPForCausalLM"] and cfg["auto_map"] == AUTO_MAP
    assert cfg["dtp"] == {"family": "llama", "devices": 2, "delay": 1, "stage3": "sqrt",
                          "layout_sha256": Layout.load(students[CASES[0]].parents[1] / "layout.json").content_sha256()}
    assert cfg["hidden_size"] == 64 and cfg["tie_word_embeddings"] is False  # the family's fields, flat
    for name, text in REMOTE_CODE.items():  # thin: they import dtpshard, nothing else
        assert (final / name).read_text() == text
        assert {line.split()[1] for line in text.splitlines() if line.startswith(("import ", "from "))} == {
            "dtpshard.model.remote"}
    assert not (final / "dtp.json").exists()  # config.json is the one record now


def test_without_remote_code_transformers_refuses(students, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    final = students[CASES[0]]
    for load in (AutoModelForCausalLM.from_pretrained, AutoConfig.from_pretrained):
        for trust in (False, None):  # None: transformers asks (on stdout), and without a terminal refuses
            with pytest.raises(ValueError, match="contains custom code"):
                load(str(final), trust_remote_code=trust)
    capsys.readouterr()


def test_tokenizer_loads_without_asking(students, capsys):
    """dtpshard reads a student's tokenizer with its family's config: transformers does not ask
    (on stdout, which --json keeps for its one object) to run the remote code to pick the class."""
    from transformers import AutoTokenizer

    final = students[CASES[0]]
    ids = load_tokenizer(final)(PROMPT).input_ids
    assert capsys.readouterr().out == ""
    assert AutoTokenizer.from_pretrained(str(final), trust_remote_code=True)(PROMPT).input_ids == ids


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-L{c[1]}-d{c[2]}")
def test_remote_code_computes_the_students_function(students, case, capsys):
    final = students[case]
    ref = DTPModel.from_pretrained(final)
    assert (ref.devices, ref.delay) == case[1:]
    hf = remote(final, dtype=torch.float32)
    assert type(hf).__name__ == "DTPForCausalLM" and hf.dtype == torch.float32
    ids = ids_for()
    with torch.no_grad():
        want = ref(ids).logits
        assert (hf(ids).logits - want).abs().max().item() <= 1e-6
        assert hf(ids, labels=ids).loss.item() == pytest.approx(ref(ids, labels=ids).loss.item(), abs=1e-6)
        assert (DTPModel.from_pretrained(final, 1, 0)(ids).logits - want).abs().max().item() > 1e-2  # not dense
    # greedy generate() gives `dtpshard generate`'s tokens
    assert main(["generate", str(final), "--prompt", PROMPT, "--max-new-tokens", "12", "--json", "--device",
                 "cpu"]) == 0
    cli = json.loads(capsys.readouterr().out)
    prompt = load_tokenizer(final)(PROMPT, return_tensors="pt").input_ids
    out = hf.generate(prompt, max_new_tokens=12, do_sample=False)
    assert out[0, prompt.shape[1]:].tolist() == cli["new_token_ids"] and len(cli["new_token_ids"]) > 0


def test_left_padded_generate_equals_dtpmodel(students):
    final = students["qwen3", 4, 1]
    hf, ref = remote(final, dtype=torch.float32), DTPModel.from_pretrained(final)
    ids = ids_for(2, 8, seed=5)
    mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    ids[1, :3] = 0
    got = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(got, ref.generate(ids, max_new_tokens=6, attention_mask=mask, eos_token_id=-1))


def test_dtype_and_torch_dtype_are_honoured(students):
    final = students["llama", 4, 2]
    ids = ids_for()
    want = DTPModel.from_pretrained(final, dtype="bfloat16")
    for kw in ({"dtype": torch.bfloat16}, {"torch_dtype": torch.bfloat16}):
        hf = remote(final, **kw)
        assert hf.dtype == torch.bfloat16
        with torch.no_grad():
            assert torch.equal(hf(ids).logits, want(ids).logits)
    assert remote(final).dtype == torch.float32  # dtype "auto": the weights as saved


def test_save_pretrained_round_trips(students, tmp_path):
    final = students["qwen3", 2, 2]
    hf = remote(final, dtype=torch.float32)
    hf.save_pretrained(str(tmp_path / "again"))
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert saved["model_type"] == "dtp" and saved["auto_map"] == AUTO_MAP and saved["dtp"]["family"] == "qwen3"
    for name, text in REMOTE_CODE.items():  # transformers copied the thin files, not dtpshard's source
        assert (tmp_path / "again" / name).read_text() == text
    ids = ids_for()
    with torch.no_grad():
        want = hf(ids).logits
        assert torch.equal(remote(tmp_path / "again", dtype=torch.float32)(ids).logits, want)
        assert torch.equal(DTPModel.from_pretrained(tmp_path / "again")(ids).logits, want)


def test_dtpshard_save_pretrained_round_trips(students, tmp_path):
    final = students["llama", 2, 1]
    model = DTPModel.from_pretrained(final)
    model.save_pretrained(tmp_path / "again", source=final)
    config = json.loads((final / "config.json").read_text())
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == config
    ids = ids_for()
    with torch.no_grad():
        assert torch.equal(DTPModel.from_pretrained(tmp_path / "again")(ids).logits, model(ids).logits)


def test_without_dtpshard_transformers_says_it_is_required(students):
    """transformers' own import check of the remote file, in a process where dtpshard cannot be
    imported (a finder that hides it, as if it were not installed)."""
    code = f"""
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "dtpshard":
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Hide())
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained({str(students[CASES[0]])!r}, trust_remote_code=True)
except ImportError as e:
    print("ImportError:", e)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert "requires the following packages that were not found in your environment: dtpshard" in p.stdout, \
        p.stdout + p.stderr[-2000:]


def _old_format(student, out, dtp_json_only=False):
    """The student as distill wrote it before model_type "dtp": the family's config.json with a
    `dtp` block (and dtp.json), or a dtp.json alone (the first students)."""
    from dtpshard.core.shape import family_config

    model = DTPModel.from_pretrained(student)
    config = family_config(model.config)
    block = model.dtp_block()
    if not dtp_json_only:
        config.dtp = block
    save_checkpoint(out, config, Weights.of(model.state_dict()), student, extra_json={"dtp.json": block})
    return model


@pytest.mark.parametrize("dtp_json_only", [False, True])
def test_old_format_student_still_loads_in_dtpshard(students, tmp_path, capsys, dtp_json_only):
    new = students["qwen3", 4, 1]
    old = tmp_path / "old"
    model = _old_format(new, old, dtp_json_only)
    assert json.loads((old / "config.json").read_text())["model_type"] == "qwen3"
    again = DTPModel.from_pretrained(old)
    assert again.dtp_settings() == model.dtp_settings() and again.layout_sha256 == model.layout_sha256
    ids = ids_for()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    got = {}
    for path in (new, old):
        assert main(["generate", str(path), "--prompt", PROMPT, "--max-new-tokens", "6", "--json", "--device",
                     "cpu"]) == 0
        got[path] = json.loads(capsys.readouterr().out)
    assert got[new]["new_token_ids"] == got[old]["new_token_ids"] and got[old]["devices"] == 4


def test_card_carries_the_runs_numbers(students, root):
    final = students[CASES[0]]
    card = (final / "README.md").read_text()
    front = card.split("---\n")[1]
    assert "license: apache-2.0" in front and "library_name: transformers" in front and "base_model: llama" in front
    assert "- dtp\n" in front and "- delayed-tensor-parallelism\n" in front
    evals = [r for r in rundir.read_metrics(final.parent) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        assert f"{r['eval_kl']:.4f}" in card and f"{r['eval_ppl']:.3f}" in card
    assert f"`model.safetensors` {file_sha256(root / 'llama' / 'model.safetensors')}" in card
    assert "J = 12.35" in card and "kind random" in card and "L = 2, δ = 1, stage 3 `sqrt`" in card
    assert "2 steps × 16 tokens = 32 tokens" in card and "text:" in card
    assert "trust_remote_code=True" in card and "dtpshard generate DIR" in card
    assert "torchrun --nproc-per-node 2 -m dtpshard run DIR" in card and "LlamaForCausalLM" in card
    assert "experiment report" not in card  # a run of its own


def test_card_of_an_experiments_run_names_its_report(students, root, tmp_path):
    """A run of `dtpshard experiment` (DIR/runs/NAME-sSEED) takes the teacher's hashes from the
    experiment's provenance.json and names DIR/report.md."""
    from dtpshard.training.card import TeacherHashes, student_card

    exp = tmp_path / "exp"
    run = exp / "runs" / "optimised-s0"
    run.mkdir(parents=True)
    for name in (rundir.CONFIG, rundir.METRICS):
        shutil.copy(students[CASES[0]].parent / name, run / name)
    (exp / "config.json").write_text(json.dumps({"format": "dtpshard.experiment/1"}))
    (exp / "provenance.json").write_text(json.dumps({"model": str(root / "llama"),
                                                     "model_files": {"model.safetensors": "f" * 64}}))
    hashes = TeacherHashes(root / "llama", run)
    assert hashes.thread is None  # nothing hashed again
    card = student_card(run, {"family": "llama", "devices": 2, "delay": 1, "stage3": "sqrt"}, hashes)
    assert "`../../../report.md`" in card and "`model.safetensors` " + "f" * 64 in card  # relative to the card


def test_permuted_checkpoint_loads_in_plain_transformers(root, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "permuted"
    assert main(["permute", str(root / "llama"), str(root / "layout.json"), "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "auto_map" not in cfg and not (out / "modeling_dtp.py").exists()
    kw = {"dtype": torch.float32, "trust_remote_code": False}
    ids = ids_for()
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(str(out), **kw)(ids).logits
        want = AutoModelForCausalLM.from_pretrained(str(root / "llama"), **kw)(ids).logits
    assert (got - want).abs().max().item() <= 1e-4


def test_oldest_transformers(tmp_path):
    """The remote-code checks (tests/remote_check.py) under transformers 4.56, in a subprocess."""
    old = os.environ.get("DTPSHARD_TRANSFORMERS_OLD")
    if not old:
        pytest.skip("transformers 4.56 not given: set DTPSHARD_TRANSFORMERS_OLD to a --target directory holding it "
                    "(module docstring)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([old, os.environ["PYTHONPATH"]]),
           "HF_MODULES_CACHE": str(tmp_path / "modules")}
    p = subprocess.run([sys.executable, str(HERE / "remote_check.py"), str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["transformers"].startswith("4.56"), result["transformers"]
    for case in result["cases"]:
        assert "custom code" in case["refused"], case
        assert case["max_abs_diff"] <= 1e-6 and case["dense_diff"] > 1e-2 and case["same_tokens"], case
        assert case["bf16"] == "torch.bfloat16" and case["bf16_equal"], case
        assert case["resaved_diff"] <= 1e-6 and case["resaved_in_dtpshard_diff"] <= 1e-6, case
        assert {"configuration_dtp.py", "modeling_dtp.py"} <= set(case["resaved_files"]), case


def test_partial_student_everywhere(root, tmp_path, capsys):
    """A student with only some modules delayed (distill --delayed) records the set, and
    transformers' remote code, DTPModel and `dtpshard generate` compute its function, which is the
    transcription's (tests/reference.py); a resume with another set is refused in one line."""
    from types import SimpleNamespace

    from reference import literal_dtp_logits

    final = distill(root / "llama", tmp_path / "run", root, "--devices", "2", "--delay", "1", "--delayed", "1", "2",
                    "4")
    capsys.readouterr()
    block = json.loads((final / "config.json").read_text())["dtp"]
    assert block["delayed"] == [1, 2, 4]
    ref = DTPModel.from_pretrained(final)
    assert ref.settings.delayed == (1, 2, 4)
    hf = remote(final, dtype=torch.float32)
    ids = ids_for()
    with torch.no_grad():
        want = ref(ids).logits
        assert (hf(ids).logits - want).abs().max().item() <= 1e-6
        assert (DTPModel.from_pretrained(final, 1, 0)(ids).logits - want).abs().max().item() > 1e-3  # not dense
        weights = SimpleNamespace(state_dict=ref.state_dict, config=ref.config.base_config())
        assert (literal_dtp_logits(weights, ids, 2, 1, delayed=(1, 2, 4)) - want).abs().max().item() <= 1e-4
    assert "Only 3 modules are delayed (1-2,4;" in (final / "README.md").read_text()
    assert main(["generate", str(final), "--prompt", PROMPT, "--max-new-tokens", "8", "--json", "--device",
                 "cpu"]) == 0
    cli = json.loads(capsys.readouterr().out)
    prompt = load_tokenizer(final)(PROMPT, return_tensors="pt").input_ids
    out = hf.generate(prompt, max_new_tokens=8, do_sample=False)
    assert out[0, prompt.shape[1]:].tolist() == cli["new_token_ids"]
    rc = main(["distill", str(root / "llama"), "--out", str(tmp_path / "run"), "--steps", "2", "--seq-len", "16",
               "--devices", "2", "--delay", "1", "--delayed", "1", "2", "--eval-blocks", "1", "--micro-batch", "1",
               "--grad-accum", "1", "--lr", "1e-3", "--warmup", "1", "--text", str(root / "docs.txt"),
               "--eval-text", str(root / "docs.txt"), "--no-progress", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "delayed" in err and len(err.strip().splitlines()) == 1, err
