"""What a resume trusts: the files a run was made from, recorded by content and checked again.

A distillation (`distill`, `convert`'s stage 3) records what defines the teacher's function when
it starts: the sha256 of its weight files, of its whole config.json as parsed (canonical JSON, so
a rewrap or reordering is no change and any value is one: rope_theta as much as rms_norm_eps),
of its tokenizer's files, and of the layout file; a rerun compares them all before it trusts
anything it made: a teacher whose weights or config were replaced, another tokenizer, or a layout
edited by hand (units swapped, its J rewritten), is refused in one line naming the file.
`convert` records its own published outputs (the affinity file, the layout) the same way, so a
stage is skipped only over what it wrote.

Hashing a 70B teacher takes minutes, so each record also keeps the file's identity (size, times,
inode): a file with the same identity as recorded is not hashed again. Any write changes its
ctime, which no user can set back, so an identical identity means identical bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError
from dtpshard.core.io import file_sha256

TEACHER = "teacher"  # the key prefix of the teacher's weight files: teacher/NAME
CONFIG = "teacher_config"  # the teacher's config.json, hashed as canonical JSON of what it parses to
TOKENIZER = "tokenizer"  # the key prefix of the tokenizer's files: tokenizer/NAME
LAYOUT = "layout"


def _identity(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


_hashed: dict[tuple[str, tuple[int, ...]], str] = {}  # this process's hashes, by file and identity


def _sha256(path: Path, key: str = "", config: Any = None) -> str:
    """file_sha256 (the config: `config_sha256` of it as transformers reads it, `config` when the
    command has read it already), once per process for a file that has not changed (convert
    records the teacher in convert.json and again, as its distillation begins, in RUN/config.json)."""
    ident = (os.path.realpath(path), tuple(_identity(path)), key == CONFIG)
    if ident not in _hashed:
        if key == CONFIG:
            from dtpshard.model.checkpoint import load_hf_config

            _hashed[ident] = config_sha256(config if config is not None else load_hf_config(path.parent))
        else:
            _hashed[ident] = file_sha256(path)
    return _hashed[ident]


def config_sha256(hf_config: Any) -> str:
    """The sha256 of a transformers config as canonical JSON: every value, defaults filled in as
    transformers reads the file, whatever its layout (not the transformers version that read it)."""
    data = {k: v for k, v in hf_config.to_dict().items() if k != "transformers_version"}
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def run_files(teacher: Path, layout: Path | None, tokenizer: Path | None = None) -> dict[str, Path]:
    """{key: path} of what a distillation is made from: teacher/NAME per weight file, the
    teacher's config, tokenizer/NAME per tokenizer file (of `tokenizer`, else the teacher's), and
    the layout."""
    from dtpshard.model.checkpoint import TOKENIZER_FILES
    from dtpshard.model.tensor_files import TensorFiles

    teacher, tok = Path(teacher), Path(tokenizer or teacher)
    files = {f"{TEACHER}/{f.name}": f for f in TensorFiles(teacher).files}
    files[CONFIG] = teacher / "config.json"
    files.update({f"{TOKENIZER}/{n}": tok / n for n in TOKENIZER_FILES if (tok / n).is_file()})
    if layout is not None:
        files[LAYOUT] = Path(layout)
    return files


def record(files: dict[str, Path], config: Any = None) -> dict[str, dict[str, Any]]:
    """{key: {sha256, identity}} of each file (`config`: the teacher's, read already)."""
    return {key: {"sha256": _sha256(p, key, config), "identity": _identity(p)} for key, p in files.items()}


def _what(key: str, path: Path) -> str:
    if key == CONFIG:
        return f"the teacher's config {path}"
    return f"the teacher's weight file {path}" if key.startswith(f"{TEACHER}/") else f"{path}"


def _same_names(recorded: dict[str, Any], files: dict[str, Path], where: str) -> None:
    """The teacher's weight files and the tokenizer's files are the ones recorded, by name."""
    for prefix, what in ((TEACHER, "the teacher's weight files"), (TOKENIZER, "the tokenizer's files")):
        now = sorted(k for k in files if k.startswith(f"{prefix}/"))
        then = sorted(str(k) for k in recorded if str(k).startswith(f"{prefix}/"))
        if now != then:
            names = ", ".join(k.split("/", 1)[1] for k in then) or "none"
            raise UserError(f"{where}: {what} are not those it was made from (then {names}); use --force to start "
                            "over with this teacher")


def check_unchanged(recorded: Any, files: dict[str, Path], where: str, config: Any = None) -> None:
    """Refuse, in one line naming the file, a file of `files` whose content is not what `recorded`
    (a `record`) says; `where`: the directory whose record it is."""
    if not isinstance(recorded, dict):
        raise UserError(f"{where}: records no hashes of its inputs (made by an older dtpshard); use --force to "
                        "start it over")
    _same_names(recorded, files, where)
    for key, path in files.items():
        entry = recorded.get(key)
        sha = entry.get("sha256") if isinstance(entry, dict) else None
        if not isinstance(sha, str):
            raise UserError(f"{where}: records no hash of {_what(key, path)}; use --force to start over")
        if entry.get("identity") == _identity(path):
            continue
        current = _sha256(path, key, config)
        if current != sha:
            raise UserError(f"{_what(key, path)} changed since {where} recorded it (sha256 {sha[:16]}, now "
                            f"{current[:16]}); restore it, or use --force to start over")


def hashes(recorded: dict[str, dict[str, Any]]) -> dict[str, str]:
    """{weight file name: sha256} of the teacher, as a model card gives them."""
    return {k.split("/", 1)[1]: v["sha256"] for k, v in recorded.items() if k.startswith(f"{TEACHER}/")}


KEY = "inputs"  # where a run's config.json keeps its record


def run_inputs(run: Path, resuming: bool, teacher: Path, layout: Path | None, main: bool,
               tokenizer: Path | None = None, config: Any = None) -> dict[str, Any] | None:
    """The record of a distillation's inputs: on a resume the one RUN/config.json holds, checked
    against the files now (on every rank alike); on a new run made now (by rank 0, which writes
    config.json; None on the others). A finished run of an older dtpshard, with no record, is left
    as it is (nothing of it is trained again)."""
    from dtpshard.core.io import read_json_object
    from dtpshard.training.rundir import CONFIG, is_done

    files = run_files(teacher, layout, tokenizer)
    if not resuming:
        return record(files, config) if main else None
    old = read_json_object(run / CONFIG, "run config").get(KEY)
    if old is None and is_done(run):
        return None
    check_unchanged(old, files, str(run), config)
    return old
