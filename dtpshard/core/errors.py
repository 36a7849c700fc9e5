"""The one exception that the CLI turns into a single line and exit code 2, and the one place that
turns other libraries' and the OS's errors into such a line (`explain`).

Library errors rarely say which file they were about (a SafetensorError, a JSONDecodeError, a
write that failed for lack of space). Code that opens a file wraps the work in `naming(path)`,
which turns any error `describe` understands into a UserError that names the file; `explain`
handles whatever escapes without a name. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class UserError(Exception):
    """Bad input from the user: a config, a file, a flag. The message is one line naming it."""


_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-[^/]*$")  # io's temporaries: .NAME.tmp-PID[-X][.old]


def public_path(path: str | Path) -> str:
    """The path a user asked for: a temporary of io.atomic_* is shown as the file it becomes."""
    parts = [(_TMP.match(p).group("name") if _TMP.match(p) else p) for p in Path(path).parts]
    return str(Path(*parts)) if parts else str(path)


_OS_WHAT = {
    errno.ENOSPC: ("no space left on device", "free some space or write elsewhere"),
    errno.EDQUOT: ("disk quota exceeded", "free some space or write elsewhere"),
    errno.EACCES: ("permission denied", "check the file's permissions"),
    errno.EPERM: ("operation not permitted", "check the file's permissions"),
    errno.EROFS: ("read-only file system", "write elsewhere"),
    errno.ENOENT: ("no such file or directory", "check the path"),
    errno.EFBIG: ("file too large for this process's file-size limit", "raise `ulimit -f`, or write less"),
    errno.ELOOP: ("a symbolic link, which dtpshard never writes through", "remove the link, or write elsewhere"),
}
_WRITING = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def _os_line(exc: OSError, path: str | Path | None) -> str:
    path = exc.filename if exc.filename is not None else path
    what, todo = _OS_WHAT.get(exc.errno or -1, ((exc.strerror or str(exc)).lower() or "I/O error", ""))
    todo = f" ({todo})" if todo else ""
    if path is None:
        return f"{what}{todo}"
    where = "writing" if exc.errno in _WRITING else "on" if exc.errno not in (errno.ENOENT, errno.ELOOP) else ":"
    return f"{what} {where} {public_path(path)}{todo}".replace(" : ", ": ")


def first_line(exc: BaseException, limit: int = 200, named: bool = False) -> str:
    """An exception in a refusal: the first non-blank line of its message, at most `limit`
    characters, or its type's name when the message is empty (never an IndexError); named:
    "Type: line"."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    line = lines[0][:limit] if lines else ""
    if named and line:
        return f"{type(exc).__name__}: {line}"
    return line or type(exc).__name__


_SIZE = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[.*?\])\) from "
                   r"checkpoint, the shape in current model is torch\.Size\((\[.*?\])\)")


def describe(exc: BaseException, path: str | Path | None = None) -> str | None:
    """One line for an error a user can cause (about `path` when the error does not name a file);
    None for anything else."""
    if isinstance(exc, UserError):
        return str(exc)
    at = f"{public_path(path)}: " if path is not None else ""
    if isinstance(exc, OSError) and exc.errno is not None:
        return _os_line(exc, path)
    if isinstance(exc, UnicodeDecodeError):
        return f"{at}not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}; save it as UTF-8)"
    if isinstance(exc, json.JSONDecodeError):
        return f"{at}malformed JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
    if type(exc).__name__ == "SafetensorError":  # safetensors' Rust error: a truncated or damaged file
        return f"{at}not a readable safetensors file ({first_line(exc)}); it may be truncated: copy it again"
    if isinstance(exc, RuntimeError):
        m = _SIZE.search(str(exc))
        if m:
            return (f"{at}tensor {m.group(1)} has shape {m.group(2)} in the weights but the config implies "
                    f"{m.group(3)} (config.json does not match the weights)")
    return None


def explain(exc: BaseException) -> str | None:
    """One line saying what went wrong and what to do, for errors a user can cause or fix
    (bad files, a full disk, permissions); None for a bug, which should keep its traceback."""
    return describe(exc)


@contextlib.contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Errors inside that `describe` understands become a UserError naming `path` (the file being
    read or written); others (bugs) pass through untouched."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # `describe` decides which ones are the user's
        line = describe(e, path)
        if line is None:
            raise
        if isinstance(e, OSError) and e.errno is not None:
            e.filename = e.filename if e.filename is not None else str(path)
            raise  # an OSError keeps its type (callers test errno); explain names the file
        raise UserError(line) from None


def check_result(values: dict[str, object], where: str) -> None:
    """A result is reported only when it is a number: a NaN or infinite metric (a model whose
    numbers overflow, a damaged checkpoint) is refused in one line instead of printed as a result.
    None stands for a metric not asked for (KL without a teacher) and passes."""
    for name, v in values.items():
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v)):
            raise UserError(f"{where}: {name} is {v!r}, not a finite number (the model's outputs are not finite); "
                            "no result reported")


QUOTE_CHARS = 200  # characters of a value a refusal shows at most


def quote(value: object, repr_: bool = True) -> str:
    """A value as a refusal shows it: its repr (or str), at most about QUOTE_CHARS characters
    however large it is (reprlib stops early inside a long string or a big list)."""
    import reprlib

    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = QUOTE_CHARS
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = 16
    text = r.repr(value) if repr_ else " ".join(str(value).split())  # one line
    return text if len(text) <= QUOTE_CHARS else f"{text[:QUOTE_CHARS]}..."


def typed_config(cls: Any, raw: dict[str, Any], where: str) -> Any:
    """transformers' config class `cls` of the dict `raw`: the one conversion of its errors for a
    value of the wrong type (`config_errors`) into one line naming the file."""
    try:
        return cls.from_dict(raw)
    except (ValueError, TypeError, KeyError, *config_errors()) as e:
        raise UserError(f"{where}: {first_line(e)}") from None


def config_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises for a config value of the wrong type, besides ValueError and
    TypeError: huggingface_hub's strict-dataclass checks (transformers 5), an Exception of their own."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: transformers' checks raise ValueError and TypeError
        return ()
    return (StrictDataclassError,)
