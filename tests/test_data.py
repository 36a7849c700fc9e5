"""Calibration/evaluation data: sources, roles, packing, and the one-line refusals."""
from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from dtpshard.core.errors import UserError
from dtpshard.data import blocks as data
from dtpshard.data.blocks import (
    Texts,
    doc_separators,
    is_eval_doc,
    iter_blocks,
    load_texts,
    make_blocks,
    read_text_files,
)
from dtpshard.data.corpus import build_documents, corpus_source, stdlib_documents

try:
    from test_dense import tiny_tokenizer
except ImportError:  # tests collected as a package
    from tests.test_dense import tiny_tokenizer

DOCS = [f"Document {i}: the quick brown fox jumps over the lazy dog, {i} times over." for i in range(200)]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


# -- offline corpus ------------------------------------------------------------------------------
def test_corpus_extraction_rules(tmp_path):
    (tmp_path / "b.py").write_text('"""Module b: a docstring that is long enough to keep here."""\n'
                                   'def f():\n    """Short."""\n'
                                   'if True:\n    class C:\n'
                                   '        """Class C, nested in an if, also long enough."""\n')
    (tmp_path / "a.py").write_text('def g():\n    """Module b: a docstring that is long enough to keep here."""\n'
                                   'def h():\n    """The function h, documented at sufficient length."""\n')
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text('"""A test module that must not be read by the corpus."""\n')
    (tmp_path / "bad.py").write_text("def (:\n")
    docs = build_documents(tmp_path)
    # sorted files: a.py first; b.py's module docstring is a repeat and dropped; "Short." too short
    assert docs == ["Module b: a docstring that is long enough to keep here.\n\n"
                    "The function h, documented at sufficient length.",
                    "Class C, nested in an if, also long enough."]


def test_corpus_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("DTPSHARD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "m.py").write_text('"""A module docstring of sufficient length for the corpus."""\n')
    first = stdlib_documents(tmp_path / "lib")
    assert len(list((tmp_path / "cache").glob("stdlib-corpus-*.json"))) == 1
    stdlib_documents.cache_clear()
    assert stdlib_documents(tmp_path / "lib") == first
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no Python standard-library sources"):
        stdlib_documents(tmp_path / "empty")


def test_offline_corpus_roles_partition_it():
    docs = stdlib_documents()
    assert len(docs) > 300 and sum(map(len, docs)) > 500_000
    cal, ev, al = (load_texts(role=r) for r in ("calibration", "eval", "all"))
    assert list(al.docs) == list(docs) and al.source.startswith(corpus_source())
    assert set(cal.docs).isdisjoint(ev.docs) and len(cal.docs) + len(ev.docs) == len(docs)
    assert 0.05 < len(ev.docs) / len(docs) < 0.2
    assert list(load_texts(role="train").docs) == list(cal.docs)
    assert all(is_eval_doc(d) for d in ev.docs) and not any(is_eval_doc(d) for d in cal.docs)


def test_offline_blocks_are_reproducible_and_roles_do_not_overlap(tok):
    cal, ev = load_texts(role="calibration"), load_texts(role="eval")
    a = make_blocks(tok, cal, 64, 8, seed=1)
    assert a.dtype == torch.long and a.shape == (8, 64)
    assert torch.equal(a, make_blocks(tok, cal, 64, 8, seed=1))
    assert not torch.equal(a, make_blocks(tok, cal, 64, 8, seed=2))
    e = make_blocks(tok, ev, 64, 8, seed=1)
    grams = {tuple(r[i:i + 24].tolist()) for r in a for i in range(0, 40)}
    assert not any(tuple(r[i:i + 24].tolist()) in grams for r in e for i in range(0, 40))


# -- packing -------------------------------------------------------------------------------------
def test_packing_wraps_documents_and_skips_blocks(tok):
    prefix, suffix = doc_separators(tok)
    assert prefix == [] and suffix == [tok.eos_token_id]
    docs = ["alpha beta", "gamma delta epsilon", "zeta"] * 10
    stream = sum((tok(d, add_special_tokens=False)["input_ids"] + suffix for d in docs), [])
    blocks = make_blocks(tok, docs, 5, len(stream) // 5, shuffle=False)
    assert blocks.flatten().tolist() == stream[:len(stream) // 5 * 5]
    full = make_blocks(tok, Texts("t", "all", docs=DOCS), 16, 10, seed=3)
    assert torch.equal(make_blocks(tok, Texts("t", "all", docs=DOCS), 16, 4, seed=3, skip_blocks=6), full[6:])


def test_bos_when_the_tokenizer_adds_it():
    tok = tiny_tokenizer(add_bos=True)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert doc_separators(tok) == ([bos], [eos])
    ids = tok("one two", add_special_tokens=False)["input_ids"]
    row = make_blocks(tok, ["one two", "three four"] * 4, len(ids) + 3, 1, shuffle=False)[0].tolist()
    assert row[:len(ids) + 3] == [bos] + ids + [eos, bos]


def test_repeat_starts_new_epochs_and_without_it_too_little_text_is_refused(tok):
    few = Texts("few docs", "all", docs=DOCS[:3])
    n_one_epoch = len(list(iter_blocks(tok, few, 8, seed=0)))
    assert n_one_epoch >= 1
    blocks = make_blocks(tok, few, 8, 5 * n_one_epoch + 1, seed=0, repeat=True)
    assert blocks.shape == (5 * n_one_epoch + 1, 8)
    with pytest.raises(UserError, match=f"only {n_one_epoch} blocks of 8 tokens"):
        make_blocks(tok, few, 8, n_one_epoch + 1)
    with pytest.raises(UserError, match="shorter than one block of 4096 tokens"):
        make_blocks(tok, few, 4096, 1)


# -- local files ---------------------------------------------------------------------------------
def test_text_jsonl_and_directories(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("para one\nstill one\n\n  \npara two\n")
    (tmp_path / "d" / "b.jsonl").write_text(json.dumps({"text": "json doc", "id": 1}) + "\n\n"
                                            + json.dumps({"text": "second"}) + "\n")
    (tmp_path / "d" / "skip.bin").write_bytes(b"\x00\x01")
    assert read_text_files([tmp_path / "d"]) == ["para one\nstill one", "para two", "json doc", "second"]
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    assert read_text_files([tmp_path / "c.jsonl"], text_field="body") == ["x"]
    with pytest.raises(UserError, match=r"c.jsonl:1: expected a JSON object with a string field 'text'"):
        read_text_files([tmp_path / "c.jsonl"])
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(UserError, match=r"bad.jsonl:1: not JSON"):
        read_text_files([tmp_path / "bad.jsonl"])


@pytest.mark.parametrize("make, needle", [
    (lambda p: [], "no text given"),
    (lambda p: [p / "nope.txt"], "text file not found"),
    (lambda p: [(p / "e.txt", (p / "e.txt").write_text(" \n\n"))[0]], "no text (empty file)"),
    (lambda p: [(p / "e.jsonl", (p / "e.jsonl").write_text(""))[0]], "no text (empty file)"),
    (lambda p: [(p / "x.txt", (p / "x.txt").write_bytes(b"\xff\xfe\xfa"))[0]], "not UTF-8"),
])
def test_bad_text_inputs(tmp_path, make, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_texts(make(tmp_path))
    with pytest.raises(UserError, match="not both"):
        load_texts([tmp_path / "x.txt"], dataset="wikitext-2")


def test_a_role_with_no_documents_left_is_refused(tmp_path):
    doc = next(d for d in DOCS if is_eval_doc(d))
    (tmp_path / "one.txt").write_text(doc)
    assert load_texts([tmp_path / "one.txt"], role="eval").docs == [doc]
    with pytest.raises(UserError, match="no documents left for role 'calibration'"):
        load_texts([tmp_path / "one.txt"])


def test_parquet(tmp_path, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": ["first doc", "second doc"], "n": [1, 2]}), tmp_path / "t.parquet")
    assert read_text_files([tmp_path / "t.parquet"]) == ["first doc", "second doc"]
    with pytest.raises(UserError, match="no column 'body'"):
        read_text_files([tmp_path / "t.parquet"], text_field="body")


def test_parquet_without_pyarrow_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match=r"reading parquet needs pyarrow \(pip install"):
        read_text_files([tmp_path / "t.parquet"])


# -- Hugging Face datasets (faked: no hub in tests) ---------------------------------------------
class FakeStream:
    def __init__(self, rows):
        self.rows, self.seed = rows, None

    def shuffle(self, seed, buffer_size):
        out = FakeStream(list(self.rows))
        out.seed = seed
        __import__("random").Random(seed).shuffle(out.rows)
        return out

    def __iter__(self):
        return iter(self.rows)


def fake_datasets(calls):
    wiki = {"train": [" = Alpha = \n", " alpha text \n", " = = Sub = = \n", " more alpha \n", " = Beta = \n",
                      " beta \n"],
            "test": [" = Gamma = \n", " gamma text \n"]}

    def load_dataset(path, config=None, split=None, streaming=False):
        calls.append((path, config, split, streaming))
        if path == "down/hub":
            raise ConnectionError("Couldn't reach the hub\nsecond line")
        if path == "Salesforce/wikitext":
            return {"text": wiki[split]}
        return FakeStream([{"text": d} for d in DOCS])

    return types.SimpleNamespace(load_dataset=load_dataset)


def test_wikitext_roles_use_splits_and_articles(monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(calls))
    ev = load_texts(dataset="wikitext-2", role="eval")
    assert calls[-1] == ("Salesforce/wikitext", "wikitext-2-raw-v1", "test", False)
    assert ev.docs == ["= Gamma = \n gamma text"]
    tr = load_texts(dataset="wikitext-2")
    assert calls[-1][2] == "train" and len(tr.docs) == 2 and "Sub" in tr.docs[0]


def test_streamed_dataset_is_filtered_shuffled_and_blocks_reproducible(monkeypatch, tok):
    calls: list = []
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(calls))
    cal = load_texts(dataset="fineweb-edu")
    assert calls == [] and "fineweb-edu" in cal.source
    got = list(cal.iter_docs(seed=4))
    assert calls[-1] == ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)
    assert sorted(got) == sorted(d for d in DOCS if not is_eval_doc(d)) and got != sorted(got)
    assert list(load_texts(dataset="fineweb-edu", role="eval").iter_docs(shuffle=False)) == \
        [d for d in DOCS if is_eval_doc(d)]
    assert torch.equal(make_blocks(tok, cal, 32, 3, seed=4), make_blocks(tok, cal, 32, 3, seed=4))
    assert load_texts(dataset="owner/name:cfg").source.startswith("dataset:owner/name:cfg/train")


def test_dataset_errors_are_one_line(monkeypatch, tok):
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets([]))
    with pytest.raises(UserError) as e:
        make_blocks(tok, load_texts(dataset="down/hub"), 16, 1)
    assert "cannot load down/hub from the Hugging Face hub (ConnectionError: Couldn't reach the hub)" in str(e.value)
    assert "\n" not in str(e.value)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(UserError, match="needs the `datasets` package"):
        load_texts(dataset="fineweb-edu")


def test_role_names_are_checked():
    with pytest.raises(ValueError):
        load_texts(role="validation")
    assert data.ROLES == ("calibration", "train", "eval", "all")


def test_offline_dataset_name_is_the_builtin_corpus():
    named, default = load_texts(dataset="offline", role="eval"), load_texts(role="eval")
    assert named.source == default.source and list(named.docs) == list(default.docs)
