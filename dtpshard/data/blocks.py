"""Text data for calibration, training and evaluation: corpora, tokenisation, packing into blocks.

API (used by `affinity`, `distill`, `eval`)::

    texts = load_texts(text=None, dataset=None, role="calibration", text_field="text")  # -> Texts
    blocks = make_blocks(tokenizer, texts, seq_len=1024, n_blocks=64, seed=0,
                         skip_blocks=0, shuffle=True, repeat=False)   # LongTensor [n_blocks, seq_len]
    for block in iter_blocks(tokenizer, texts, seq_len, seed=0, shuffle=True, repeat=True): ...
    texts.source   # one-line description of the data; record it in outputs

Sources (`load_texts`), exactly one of:
- ``text``: local paths (files or directories, searched recursively for the suffixes below, in
  sorted order). ``.jsonl``: one JSON object per line, the document in ``text_field``; ``.json``:
  a JSON array of such objects (or of strings), else read as JSON lines. ``.parquet``: the
  ``text_field`` column (needs pyarrow). Anything else is plain UTF-8 text, split into documents
  at blank lines.
- ``dataset``: a path on disk (`dtpshard.data.local`: a ``save_to_disk`` directory, a parquet
  file, a directory of parquet files), or Hugging Face ``datasets`` from the hub (imported
  lazily). ``fineweb-edu`` (HuggingFaceFW/fineweb-edu, sample-10BT, streamed), ``wikitext-2``
  (Salesforce/wikitext, wikitext-2-raw-v1, one document per article), or any
  ``owner/name[:config]`` (its train split, streamed).
- neither, or ``dataset="offline"``: the built-in offline corpus (`dtpshard.corpus`, Python
  standard-library docstrings). Every command defaults to it: nothing is fetched unless asked.

Roles keep evaluation data apart from everything else. ``"eval"`` takes the held-out share of a
source, ``"calibration"`` and ``"train"`` both take the rest (they may share documents), ``"all"``
takes everything (for a file that is only ever used for one purpose). For WikiText-2 the share is
the split (eval: test, else train). Elsewhere a document is held out when its content hash says so
(`is_eval_doc`: about one document in `EVAL_MODULUS`), which is stable, independent of order and
of the seed, and sends duplicate documents to the same side; eval blocks and calibration/training
blocks therefore never contain the same document.

Packing (`iter_blocks`): documents in order (``shuffle=False``) or in a seeded random order, each
tokenised without special tokens and wrapped as ``[BOS] ids [EOS]`` (BOS only when the tokenizer
adds it by itself, as Llama's does; EOS whenever the tokenizer has one), concatenated, and cut
into consecutive blocks of ``seq_len`` tokens. ``skip_blocks`` drops that many leading blocks, so
``make_blocks(.., n, skip_blocks=k)`` equals blocks k..k+n-1 of ``make_blocks(.., k+n)``.
``repeat=True`` starts a new epoch (a new seeded order) when the documents run out; otherwise too
little text is a `UserError` naming the counts. Streamed datasets are shuffled by ``datasets``
(buffer `STREAM_SHUFFLE_BUFFER`) with the same seed. Only as many documents as needed are read
and tokenised.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtpshard.core.errors import UserError, first_line
from dtpshard.core.reading import loads, read_text
from dtpshard.data.corpus import corpus_source, stdlib_documents
from dtpshard.data.hub import hub_offline, offline_reason
from dtpshard.data.local import TEXT_BYTES, is_local_dataset, read_local_dataset, read_parquet

ROLES = ("calibration", "train", "eval", "all")
OFFLINE = "offline"
EVAL_MODULUS = 10
STREAM_SHUFFLE_BUFFER = 1000
TOKENIZE_BATCH = 64
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst") + JSON_SUFFIXES + (".parquet",)

# alias -> (hub path, config, {role: split}, one document per article?)
KNOWN_DATASETS: dict[str, tuple[str, str | None, dict[str, str], bool]] = {
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", {}, False),
    "wikitext-2": ("Salesforce/wikitext", "wikitext-2-raw-v1", {"eval": "test", "calibration": "train",
                                                                "train": "train", "all": "train"}, True),
}


def is_eval_doc(doc: str) -> bool:
    """The held-out rule: the document's BLAKE2b hash is 0 modulo EVAL_MODULUS."""
    h = hashlib.blake2b(doc.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "little") % EVAL_MODULUS == 0


def _in_role(doc: str, role: str) -> bool:
    return role == "all" or is_eval_doc(doc) == (role == "eval")


@dataclass
class Texts:
    """Documents of one source for one role: a finite list, or a seeded stream."""

    source: str
    role: str
    docs: Sequence[str] | None = None
    stream: Callable[[int], Iterable[str]] | None = None  # seed -> documents (filtered, shuffled)

    def iter_docs(self, seed: int = 0, shuffle: bool = True, epoch: int = 0) -> Iterator[str]:
        if self.docs is not None:
            order = list(range(len(self.docs)))
            if shuffle:
                random.Random(f"dtpshard:{seed}:{epoch}").shuffle(order)
            return (self.docs[i] for i in order)
        assert self.stream is not None
        return iter(self.stream(seed + epoch if shuffle else -1))


def load_texts(text: Sequence[str | Path] | None = None, dataset: str | None = None, role: str = "calibration",
               text_field: str = "text") -> Texts:
    """The documents of one source (see the module docstring) for `role`."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}: one of {ROLES}")
    if text is not None and dataset is not None:
        raise UserError("give --text or --dataset, not both")
    if dataset == OFFLINE:  # the built-in corpus, asked for by name (no hub attempt first)
        dataset = None
    by_split = False
    if dataset is not None:
        if not is_local_dataset(dataset):
            return _hf_texts(dataset, role, text_field)
        docs, source, by_split = read_local_dataset(dataset, role, text_field)
    elif text is not None:
        docs, source = read_text_files(text, text_field), "text:" + ",".join(str(p) for p in text)
    else:
        docs, source = list(stdlib_documents()), corpus_source()
    kept = [d for d in docs if d.strip() and (by_split or _in_role(d, role))]
    if not kept:
        raise UserError(f"{source}: no documents left for role {role!r} ({len(docs)} in all; "
                        f"about 1 in {EVAL_MODULUS} is held out for eval): give more text")
    return Texts(f"{source} [{role}: {len(kept)} of {len(docs)} documents]", role, docs=kept)


# -- local files -------------------------------------------------------------------------------
def _expand(paths: Sequence[str | Path]) -> list[Path]:
    if not paths:
        raise UserError("no text given (--text needs at least one file)")
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            # what has a text suffix is read, so a FIFO or a link to a device is refused by name, not skipped
            found = sorted(f for f in p.rglob("*") if f.suffix.lower() in TEXT_SUFFIXES and not f.is_dir())
            if not found:
                raise UserError(f"{p}: no text files ({', '.join(TEXT_SUFFIXES)}) in this directory")
            out += found
        elif os.path.lexists(p):
            out.append(p)  # read_text refuses what is not a regular file
        else:
            raise UserError(f"text file not found: {p}")
    return out


def read_text_files(paths: Sequence[str | Path], text_field: str = "text") -> list[str]:
    """All documents of the given files/directories, in order; refuses empty or malformed files."""
    docs: list[str] = []
    for path in _expand(paths):
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            found = _read_parquet(path, text_field)
        else:
            raw = read_text(path, TEXT_BYTES, "text file")
            if suffix == ".json":
                found = _read_json(raw, path, text_field)
            elif suffix in JSON_SUFFIXES:
                found = _read_jsonl(raw, path, text_field)
            else:
                found = [d.strip() for d in re.split(r"\n\s*\n", raw)]
        found = [d for d in found if d.strip()]
        if not found:
            raise UserError(f"{path}: no text (empty file)")
        docs += found
    return docs


def _read_jsonl(raw: str, path: Path, field: str) -> list[str]:
    docs = []
    for n, line in enumerate(raw.split("\n"), 1):  # JSON lines end at \n only (a string may hold U+2028)
        if not line.strip():
            continue
        try:
            obj = loads(line, f"{path}:{n}")  # the one bounded JSON reader: depth, integers
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not JSON ({e.msg})") from None
        except RecursionError:
            raise UserError(f"{path}:{n}: nested too deeply for a document") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
            raise UserError(f"{path}:{n}: expected a JSON object with a string field {field!r}")
        if _LONE.search(obj[field]):
            raise _lone_surrogate(path, n)
        docs.append(obj[field])
    return docs


# JSON may escape half of a UTF-16 pair alone ("\ud800"): a string no encoder or tokenizer takes
_LONE = re.compile("[\ud800-\udfff]")
_ESCAPE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}(\\u[dD][c-fC-F][0-9a-fA-F]{2})?|\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _lone_surrogate(path: Path, line: int) -> UserError:
    return UserError(f"{path}:{line}: a JSON string holds a lone surrogate escape (\\ud800-\\udfff, half of a "
                     "UTF-16 pair), which is not text; fix or remove it")


def _surrogate_line(raw: str) -> int:
    """The line of the first escape of a lone surrogate in JSON text (a pair is one character)."""
    for m in _ESCAPE.finditer(raw):
        if not (m.group(0)[3].lower() in "89ab" and m.group(1)):
            return raw.count("\n", 0, m.start()) + 1
    return 1


def _read_json(raw: str, path: Path, field: str) -> list[str]:
    """A JSON array of objects with `field` (or of strings), as `datasets`' to_json(lines=False)
    writes; a file that is not one JSON value is read as JSON lines."""
    try:
        obj = loads(raw, str(path))
    except json.JSONDecodeError:
        return _read_jsonl(raw, path, field)
    except RecursionError:
        raise UserError(f"{path}: nested too deeply for a list of documents") from None
    if isinstance(obj, dict) and isinstance(obj.get(field), str):
        obj = [obj]
    if not isinstance(obj, list):
        raise UserError(f"{path}: expected a JSON array of objects with a string field {field!r}")
    docs = []
    for n, item in enumerate(obj):
        if isinstance(item, str):
            docs.append(item)
        elif isinstance(item, dict) and isinstance(item.get(field), str):
            docs.append(item[field])
        else:
            raise UserError(f"{path}: item {n} is not a string or an object with a string field {field!r}")
    if any(_LONE.search(d) for d in docs):
        raise _lone_surrogate(path, _surrogate_line(raw))
    return docs


def _read_parquet(path: Path, field: str) -> list[str]:
    return read_parquet(path, field)


# -- Hugging Face datasets -----------------------------------------------------------------------
def _articles(rows: Iterable[str]) -> list[str]:
    """WikiText rows (lines) grouped into articles at top-level ' = Title = ' headings."""
    docs: list[list[str]] = []
    for line in rows:
        if re.fullmatch(r" = [^=].* = \n?", line) or not docs:
            docs.append([])
        docs[-1].append(line)
    return ["".join(d).strip() for d in docs if "".join(d).strip()]


def _hf_texts(name: str, role: str, field: str) -> Texts:
    try:
        import datasets
    except ImportError:
        raise UserError(f"--dataset {name} needs the `datasets` package (pip install datasets); offline, "
                        "pass --text FILE or omit both for the built-in corpus") from None
    path, config, splits, by_article = KNOWN_DATASETS.get(name, (name.split(":")[0], None, {}, False))
    if name not in KNOWN_DATASETS and "/" not in path:  # a mistyped local path, not a hub id: no retries
        raise UserError(f"--dataset {name}: no such directory or parquet file, and not a hub dataset "
                        f"(one of {', '.join(KNOWN_DATASETS)}, or owner/name[:config])")
    if name not in KNOWN_DATASETS and ":" in name:
        config = name.split(":", 1)[1]
    split = splits.get(role, "train")
    source = f"dataset:{path}" + (f":{config}" if config else "") + f"/{split} [{role}]"
    offline = offline_reason()  # asked first: no half minute of retries without a network
    # a hub dataset's own loading script never runs (the datasets versions that still have them ask
    # on stdin otherwise); later versions have no such scripts, and no such argument
    no_code = {"trust_remote_code": False} if "trust_remote_code" in inspect.signature(
        datasets.load_dataset).parameters else {}

    def fail(e: BaseException) -> UserError:
        where = (f"; offline ({offline}), so only the local Hugging Face cache was looked in: pass --text FILE, "
                 "a local --dataset PATH, or neither for the built-in corpus" if offline else "")
        return UserError(f"dataset {name}: cannot load {path} from the Hugging Face hub "
                         f"({first_line(e, named=True)}){where}")

    if by_article:  # small, split-partitioned: load whole, one document per article
        try:
            with hub_offline(offline is not None):
                rows = datasets.load_dataset(path, config, split=split, **no_code)[field]
        except Exception as e:  # network/hub errors come in many types
            raise fail(e) from None
        docs = _articles(rows)
        if not docs:
            raise UserError(f"dataset {name}: no text in split {split!r}")
        return Texts(f"{source} {len(docs)} documents", role, docs=docs)

    def stream(seed: int) -> Iterator[str]:
        try:
            with hub_offline(offline is not None):
                ds = datasets.load_dataset(path, config, split=split, streaming=True, **no_code)
                if seed >= 0:
                    ds = ds.shuffle(seed=seed, buffer_size=STREAM_SHUFFLE_BUFFER)
                for row in ds:
                    doc = row.get(field)
                    if isinstance(doc, str) and doc.strip() and _in_role(doc, role):
                        yield doc
        except UserError:
            raise
        except Exception as e:
            raise fail(e) from None

    return Texts(source + " streamed", role, stream=stream)


# -- tokenisation and packing -------------------------------------------------------------------
def doc_separators(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(prefix, suffix) token ids around every document: [BOS] if the tokenizer adds it, [EOS]."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    prefix = [bos] if bos is not None and probe and probe[0] == bos else []
    suffix = [eos] if eos is not None else []
    if not prefix and not suffix and bos is not None:
        prefix = [bos]
    return prefix, suffix


def iter_blocks(tokenizer: Any, texts: Texts | Sequence[str], seq_len: int, seed: int = 0, shuffle: bool = True,
                repeat: bool = False) -> Iterator[torch.Tensor]:
    """Blocks of `seq_len` token ids (LongTensor [seq_len]) packed from the documents, lazily."""
    if seq_len < 1:
        raise UserError(f"seq_len={seq_len}: must be at least 1")
    if not isinstance(texts, Texts):
        texts = Texts("texts", "all", docs=list(texts))
    prefix, suffix = doc_separators(tokenizer)
    pending: list[np.ndarray] = []
    have, epoch = 0, 0
    while True:
        used = 0
        docs = texts.iter_docs(seed, shuffle, epoch)
        while chunk := list(islice(docs, TOKENIZE_BATCH)):
            batch = [d for d in chunk if d.strip()]
            for ids in (tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"] if batch else []):
                if ids:
                    used += 1
                    pending.append(np.asarray(prefix + list(ids) + suffix, dtype=np.int64))
                    have += len(pending[-1])
            if have >= seq_len:
                flat = np.concatenate(pending)
                n = len(flat) // seq_len
                for k in range(n):
                    yield torch.from_numpy(flat[k * seq_len:(k + 1) * seq_len].copy())
                pending, have = [flat[n * seq_len:]], len(flat) - n * seq_len
        if not repeat or used == 0:
            return
        epoch += 1


def make_blocks(tokenizer: Any, texts: Texts | Sequence[str], seq_len: int, n_blocks: int, seed: int = 0,
                skip_blocks: int = 0, shuffle: bool = True, repeat: bool = False) -> torch.Tensor:
    """Blocks skip_blocks .. skip_blocks+n_blocks-1 of `iter_blocks`: LongTensor [n_blocks, seq_len]."""
    if n_blocks < 1:
        raise UserError(f"blocks={n_blocks}: must be at least 1")
    source = texts.source if isinstance(texts, Texts) else "texts"
    stream = iter_blocks(tokenizer, texts, seq_len, seed, shuffle, repeat)
    got = list(islice(stream, skip_blocks + n_blocks))
    if not got:
        raise UserError(f"{source}: text is shorter than one block of {seq_len} tokens")
    if len(got) < skip_blocks + n_blocks:
        raise UserError(f"{source}: only {len(got)} blocks of {seq_len} tokens, {skip_blocks + n_blocks} needed "
                        "(give more text, fewer blocks or a shorter sequence length)")
    return torch.stack(got[skip_blocks:])
