"""A checkpoint's tokenizer, its files checked as data before transformers reads them.

transformers and tokenizers read a tokenizer's files with no check of their shape: a
tokenizer.json without `added_tokens` is a KeyError, a tokenizer_config.json whose
`tokenizer_class` is a number an AttributeError, a merge that is not a pair a Rust panic's
message. Each file is read here first by the bounded reader (core/reading.py: a regular file,
at most TOKENIZER_BYTES, JSON within bounds) and checked against what the loaders expect of it,
so a malformed one is refused in one line naming it; whatever transformers still refuses is one
line naming the directory. No code from the directory runs (model/pretrained.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError, first_line, naming, quote
from dtpshard.core.reading import loads, open_regular, read_text
from dtpshard.core.shape import family_config
from dtpshard.model.guarded import guard, panics_named
from dtpshard.model.pretrained import load, refused_code

# a tokenizer's files (what a teacher cache's tokenizer id hashes); a student gets them copied
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
TOKENIZER_BYTES = 1 << 30  # one tokenizer file (the largest real tokenizer.json is some tens of MiB)
TOKENIZER_INTS = 10 ** 40  # transformers writes an unbounded model_max_length as 10**30
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token(value: Any) -> bool:
    """A special token as the files give one: its text, or an AddedToken object with its text."""
    return isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("content"), str))


def _bad(where: str, what: str, value: Any) -> UserError:
    return UserError(f"{where}: {what}, not {quote(value)} (a damaged or hand-edited tokenizer file)")


def _check_tokenizer_json(obj: dict[str, Any], where: str, text: str) -> None:
    added = obj.get("added_tokens", ...)
    if added is ...:
        raise UserError(f"{where}: no added_tokens list (a damaged or hand-edited tokenizer file)")
    if not isinstance(added, list):
        raise _bad(where, "added_tokens must be a list", added)
    for i, t in enumerate(added):
        if not (isinstance(t, dict) and isinstance(t.get("content"), str) and isinstance(t.get("id"), int)
                and not isinstance(t.get("id"), bool) and t["id"] >= 0):
            raise _bad(where, f"added_tokens[{i}] must be an object with a content and an id", t)
    _check_model(obj.get("model"), where)
    growth = _growth(obj.get("normalizer"))
    if growth > MAX_GROWTH:
        raise UserError(f"{where}: its normalizer can make a text {growth:.3g} times longer (its replacements "
                        f"feed each other), more than any real tokenizer's {MAX_GROWTH}; tokenizing would exhaust "
                        "memory (a damaged or hostile tokenizer file)")
    from tokenizers import Tokenizer

    try:  # the Rust reader checks the model, the merges and the rest as it parses them
        Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception with serde's message
        raise UserError(f"{where}: not a tokenizer the tokenizers library reads "
                        f"({quote(first_line(e), False)})") from None


MAX_GROWTH = 1024  # how many times longer a normalizer may make a text (NFKC: 18; Llama's ▁ for ' ': 1)
_UNICODE_GROWTH = {"NFKC": 18, "NFKD": 18, "NFC": 3, "NFD": 4}  # Unicode's longest decompositions, per character


def _growth(normalizer: Any) -> float:
    """An upper bound on how many times longer `normalizer` (tokenizer.json's) makes a text: a
    replacement by k characters can match every single character, and in a sequence the bounds
    multiply. A Prepend or the like adds a constant, counted as one more time the text."""
    if not isinstance(normalizer, dict):
        return 1.0
    kind = normalizer.get("type")
    if kind == "Sequence":
        total = 1.0
        for part in normalizer.get("normalizers") or []:
            total *= _growth(part)
        return total
    if kind == "Replace":
        content = normalizer.get("content")
        return float(max(1, len(content))) if isinstance(content, str) else 1.0
    if kind in ("Prepend", "Append"):
        return 2.0
    return float(_UNICODE_GROWTH.get(kind, 1))


def _check_model(model: Any, where: str) -> None:
    """What the tokenizers library accepts but no evaluation survives: BPE-dropout (a training-time
    augmentation: every encoding random) and an unknown-token that is not in the vocabulary (the
    first unknown word a panic)."""
    if not isinstance(model, dict):
        return
    dropout = model.get("dropout")
    if dropout not in (None, 0, 0.0):
        raise UserError(f"{where}: model.dropout = {quote(dropout)} makes every tokenization random (BPE-dropout, "
                        "for training a tokenizer's user): calibration, training and evaluation would read other "
                        "tokens each time; set it to null")
    vocab, unk = model.get("vocab"), model.get("unk_token")
    if isinstance(vocab, dict) and isinstance(unk, str) and unk not in vocab:
        raise UserError(f"{where}: model.unk_token {quote(unk)} is not in its vocab (the first unknown word "
                        "would fail to encode)")
    unk_id = model.get("unk_id")
    if isinstance(vocab, list) and unk_id is not None and not (isinstance(unk_id, int) and 0 <= unk_id < len(vocab)):
        raise UserError(f"{where}: model.unk_id {quote(unk_id)} is not an index of its vocab of {len(vocab)}")


def _check_config(obj: dict[str, Any], where: str) -> None:
    cls = obj.get("tokenizer_class")
    if cls is not None and not isinstance(cls, str):
        raise _bad(where, "tokenizer_class must be a class name", cls)
    for key in SPECIAL_TOKENS:
        if obj.get(key) is not None and not _token(obj[key]):
            raise _bad(where, f"{key} must be a token's text", obj[key])
    length = obj.get("model_max_length")
    if length is not None and (isinstance(length, bool) or not isinstance(length, (int, float))):
        raise _bad(where, "model_max_length must be a number", length)
    decoder = obj.get("added_tokens_decoder")
    if decoder is not None and not (isinstance(decoder, dict) and all(
            str(k).isdigit() and _token(v) for k, v in decoder.items())):
        raise _bad(where, "added_tokens_decoder must map token ids to tokens", decoder)
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = obj.get(key)
        values = extra.values() if isinstance(extra, dict) else extra if isinstance(extra, list) else None
        if extra is not None and (values is None or not all(_token(v) for v in values)):
            raise _bad(where, f"{key} must list tokens", extra)


def _check_special_map(obj: dict[str, Any], where: str) -> None:
    for key, value in obj.items():
        if value is not None and not (_token(value) or (isinstance(value, list) and all(_token(v) for v in value))):
            raise _bad(where, f"{key} must be a token or a list of tokens", value)


def _check_ids(obj: dict[str, Any], where: str) -> None:
    for key, value in obj.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _bad(where, f"token {quote(key)} must map to an id", value)


_CHECKS = {"tokenizer_config.json": _check_config, "special_tokens_map.json": _check_special_map,
           "added_tokens.json": _check_ids, "vocab.json": _check_ids}


def check_tokenizer_files(path: Path) -> None:
    """Every tokenizer file in directory `path` read by the bounded reader and checked as data."""
    for name in TOKENIZER_FILES:
        f = path / name
        if not os.path.lexists(f):
            continue
        if not name.endswith(".json"):  # sentencepiece, merges, a template: transformers parses them
            with open_regular(f, TOKENIZER_BYTES, "tokenizer file"):
                continue
        text = read_text(f, TOKENIZER_BYTES, "tokenizer file")
        with naming(f):  # malformed JSON: one line with its place
            obj = loads(text, str(f), int_limit=TOKENIZER_INTS)
        if not isinstance(obj, dict):
            raise UserError(f"{f}: not a tokenizer file (a JSON object expected, found {type(obj).__name__})")
        if name == "tokenizer.json":
            _check_tokenizer_json(obj, str(f), text)
        elif name in _CHECKS:
            _CHECKS[name](obj, str(f))


def read_tokenizer(path: Path, hf_config: Any) -> Any:
    """The tokenizer in directory `path`, picked by `hf_config` (not read again; a student's is its
    family's, so transformers never looks for the student's remote code)."""
    from transformers import AutoTokenizer

    check_tokenizer_files(path)
    kw = {} if hf_config is None else {"config": family_config(hf_config)}
    where = str(path / "tokenizer.json") if (path / "tokenizer.json").is_file() else str(path)
    try:
        with panics_named(where):
            tok = load(AutoTokenizer, path, **kw)
    except UserError:
        raise
    except Exception as e:  # transformers raises many types for what the checks above cannot see
        first = first_line(e)
        if refused_code(e):
            raise UserError(f"{path}: its tokenizer names Python of its own (auto_map in tokenizer_config.json), "
                            "which dtpshard never runs; use a tokenizer transformers has (--tokenizer DIR)") from None
        raise UserError(f"{path}: no usable tokenizer ({type(e).__name__}: {quote(first, False)})") from None
    from transformers import PreTrainedTokenizerBase

    if not isinstance(tok, PreTrainedTokenizerBase):  # tokenizer_class named some other class
        raise UserError(f"{path / 'tokenizer_config.json'}: its tokenizer_class gives a {type(tok).__name__}, "
                        "which is not a tokenizer")
    return guard(tok, where)
