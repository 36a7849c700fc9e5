"""Issue 60, the fifth hostile sweep, each class by the rule that covers it:
A. nothing deletes what it did not create, and nothing is written through a name with more than one
   link (serve/env.py builds its environment whole in a temporary and publishes it sealed; every
   append goes through core/io.py's `append_bytes`; every temporary is core/temporary.py's);
B. nothing does work in proportion to a number a user typed before that number is bounded;
C. a report's number is checked as what it measures (studies/stats.py's checks);
D. a published result names its inputs by what they are, never by a machine's path.
Each refusal is one line, exit 2, with nothing touched."""
from pathlib import Path

import pytest
import torch

from dtpshard.core.errors import UserError
from dtpshard.core.temporary import temporary_name
from dtpshard.serve import env as serve_env
from tiny import linked_victim

ROOT = Path(__file__).resolve().parents[1]


# -- A. the vLLM environment: built whole, replaced only when it holds nothing else ---------------
class _Builder:
    """venv.EnvBuilder's stand-in: a python, a script naming its folder, a pyvenv.cfg."""

    def __init__(self, **kw):
        pass

    def create(self, d):
        d = Path(d)
        (d / "bin").mkdir(parents=True)
        (d / "bin" / "python").write_text("#!/bin/sh\n")
        (d / "bin" / "pip").write_text(f"#!{d}/bin/python\n")
        (d / "pyvenv.cfg").write_text(f"command = python -m venv {d}\n")


@pytest.fixture
def fake_build(monkeypatch):
    """serve.env with no pip and no vLLM: `state["broken"]` (an inode) makes the environment published
    in that folder stop running; one built anew runs."""
    state = {"broken": None, "pip": lambda: None}

    def site(python):
        if python.parents[1].name == serve_env.VENV and python.parents[1].stat().st_ino == state["broken"]:
            return None
        d = python.parents[1] / "site"
        d.mkdir(exist_ok=True)
        return d

    monkeypatch.setattr(serve_env.venv, "EnvBuilder", _Builder)
    monkeypatch.setattr(serve_env, "_pip", lambda python, *a, folder: state["pip"]())
    monkeypatch.setattr(serve_env, "_site_packages", site)
    return state


def _tree(d: Path) -> list:
    return sorted((str(p.relative_to(d)), p.is_dir() or p.read_bytes()) for p in d.rglob("*"))


def test_the_environment_is_published_whole_and_names_its_own_folder(fake_build, tmp_path):
    env = tmp_path / "env"
    assert serve_env.ensure(env) == env / "venv" / "bin" / "python"
    assert (env / "venv" / "bin" / "pip").read_text() == f"#!{env / 'venv'}/bin/python\n"  # relocated
    assert str(env / "venv") in (env / "venv" / "bin" / "vllm").read_text()
    assert not [p for p in env.iterdir() if ".tmp-" in p.name]


def test_a_rebuild_never_removes_a_users_script_in_the_environment(fake_build, tmp_path):
    env = tmp_path / "env"
    serve_env.ensure(env)
    (env / "venv" / "bin" / "my-tool").write_text("mine")
    fake_build["broken"] = (env / "venv").stat().st_ino  # it no longer runs: the next call builds it again
    before = _tree(env)
    with pytest.raises(UserError, match="my-tool") as e:
        serve_env.ensure(env)
    assert "\n" not in str(e.value) and _tree(env) == before
    (env / "venv" / "bin" / "my-tool").unlink()
    serve_env.ensure(env)  # nothing of anyone else's in it: replaced
    assert (env / "venv").stat().st_ino != fake_build["broken"] and (env / "venv" / "bin" / "pip").is_file()


def test_an_interrupted_build_leaves_no_half_made_environment(fake_build, tmp_path):
    env = tmp_path / "env"

    def interrupt():
        raise KeyboardInterrupt

    fake_build["pip"] = interrupt
    with pytest.raises(KeyboardInterrupt):
        serve_env.ensure(env)
    assert not (env / "venv").exists() and not [p for p in env.iterdir() if ".tmp-" in p.name]
    # a kill's leftover (a dead process's temporary) is the next build's to remove
    dead = env / temporary_name("venv", "-abcdef", pid=4_000_000 - 1)
    (dead / "bin").mkdir(parents=True)
    fake_build["pip"] = lambda: None
    serve_env.ensure(env)
    assert not dead.exists() and (env / "venv" / "bin" / "python").is_file()


def test_a_users_file_in_the_overlay_is_never_removed(fake_build, tmp_path, monkeypatch):
    env = tmp_path / "env"
    serve_env.ensure(env)
    (env / serve_env.OVERLAY / "notes.txt").write_text("mine")
    monkeypatch.setattr(serve_env, "_linked_to", lambda env: None)  # as if another dtpshard had linked it
    with pytest.raises(UserError, match="notes.txt"):
        serve_env.ensure(env)
    assert (env / serve_env.OVERLAY / "notes.txt").read_text() == "mine"


def test_metrics_are_never_appended_through_a_hard_link(tmp_path):
    from dtpshard.training.metrics import METRICS, Metrics

    victim, run = linked_victim(tmp_path, METRICS, "mine\n")
    metrics = Metrics(run)
    with pytest.raises(UserError, match="hard link") as e:
        metrics.truncate(len("mine\n"))  # a resume's first touch of its metrics, before any step
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="hard link"):
        metrics.append({"kind": "train", "step": 1})
    assert victim.read_text() == "mine\n"


def test_a_sharded_steps_temporary_is_core_temporarys(tmp_path):
    from dtpshard.training import fsdp, rundir

    run = tmp_path / "run"
    root = run / rundir.SHARDED_CHECKPOINT
    (root / "step-00000002").mkdir(parents=True)
    (root / "LATEST").write_text("step-00000002\n")
    dead = root / temporary_name("step-00000004", pid=4_000_000 - 1)
    dead.mkdir()
    (root / ".step-00000006.tmp").mkdir()  # a user's folder that only looks like the old fixed name
    (root / "mine").mkdir()
    assert rundir._sharded_checkpoint(root) == root / ".step-00000006.tmp"
    fsdp.clean(run)
    assert sorted(p.name for p in root.iterdir()) == [".step-00000006.tmp", "LATEST", "mine", "step-00000002"]


# -- B. no work in proportion to a number before it is bounded ------------------------------------
@pytest.fixture(scope="module")
def corpus(tiny_dirs, tmp_path_factory):
    from dtpshard.data.blocks import load_texts
    from dtpshard.model.checkpoint import load_tokenizer
    from test_distill import random_docs

    text = tmp_path_factory.mktemp("corpus") / "docs.txt"
    text.write_text("\n\n".join(random_docs(60, 0)))
    return load_tokenizer(tiny_dirs["llama"]), load_texts([str(text)], role="train")


def test_uses_streams_asks_each_phase_not_each_step():
    from dtpshard.training.recipes import RECIPES, uses_streams

    for name, recipe in RECIPES.items():
        for steps in (1, 2, 3, 7, 10, 41):  # the phase changes only where `starts` says, and the answer agrees
            phases = [recipe.phase(s, steps, 1.0) for s in range(steps)]
            assert {s for s in range(1, steps) if phases[s] != phases[s - 1]} <= set(recipe.starts(steps))
            assert uses_streams(name, steps) == any(p.streams > 0 for p in phases)
    assert [uses_streams(n, 1 << 31) for n in ("paper", "streams", "curriculum", "layerwise")] == \
        [False, True, False, True]  # at once: four phases asked, not 2^31 steps


@pytest.mark.parametrize("flag, value", [("--steps", "10000000000"), ("--grad-accum", "1000000000000")])
def test_steps_and_grad_accum_are_bounded(capsys, flag, value):
    from dtpshard.cli import main

    assert main(["distill", "teacher", "--out", "run", flag, value, "--plan"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and ("2^31" in err[0] or "65536" in err[0]), err


def test_training_blocks_are_made_when_a_step_needs_them(corpus):
    """A run of 2^31 steps starts at once, and block t of a stream read from t on is block t of the
    stream read from 0 (a resume trains on exactly the uninterrupted run's blocks)."""
    from dtpshard.data.stream import BlockStream

    tok, texts = corpus
    whole = BlockStream(tok, texts, 17, 40, seed=3).window(0, 40)
    huge = BlockStream(tok, texts, 17, (1 << 31) * 64, seed=3)
    assert torch.equal(huge.window(24, 32), whole[24:32])
    assert torch.equal(huge.window(4, 8), whole[4:8])  # an earlier window: the stream again from its start
    windows = huge.windows([0, 10, 30], 2)
    assert len(windows) == 3 and torch.equal(windows[2], whole[30:32])


def test_the_fingerprint_of_a_short_run_is_the_hash_of_all_its_blocks(corpus):
    from dtpshard.core.io import short_sha256
    from dtpshard.data.blocks import make_blocks
    from dtpshard.data.stream import BlockStream

    tok, texts = corpus
    old = make_blocks(tok, texts, 17, 40, seed=3, shuffle=True, repeat=True)  # what a run recorded before
    assert BlockStream(tok, texts, 17, 40, seed=3).fingerprint() == short_sha256(old.numpy().tobytes())


def test_a_permutation_test_of_many_layouts_is_sampled():
    from dtpshard.studies.seeds import SAMPLED_SPLITS, split_test

    values = [float(i % 7) for i in range(40)]  # C(40, 20) splits: never listed
    diff, p, exact = split_test(values)
    assert not exact and 0 <= p <= 1 and split_test(values) == (diff, p, exact)  # seeded: the same each time
    assert SAMPLED_SPLITS < 1 << 20


# -- C. a report's number checked as what it measures ---------------------------------------------
def test_numbers_are_checked_as_what_they_measure():
    from dtpshard.studies.stats import is_kl, is_number, is_rate, is_step

    inf = float("inf")
    assert not is_number(inf) and not is_number(-inf) and not is_number(float("nan")) and is_number(1e308)
    assert is_kl(0.0) and not is_kl(-0.1) and not is_kl(inf)
    assert is_rate(1.5) and not is_rate(0) and not is_rate(inf)
    assert is_step(500) and is_step(500.0) and not is_step(inf) and not is_step(2.5) and not is_step(-1)


@pytest.mark.parametrize("row", [{"batch": 1, "latency_ms": 0, "tp_tok_s": float("inf")},
                                 {"batch": 1, "latency_ms": 0, "tp_tok_s": 10, "dtp_tok_s": -1},
                                 {"batch": float("inf"), "latency_ms": 0, "tp_tok_s": 10},
                                 {"batch": 1, "latency_ms": 0, "tp_tok_s": 10, "delayed": 2}])
def test_decode_rows_are_refused_in_one_line(tmp_path, row):
    import json
    from types import SimpleNamespace

    from dtpshard.studies.shared import DECODE, decode_rows

    (tmp_path / DECODE).write_text(json.dumps([row]))  # json writes Infinity, as a hand edit may
    with pytest.raises(UserError) as e:
        decode_rows(SimpleNamespace(directory=tmp_path))
    assert "\n" not in str(e.value) and DECODE in str(e.value)


def test_a_shared_fraction_that_shares_no_neuron_is_refused():
    from dtpshard.core.shape import shared_count

    with pytest.raises(UserError, match="shares no neuron of 64; the smallest fraction that shares one is"):
        shared_count(64, 4, 1e-12)
    assert shared_count(3072, 4, 0) == 0 and shared_count(3072, 4, 0.1) == 308
