"""Bad files and faults: each known failure is one line naming the file or flag, exit 2, no
traceback and nothing written; a run directory has one owner; --force always starts over."""
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dtpshard.cli import main
from test_experiment import config_text, corpus
from test_report import make_experiment
from tiny import save_tiny

ROOT = Path(__file__).resolve().parents[1]
DISTILL = ["--steps", "2", "--seq-len", "8", "--micro-batch", "1", "--grad-accum", "1", "--eval-blocks", "1",
           "--eval-every", "1", "--checkpoint-every", "1", "--device", "cpu", "--no-progress"]


def tree(root: Path) -> dict[str, int]:
    """Every path under root, files with their modification time: 'nothing written' compares two."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns if p.is_file() else 0 for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_dirs):
    """One directory of inputs, good and broken; every case copies what it breaks."""
    w = tmp_path_factory.mktemp("faults")
    model = tiny_dirs["llama"]
    corpus(w / "good.txt")
    (w / "latin1.txt").write_bytes("caf\xe9 na\xefve d\xe9j\xe0 vu.\n\n".encode("latin-1") * 40)
    (w / "latin1.jsonl").write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1") * 40)

    def broken(name, how):
        d = w / name
        shutil.copytree(model, d)
        how(d)
        return d

    st = (model / "model.safetensors").read_bytes()
    broken("truncated", lambda d: (d / "model.safetensors").write_bytes(st[: len(st) // 2]))
    broken("bad_index", lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": {'))

    def wider(d):
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**c, "intermediate_size": 128}))

    broken("wider", wider)
    broken("bad_dtp", lambda d: (d / "dtp.json").write_text('{"devices": 2,'))
    small = save_tiny(w / "small_vocab", "llama", vocab_size=128)  # with the 384-token tokenizer below
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / f, small / f)
    from dtpshard.affinity.file import Affinity, edges_for_delay
    from dtpshard.model.checkpoint import read_shape

    shape = read_shape(model)
    rng = np.random.default_rng(0)
    edges = {(a, b): rng.random((shape.units(a), shape.units(b))) for a, b in edges_for_delay(shape.modules, 1)}
    Affinity(shape, 1, edges, tokens=8).save(w / "aff.safetensors")
    (w / "study.toml").write_text(config_text(model, w / "missing.txt"))
    return w


def _exp(w, edit):
    d = w / "exp_cases" / f"e{random.random():.9f}"
    make_experiment(d)
    edit(d)
    return d


def _write(rel, text):
    return lambda d: (d / rel).write_bytes(text if isinstance(text, bytes) else text.encode())


# (argv with {w} for the inputs directory and {o} for the output, words the one line must contain)
CASES = {
    "truncated safetensors": (["generate", "{w}/truncated", "--prompt", "hi"],
                              ["truncated/model.safetensors", "truncated"]),
    "malformed index": (["generate", "{w}/bad_index", "--prompt", "hi"], ["model.safetensors.index.json", "JSON"]),
    "intermediate_size": (["generate", "{w}/wider", "--prompt", "hi"],
                          ["wider", "mlp.down_proj.weight", "[64, 96]", "[64, 128]", "config.json"]),
    "malformed dtp.json": (["generate", "{w}/bad_dtp", "--prompt", "hi"], ["bad_dtp/dtp.json", "JSON"]),
    "vocab generate": (["generate", "{w}/small_vocab", "--prompt", "import torch as t; x = t.zeros(3)"],
                       ["small_vocab", "vocab_size is 128"]),
    "vocab distill": (["distill", "{w}/small_vocab", "--out", "{o}/run", "--text", "{w}/good.txt",
                       "--eval-text", "{w}/good.txt", *DISTILL], ["small_vocab", "vocab_size is 128"]),
    "truncated teacher": (["distill", "{w}/truncated", "--out", "{o}/run", "--text", "{w}/good.txt", *DISTILL],
                          ["truncated/model.safetensors"]),
    "latin-1 --text": (["distill", "{m}", "--out", "{o}/run", "--text", "{w}/latin1.txt", "--eval-text",
                        "{w}/good.txt", *DISTILL], ["latin1.txt", "UTF-8"]),
    "latin-1 --eval-text": (["distill", "{m}", "--out", "{o}/run", "--text", "{w}/good.txt", "--eval-text",
                             "{w}/latin1.jsonl", *DISTILL], ["latin1.jsonl", "UTF-8"]),
    "generate past the context": (["generate", "{m}", "--prompt", "the layer", "--devices", "2", "--max-new-tokens",
                                   "300", "--device", "cpu"], ["--max-new-tokens 300", "context of 256 positions"]),
    "run past the context": (["run", "{m}", "--prompt", "the layer", "--max-new-tokens", "300", "--nproc", "2"],
                             ["--max-new-tokens 300", "context of 256 positions"]),
    "layout delay > modules": (["layout", "{m}", "--out", "{o}/l.json", "--kind", "contiguous", "--delay", "7"],
                               ["delay=7", "M=6"]),
    "layout delay < 1 from affinity": (["layout", "{w}/aff.safetensors", "--out", "{o}/l.json", "--delay", "0.5"],
                                       ["--delay 0.5", "no edges"]),
    "experiment missing calibration text": (["experiment", "{w}/study.toml", "--out", "{o}/exp"],
                                            ["calibration.text", "missing.txt"]),
}
REPORT_CASES = {
    "config.json malformed": (_write("config.json", "{"), ["config.json", "JSON"]),
    "config.json steps edited": (_write("config.json", '{"training": {"steps": "100"}}'), ["config.json", "steps"]),
    "layout J edited": (_write("layouts/optimised.json", '{"kind": "optimised", "score": {"J": "high"}}'),
                        ["layouts/optimised.json", "'J'"]),
    "layout not an object": (_write("layouts/anti.json", "[1, 2]"), ["layouts/anti.json", "JSON object"]),
    "zeroshot list": (_write("zeroshot.json", "[]"), ["zeroshot.json", "JSON object"]),
    "zeroshot kl edited": (_write("zeroshot.json", '{"anti": {"kl": "low"}}'), ["zeroshot.json", "'kl'"]),
    "scores.json edited": (_write("scores.json", '{"anti": {"ablation": "big"}}'), ["scores.json", "'ablation'"]),
    "timings.json edited": (_write("timings.json", '{"zero-shot": [1]}'), ["timings.json", "'zero-shot'"]),
    "provenance.json edited": (_write("provenance.json", '{"versions": ["torch"]}'), ["provenance.json", "'versions'"]),
    "metrics line edited": (lambda d: (d / "runs/optimised-s0/metrics.jsonl").write_text(
        '{"kind": "eval", "step": 0, "eval_kl": 1}\nnot json\n{"kind": "eval", "step": 1}\n'),
        ["runs/optimised-s0/metrics.jsonl:2"]),
    "metrics eval_kl edited": (
        _write("runs/random-0-s0/metrics.jsonl", '{"kind": "eval", "step": 0, "eval_kl": "x"}\n'),
                               ["runs/random-0-s0/metrics.jsonl", "eval_kl"]),
    "metrics latin-1": (_write("runs/contiguous-s1/metrics.jsonl", '{"kind": "eval", "step": 0, "x": "\xe9"}\n'
                               .encode("latin-1")), ["runs/contiguous-s1/metrics.jsonl", "UTF-8"]),
}


def refused(capsys, argv, words, watched: Path):
    before = tree(watched)
    rc = main(argv)  # a traceback would raise out of main instead of returning
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, (word, err)
    assert tree(watched) == before, "something was written"
    return err


@pytest.mark.parametrize("case", CASES)
def test_refused_in_one_line_writing_nothing(world, tiny_dirs, tmp_path, capsys, case):
    argv, words = CASES[case]
    argv = [a.format(w=world, o=tmp_path, m=tiny_dirs["llama"]) for a in argv]
    refused(capsys, argv, words, tmp_path)
    assert not any(world.rglob(".*tmp-*"))


@pytest.mark.parametrize("case", REPORT_CASES)
def test_report_names_the_bad_file(world, capsys, case):
    edit, words = REPORT_CASES[case]
    d = _exp(world, edit)
    refused(capsys, ["report", str(d)], words, d)


def test_report_of_the_intact_experiment_works(world, capsys):
    d = _exp(world, lambda d: None)  # the cases above break a working directory
    assert main(["report", str(d)]) == 0


# -- processes: permissions, the run-directory lock --------------------------------------------
def cli(*args, timeout=300, drop_dac=False, **kw):
    """`python -m dtpshard ARGS` in a fresh process; drop_dac: without root's power to ignore
    file permissions (CAP_DAC_OVERRIDE), so a chmod means for root what it means for anyone."""
    cmd = [sys.executable, "-m", "dtpshard", *map(str, args)]
    if drop_dac and os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: file permissions cannot be tested")
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)


def one_line(p, *words):
    err = p.stderr.strip()
    assert p.returncode == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)


def test_permissions(world, tiny_dirs, tmp_path):
    """An unreadable --text, then an --out under a directory that cannot be written: one line each."""
    secret = tmp_path / "secret.txt"
    shutil.copy(world / "good.txt", secret)
    secret.chmod(0)
    locked_dir = tmp_path / "ro"
    locked_dir.mkdir()
    locked_dir.chmod(0o555)
    model = tiny_dirs["llama"]
    try:
        p = cli("distill", model, "--out", tmp_path / "run", "--text", secret, "--eval-text", world / "good.txt",
                *DISTILL, drop_dac=True)
        one_line(p, "permission denied", "secret.txt")
        assert not (tmp_path / "run").exists()
        p = cli("distill", model, "--out", locked_dir / "run", "--text", world / "good.txt", "--eval-text",
                world / "good.txt", *DISTILL, drop_dac=True)
        one_line(p, str(locked_dir), "permission denied")
        assert list(locked_dir.iterdir()) == []
    finally:
        locked_dir.chmod(0o755)


def test_second_process_on_a_run_is_refused(tiny_dirs, world, tmp_path, capsys):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from dtpshard.training.rundir import locked\n"
        f"with locked({str(run)!r}):\n    print('held', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        p = cli("distill", tiny_dirs["llama"], "--out", run, "--text", world / "good.txt", *DISTILL)
        one_line(p, f"{run} is in use by process {holder.pid}")
        assert [x.name for x in run.iterdir()] == [".lock"]  # the other run's directory untouched
        (tmp_path / "study.toml").write_text(config_text(tiny_dirs["llama"], world / "good.txt"))
        assert main(["experiment", str(tmp_path / "study.toml"), "--out", str(run)]) == 2
        assert f"is in use by process {holder.pid}" in capsys.readouterr().err
    finally:
        holder.kill()  # SIGKILL: no cleanup ran, yet the OS released the lock
        holder.wait()
    from dtpshard.training.rundir import locked

    with locked(run):
        pass
    assert list(run.iterdir()) == []  # the lock file of the killed holder is gone too


def test_force_starts_over_a_damaged_run(tiny_dirs, world, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["distill", str(tiny_dirs["llama"]), "--out", str(run), "--text", str(world / "good.txt"), *DISTILL]
    assert main(argv) == 0
    for name in ("DONE", "final"):
        shutil.rmtree(run / name) if (run / name).is_dir() else (run / name).unlink()
    (run / "checkpoint.pt").write_bytes(b"PK\x03\x04 cut short")
    capsys.readouterr()
    assert main(argv) == 2
    assert "checkpoint.pt" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0
    assert (run / "DONE").is_file() and not (run / "checkpoint.pt").exists()
    assert sorted(p.name for p in run.iterdir()) == ["DONE", "config.json", "dtpshard-dir.json", "final", "memory.json",
                                                     "metrics.jsonl"]
