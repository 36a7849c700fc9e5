"""transformers' loaders, run with no code from the directory they read.

A checkpoint's config.json or tokenizer_config.json may name Python of its own (`auto_map`).
Left to its default, transformers asks on stdin whether to run it (so `yes y | dtpshard ...`
runs it) or, where a class of its own fits, runs nothing. Every `from_pretrained` of dtpshard
goes through `load`, which says no explicitly and reads only local files. A DTP student's own
remote code (model/student.py) is no exception: dtpshard reads a student as data and never
runs that code either.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

CUSTOM_CODE = "custom code"  # transformers' refusal of a directory's own Python, with trust_remote_code=False


def load(loader: Any, path: str | Path, **kwargs: Any) -> Any:
    """loader.from_pretrained(path, **kwargs) (an Auto* class or a config/tokenizer class) with
    trust_remote_code=False and local files only; a caller cannot ask for more."""
    if "trust_remote_code" in kwargs:
        raise TypeError("dtpshard never runs a checkpoint's code: trust_remote_code is always False")
    return loader.from_pretrained(str(path), trust_remote_code=False, local_files_only=True, **kwargs)


def refused_code(e: BaseException) -> bool:
    """Whether `e` is transformers refusing to load a directory without running its own Python."""
    return isinstance(e, ValueError) and CUSTOM_CODE in str(e)
