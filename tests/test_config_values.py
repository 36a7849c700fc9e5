"""Issue 46, class "ended in a traceback": config values are typed before anything reads them
(transformers' errors, StrictDataclassError included, are one line; --config values are checked
as command-line words and a nested `config:` key is refused), tokenizers are data even when they
panic, and a refusal quotes at most 200 characters and names the file it could not write."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dtpshard.cli import main

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ["--devices", "2", "--delay", "1", "--prompt", "hello world", "--max-new-tokens", "2", "--device", "cpu"]


def edited(src, dst, name="config.json", **values):
    shutil.copytree(src, dst)
    data = json.loads((dst / name).read_text())
    data.update(values)
    (dst / name).write_text(json.dumps(data))
    return dst


def one_line(capsys, *words):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and all(w in err[0] for w in words), (words, err)
    return err[0]


@pytest.mark.parametrize("family, key, value", [("granite", "embedding_multiplier", "3.0"),
                                                ("phi3", "partial_rotary_factor", float("nan")),
                                                ("llama", "eos_token_id", "x"),
                                                ("phi3", "sliding_window", "11")])
def test_wrongly_typed_config_values_are_one_line(tiny_dirs, tmp_path, capsys, family, key, value):
    model = edited(tiny_dirs[family], tmp_path / "m", **{key: value})
    assert main(["generate", str(model), *GENERATE]) == 2
    one_line(capsys, "config.json", key)


def test_convert_plan_refuses_a_wrongly_typed_window(tiny_dirs, tmp_path, capsys):
    model = edited(tiny_dirs["phi3"], tmp_path / "m", sliding_window="11")
    assert main(["convert", str(model), "--devices", "2", "--out", str(tmp_path / "out"), "--plan"]) == 2
    one_line(capsys, "config.json", "sliding_window")


def _options(tmp_path, text):
    path = tmp_path / "opts.json"
    path.write_text(text)
    return path


def test_a_nested_config_key_is_refused_not_ignored(tiny_dirs, tmp_path, capsys):
    (tmp_path / "inner.yaml").write_text("prompt: hello\n")
    opts = _options(tmp_path, json.dumps({"config": str(tmp_path / "inner.yaml")}))
    assert main(["generate", str(tiny_dirs["llama"]), *GENERATE, "--config", str(opts)]) == 2
    one_line(capsys, f"--config {opts}", "key 'config'")


@pytest.mark.parametrize("text, words", [('{"prompt": "\\ud800"}', ["prompt", "not UTF-8 text"]),
                                         ('{"prompt": "%s"}' % ("a" * (1 << 17 + 1)), ["prompt", "longer than"])],
                         ids=["lone-surrogate", "too-long"])
def test_config_values_are_checked_as_command_line_words(tiny_dirs, tmp_path, capsys, text, words):
    opts = _options(tmp_path, text)
    args = [a for a in GENERATE if a not in ("--prompt", "hello world")]
    assert main(["generate", str(tiny_dirs["llama"]), *args, "--config", str(opts)]) == 2
    one_line(capsys, f"--config {opts}", *words)


def _run(args, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RUST_BACKTRACE": "1"}
    return subprocess.run([sys.executable, "-m", "dtpshard", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env, **kw)


def test_a_tokenizer_panic_is_one_line_naming_the_file(tiny_dirs, tmp_path):
    """A normalizer regex that backtracks: Oniguruma gives up, and tokenizers panics (a BaseException)."""
    model = edited(tiny_dirs["llama"], tmp_path / "m", name="tokenizer.json",
                   normalizer={"type": "Replace", "pattern": {"Regex": "(a+)+$"}, "content": "b"})
    out = _run(["generate", model, *GENERATE[:-4], "--prompt", "a" * 40 + "!", "--max-new-tokens", "2"])
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(model / "tokenizer.json") in lines[0] and "tokenizers" in lines[0], out.stderr


def test_a_tokenizer_class_that_is_not_a_tokenizer_is_one_line(tiny_dirs, tmp_path, capsys):
    model = edited(tiny_dirs["llama"], tmp_path / "m", name="tokenizer_config.json", tokenizer_class="LlamaConfig")
    assert main(["generate", str(model), *GENERATE]) == 2
    one_line(capsys, str(model))


def test_a_lone_surrogate_in_json_text_is_refused_by_file_and_line(tiny_dirs, tmp_path, capsys):
    text = tmp_path / "docs.jsonl"
    text.write_text('{"text": "the quick brown fox"}\n{"text": "a \\ud800 b"}\n')
    assert main(["affinity", str(tiny_dirs["llama"]), "--text", str(text), "--out", str(tmp_path / "a.safetensors"),
                 "--blocks", "1", "--seq-len", "8", "--no-progress"]) == 2
    one_line(capsys, f"{text}:2:", "lone surrogate")


def test_a_huge_delay_is_quoted_short(tiny_dirs, capsys):
    assert main(["generate", str(tiny_dirs["llama"]), "--devices", "2", "--delay", "1e308", "--prompt", "hi"]) == 2
    line = one_line(capsys, "delay", "1e+308")
    assert len(line) < 300


def test_a_file_size_limit_names_the_file(tiny_dirs, tmp_path):
    """`ulimit -f`: the write fails with EFBIG (Python ignores SIGXFSZ); the refusal names the file."""
    out_file = tmp_path / "a.safetensors"
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    args = ["affinity", tiny_dirs["llama"], "--text", text, "--out", out_file, "--blocks", "2", "--seq-len", "16",
            "--no-progress"]
    code = "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); " \
           "sys.argv = ['dtpshard', *sys.argv[1:]]; runpy.run_module('dtpshard', run_name='__main__')"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]  # after the pass's plan line
    assert "Traceback" not in out.stderr and last.startswith("dtpshard affinity: error: "), out.stderr
    assert "a.safetensors" in last and "ulimit -f" in last, out.stderr
    assert not out_file.exists()
