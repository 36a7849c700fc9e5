"""Issue 54, the third hostile sweep's false successes and tracebacks, each by the rule that covers
its class: config values typed before use (dtype too), --config plain data with text keys given
once, a checkpoint bound to its run and typed, a student's layout never applied twice, tokenizers
that cannot tokenize deterministically or within memory refused, numbers that overflow refused at
the flag, a write stopped by `ulimit -f` one line. Each refusal is one line, exit 2."""
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtpshard.cli import main
from test_config_values import GENERATE, edited, one_line
from test_distill import random_docs
from test_faults import DISTILL

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile3") / "docs.txt"
    path.write_text("\n\n".join(random_docs(200, 2)))
    return path


def distill_args(model, out, text, *extra):
    return ["distill", str(model), "--out", str(out), "--text", str(text), "--devices", "2", *DISTILL, *extra]


# -- config.json and --config ---------------------------------------------------------------------
@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
@pytest.mark.parametrize("value", ["banana", "float8_e4m3fn", 7])
def test_a_config_dtype_is_typed_before_use(tiny_dirs, tmp_path, capsys, key, value):
    model = edited(tiny_dirs["llama"], tmp_path / "m", **{key: value})
    assert main(["generate", str(model), *GENERATE]) == 2
    one_line(capsys, "config.json", key, "not a dtype dtpshard computes in")


def test_auto_map_on_a_built_in_model_type_is_refused(tiny_dirs, tmp_path, capsys):
    model = edited(tiny_dirs["llama"], tmp_path / "m", auto_map={"AutoModelForCausalLM": "modeling_mine.Mine"})
    (model / "modeling_mine.py").write_text("raise SystemExit('ran')\n")
    for argv in (["generate", str(model), *GENERATE], ["convert", str(model), "--devices", "2", "--plan",
                                                        "--out", str(tmp_path / "out")]):
        assert main(argv) == 2
        one_line(capsys, "auto_map", "never runs", "'llama'")


@pytest.mark.parametrize("text, words", [
    ("max_new_tokens: 2\nmax_new_tokens: 3\n", ("key 'max_new_tokens' appears twice",)),
    ('{"max_new_tokens": 2, "max_new_tokens": 3}', ("key 'max_new_tokens' appears twice",)),
    ("1: 2\n", ("key 1 is not text",)),
    ("~: 2\n", ("key None is not text",)),
    ("max_new_tokens: !!set {1, 2}\n", ("tag !!set is not plain data",)),
    ("prompt: !!binary aGVsbG8=\n", ("tag !!binary is not plain data",)),
    ("prompt: true\n", ("prompt", "is not text")),
    ("prompt: [1, 2]\n", ("prompt",)),
])
def test_config_files_are_plain_data_given_once(tiny_dirs, tmp_path, capsys, text, words):
    opts = tmp_path / "opts.yaml"
    opts.write_text(text)
    argv = ["generate", str(tiny_dirs["llama"]), "--devices", "2", "--delay", "1", "--device", "cpu"]
    assert main([*argv, "--config", str(opts)]) == 2
    one_line(capsys, f"--config {opts}", *words)


@pytest.mark.parametrize("flag, value", [("--lr", "1e300"), ("--lr", "2"), ("--adapter-alpha", "1e300"),
                                         ("--adapter-alpha", "1e-300")])
def test_numbers_that_overflow_or_train_nothing_are_refused(tiny_dirs, tmp_path, text, capsys, flag, value):
    out = tmp_path / "run"
    extra = [flag, value] + (["--adapters", "4"] if flag == "--adapter-alpha" else [])
    assert main(distill_args(tiny_dirs["llama"], out, text, *extra)) == 2
    one_line(capsys, flag)
    assert not out.exists()


# -- a checkpoint is bound to its run, and typed ---------------------------------------------------
def stopped(monkeypatch, model, out, text, *extra):
    """A run of 2 steps stopped right after its checkpoint of step 1, as a kill would leave it."""
    from dtpshard.training import loop

    real = loop._checkpoint

    def once(r, done):
        real(r, done)
        if done == 1:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(loop, "_checkpoint", once)
        assert main(distill_args(model, out, text, *extra)) == 130
    assert (out / "checkpoint.pt").is_file()
    return distill_args(model, out, text, *extra)


def test_a_checkpoint_copied_in_or_edited_is_refused(tiny_dirs, tmp_path, text, capsys, monkeypatch):
    from dtpshard.core.layout import Layout
    from dtpshard.model.dtp import DTPModel

    shape = DTPModel.from_pretrained(tiny_dirs["llama"], 1, 0).shape
    runs, argv = {}, {}
    for name, seed in (("mine", 3), ("other", 4)):
        layout = tmp_path / f"{name}.json"
        Layout.random(shape, 2, 1, seed=seed).save(layout)
        runs[name] = tmp_path / name
        argv[name] = stopped(monkeypatch, tiny_dirs["llama"], runs[name], text, "--layout", str(layout))
    capsys.readouterr()
    mine = runs["mine"] / "checkpoint.pt"
    own = mine.read_bytes()
    metrics = (runs["mine"] / "metrics.jsonl").read_bytes()
    state = torch.load(mine, weights_only=True)
    cases = [((runs["other"] / "checkpoint.pt").read_bytes(), "written by another run"),
             ({**state, "step": 1000000}, "not within this run's 1..2"),
             ({**state, "step": True}, "no valid 'step'"),
             ({k: v for k, v in state.items() if k != "scheduler"}, "no valid 'scheduler'"),
             ({**state, "student": {k: v[:1] for k, v in state["student"].items()}}, "has shape"),
             ({**state, "student": {}}, "has no tensor")]
    for case, words in cases:
        if isinstance(case, bytes):
            mine.write_bytes(case)
        else:
            torch.save(case, mine)
        assert main(argv["mine"]) == 2
        one_line(capsys, str(runs["mine"]), words, "--force")
        assert (runs["mine"] / "metrics.jsonl").read_bytes() == metrics and not (runs["mine"] / "final").exists()
    mine.write_bytes(own)
    assert main(argv["mine"]) == 0 and (runs["mine"] / "DONE").is_file()  # its own checkpoint: resumed


# -- a student's layout is its own ------------------------------------------------------------------
def test_a_student_is_never_permuted_again_by_another_layout(tiny_dirs, tmp_path, text, capsys):
    from dtpshard.core.layout import Layout
    from dtpshard.model.dtp import DTPModel

    run = tmp_path / "run"
    mine, other = tmp_path / "mine.json", tmp_path / "other.json"
    shape = DTPModel.from_pretrained(tiny_dirs["llama"], 1, 0).shape
    Layout.random(shape, 2, 1, seed=1).save(mine)
    Layout.random(shape, 2, 1, seed=2).save(other)
    assert main(distill_args(tiny_dirs["llama"], run, text, "--layout", str(mine))) == 0
    capsys.readouterr()
    student = run / "final"
    args = ["generate", str(student), "--prompt", "hello world", "--max-new-tokens", "3", "--device", "cpu"]
    assert main(args + ["--layout", str(other)]) == 2
    one_line(capsys, "another layout", "leave --layout out")
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--layout", str(mine)]) == 0  # its own: the same tokens, never applied twice
    assert capsys.readouterr().out == plain


# -- tokenizers ----------------------------------------------------------------------------------
def _tokenizer_edit(tiny_dirs, tmp_path, edit):
    model = edited(tiny_dirs["llama"], tmp_path / "m")
    tok = json.loads((model / "tokenizer.json").read_text())
    edit(tok)
    (model / "tokenizer.json").write_text(json.dumps(tok))
    return model


def test_bpe_dropout_is_refused(tiny_dirs, tmp_path, capsys):
    model = _tokenizer_edit(tiny_dirs, tmp_path, lambda t: t["model"].update(dropout=0.3))
    assert main(["generate", str(model), *GENERATE]) == 2
    one_line(capsys, "tokenizer.json", "dropout", "random")


def test_an_unknown_token_outside_the_vocab_is_refused(tiny_dirs, tmp_path, capsys):
    def word_level(t):
        t["model"] = {"type": "WordLevel", "vocab": {"a": 0, "b": 1}, "unk_token": "<unk>"}
        t["pre_tokenizer"] = {"type": "Whitespace"}
        t["decoder"] = None
    model = _tokenizer_edit(tiny_dirs, tmp_path, word_level)
    assert main(["generate", str(model), *GENERATE]) == 2
    one_line(capsys, "tokenizer.json", "unk_token", "not in its vocab")


def test_a_normalizer_that_grows_text_without_bound_is_refused(tiny_dirs, tmp_path):
    grow = {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"String": "e"}, "content": "E" * 200_000},
        {"type": "Replace", "pattern": {"String": "E"}, "content": "E" * 2_000}]}
    model = _tokenizer_edit(tiny_dirs, tmp_path, lambda t: t.update(normalizer=grow))
    out = subprocess.run([sys.executable, "-m", "dtpshard", "generate", str(model), *GENERATE], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "normalizer" in out.stderr and "times longer" in out.stderr


# -- data files ------------------------------------------------------------------------------------
def test_a_huge_integer_in_a_json_document_is_one_line(tiny_dirs, tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "hello world " * 20}) + "\n" + '{"text": "x", "n": ' + "9" * 5000 + "}\n")
    out = tmp_path / "aff.safetensors"
    assert main(["affinity", str(tiny_dirs["llama"]), "--out", str(out), "--text", str(docs), "--blocks", "1",
                 "--seq-len", "8", "--no-progress"]) == 2
    one_line(capsys, "docs.jsonl:2", "beyond any count")


def test_a_parquet_column_of_numbers_or_damaged_pages_is_named(tiny_dirs, tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": pa.array([1, 2, 3])}), numbers)
    damaged = tmp_path / "damaged.parquet"
    pq.write_table(pa.table({"text": pa.array(["hello world " * 50] * 20)}), damaged, compression="snappy")
    data = bytearray(damaged.read_bytes())
    for i in range(8, len(data) // 2):  # the first column chunk's pages, the footer kept
        data[i] ^= 0x5A
    damaged.write_bytes(bytes(data))
    for path, words in ((numbers, ("column 'text' holds int64, not text",)), (damaged, ("damaged.parquet",))):
        assert main(["affinity", str(tiny_dirs["llama"]), "--out", str(tmp_path / "a.safetensors"), "--text",
                     str(path), "--blocks", "1", "--seq-len", "8", "--no-progress"]) == 2
        one_line(capsys, *words)


# -- `ulimit -f` -----------------------------------------------------------------------------------
def test_a_checkpoint_past_the_file_size_limit_is_one_line(tiny_dirs, tmp_path, text):
    out = tmp_path / "run"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))

    proc = subprocess.run([sys.executable, "-m", "dtpshard", *distill_args(tiny_dirs["llama"], out, text)],
                          capture_output=True, text=True, timeout=300, preexec_fn=limit,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    err = [ln for ln in proc.stderr.strip().splitlines() if "Traceback" in ln or "error" in ln]
    assert proc.returncode != 0 and len(err) == 1 and "file-size limit" in err[0], proc.stderr[-2000:]
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


# -- smaller ---------------------------------------------------------------------------------------
def test_serving_commands_are_shell_words_whatever_the_path():
    import shlex

    from dtpshard.model.student import serving_commands

    odd = "/tmp/my student's $(dir)"
    cmds = serving_commands(odd, 2, "float32")
    for key in ("vllm", "vllm_cpu", "dtpshard"):
        assert odd in shlex.split(cmds[key]), cmds[key]


def test_affinity_refuses_a_foreign_out_before_any_work(tiny_dirs, tmp_path, capsys, monkeypatch):
    mine = tmp_path / "mine.safetensors"
    mine.write_bytes(b"not an affinity file")

    def never(*a, **k):
        raise AssertionError("the text was read before --out was checked")

    monkeypatch.setattr("dtpshard.affinity.calibrate.load_texts", never)
    assert main(["affinity", str(tiny_dirs["llama"]), "--out", str(mine), "--blocks", "1", "--seq-len", "8",
                 "--no-progress"]) == 2
    one_line(capsys, str(mine), "is not an affinity file")
    assert mine.read_bytes() == b"not an affinity file"


def test_the_readme_stays_a_map():
    assert len((ROOT / "README.md").read_text().split()) <= 2500


def test_a_planted_segment_with_an_impossible_pid_breaks_nothing(tmp_path, monkeypatch):
    from dtpshard.transport import shared

    monkeypatch.setattr(shared, "SEGMENTS", tmp_path)
    planted = tmp_path / f"dtpshard-exchange-{10 ** 30}-{'a' * 16}"
    planted.write_bytes(b"mine")
    dead = tmp_path / f"dtpshard-exchange-{2 ** 22}-{'b' * 16}"  # no process has pid_max's largest value here
    dead.write_bytes(b"")
    assert shared.remove_leftovers() in ([dead], [])  # no OverflowError; what no process made is left alone
    assert planted.read_bytes() == b"mine"
