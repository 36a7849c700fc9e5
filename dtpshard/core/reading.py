"""Reading what a user gives: only regular files, only up to a cap, parsed within bounds.

Every file dtpshard reads (a --config, a study file, a --text file, a tokenizer file, a file
`permute` copies, a layout, a JSON record, metrics.jsonl, weights) is opened by `open_regular`
(or for safetensors' own reader, checked by it first: `open_safetensors`): opened
with O_NONBLOCK (opening a FIFO would otherwise wait for a writer), then fstat on that
descriptor (not a stat before opening, which a rename in between would fool) refuses anything
but a regular file (a directory, a FIFO, a device, a socket) by name, and a file larger than
its cap. A read takes cap + 1 bytes at most, so a file that grows meanwhile is refused too.
Every JSON or YAML value is then bounded in depth and integers (`loads`, `check_tree`), and
YAML aliases are bounded (`load_yaml`): an alias bomb would otherwise grow without end.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from dtpshard.core.errors import UserError, first_line, naming, quote

SMALL_JSON = 16 << 20  # bytes: a config, a record, a manifest, a results table (real ones are < 1 MiB)
STUDY_BYTES = 1 << 20  # a study file or a --config file: a few KiB in practice
MAX_DEPTH = 32  # nesting: our formats need at most 6
INT_LIMIT = 2 ** 63  # no count, size or index of ours reaches it
_CHUNK = 16 << 20  # bytes per read past the size fstat gave (a file growing as it is read)

_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a file")


class _NotRegular(Exception):
    def __init__(self, mode: int):
        self.mode = mode


def _regular(path: str, flags: int) -> int:
    """open()'s opener: the descriptor of a regular file, else _NotRegular with what it is."""
    fd = os.open(path, flags | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _NotRegular(mode)
    os.set_blocking(fd, True)
    return fd


def _refused(path: Path, where: str, mode: int) -> UserError:
    real = os.path.realpath(path)
    via = f" (it resolves to {real})" if real != os.path.abspath(path) else ""
    return UserError(f"{where}: is {_kind(mode)}{via}, not a regular file")


def _open_failed(e: OSError, path: Path, where: str) -> UserError:
    if e.errno == errno.ENOENT:
        return UserError(f"{where}: no such file")
    if e.errno == errno.ENXIO:  # a socket cannot be opened: say what it is
        with contextlib.suppress(OSError):
            return _refused(path, where, os.stat(path).st_mode)
    return UserError(f"{where}: cannot read it ({(e.strerror or str(e)).lower()})")


@contextlib.contextmanager
def open_regular(path: str | Path, cap: int, what: str = "file", where: str | None = None) -> Iterator[BinaryIO]:
    """`path` open for binary reading, or one line (starting `where`, default the path) when it
    is not a regular file or holds more than `cap` bytes ("more than a `what` can need")."""
    path = Path(path)
    where = str(path) if where is None else where
    try:
        f = open(path, "rb", opener=_regular)  # builtins.open: what a test counting reads sees
    except _NotRegular as e:
        raise _refused(path, where, e.mode) from None
    except OSError as e:
        raise _open_failed(e, path, where) from None
    with f, naming(path):
        size = os.fstat(f.fileno()).st_size
        if size > cap:
            raise UserError(f"{where}: {size} bytes, more than a {what} can need ({cap} at most)")
        yield f


ANY_SIZE = 1 << 62  # the cap of a file read in pieces whatever its size (weights hashed, a tensor file mapped)


def check_regular(path: str | Path, where: str | None = None) -> bool:
    """Whether `path` exists, refusing in one line (as `open_regular`) one that is not a regular
    file: what a command appends to or replaces in a directory of its own (a FIFO would block the
    write, a link to a device would take it)."""
    if not os.path.lexists(path):
        return False
    with open_regular(path, ANY_SIZE, where=where):
        return True


def open_safetensors(path: str | Path, framework: str = "pt", where: str | None = None) -> Any:
    """safetensors' own reader (`safe_open`, which maps the file) of `path`, once `open_regular`
    has seen a regular file there: safetensors would open a FIFO and wait for a writer."""
    from safetensors import safe_open

    with open_regular(path, ANY_SIZE, "safetensors file", where):
        pass
    return safe_open(str(path), framework=framework)  # its errors are the caller's to word


def read_bytes(path: str | Path, cap: int, what: str = "file", where: str | None = None) -> bytes:
    """The bytes of regular file `path`, at most `cap` of them (`open_regular` says the rest)."""
    with open_regular(path, cap, what, where) as f:
        parts, left, ask = [], cap + 1, os.fstat(f.fileno()).st_size + 1
        while left and (chunk := f.read(min(ask, left))):
            parts.append(chunk)
            left, ask = left - len(chunk), _CHUNK
    if not left:
        raise UserError(f"{where or path}: grew past {cap} bytes while being read, more than a {what} can need")
    return b"".join(parts)


def read_text(path: str | Path, cap: int, what: str = "file", where: str | None = None) -> str:
    """The UTF-8 text of regular file `path` (as `read_bytes`); not UTF-8 is one line naming it."""
    data = read_bytes(path, cap, what, where)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{where or path}: cannot read it (not UTF-8 text), byte 0x{data[e.start]:02x} at offset "
                        f"{e.start}: save it as UTF-8") from None


# -- bounded parsing -----------------------------------------------------------------------------
# A damaged or hostile file is one line, never a RecursionError, a 4300-digit ValueError or an
# allocation sized by a number in it.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


class _TooBig(ValueError):
    pass


def _bounded_int(text: str, limit: int = INT_LIMIT) -> int:
    if len(text.lstrip("-")) > len(str(limit)) or not -limit < int(text) < limit:
        raise _TooBig(text)
    return int(text)


def _nesting(bare: str) -> int:
    """The deepest [ / { nesting of JSON text without its strings (numpy: one pass, not a Python loop)."""
    b = np.frombuffer(bare.encode("utf-8", "replace"), dtype=np.uint8)
    if not b.size:
        return 0
    step = ((b == 91) | (b == 123)).astype(np.int32) - ((b == 93) | (b == 125))
    return int(np.cumsum(step).max())


def loads(text: str, where: str, max_depth: int = MAX_DEPTH, int_limit: int = INT_LIMIT) -> Any:
    """json.loads within bounds: refused in one line naming `where` when nested deeper than
    `max_depth` or holding an integer of `int_limit` (2**63) or more; malformed JSON as `naming`
    says. (transformers writes a tokenizer's unbounded model_max_length as 10**30: its files pass
    a larger limit, still far from the 4300 digits that make int() slow.)"""
    bare = _STRING.sub("", text)
    if _nesting(bare) > max_depth:
        raise UserError(f"{where}: nested more than {max_depth} levels deep (not a file dtpshard wrote)")
    # ints of at most 18 digits are all below 2**63: only text with a longer run of digits pays
    # for a Python call per integer
    bounded = {"parse_int": functools.partial(_bounded_int, limit=int_limit)} if re.search(r"[0-9]{19}", bare) else {}
    try:
        return json.loads(text, **bounded)  # malformed JSON raises JSONDecodeError: `naming` words it
    except _TooBig as e:
        digits = str(e)
        raise UserError(f"{where}: integer {digits[:20]}{'...' if len(digits) > 20 else ''} is beyond any "
                        f"count or index (at most {'2**63' if int_limit == INT_LIMIT else int_limit} - 1)") from None


def check_tree(obj: Any, where: str, max_depth: int = MAX_DEPTH) -> Any:
    """The same bounds for a value another parser made (TOML, YAML): depth and integers. Each
    container is visited once, even if it is shared."""
    seen, todo = set(), [(obj, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and not -INT_LIMIT < value < INT_LIMIT:
            raise UserError(f"{where}: integer {str(value)[:20]}... is beyond any count or index (at most 2**63 - 1)")
        if isinstance(value, (dict, list)) and id(value) not in seen:
            if depth > max_depth:
                raise UserError(f"{where}: nested more than {max_depth} levels deep")
            seen.add(id(value))
            items = list(value.keys()) + list(value.values()) if isinstance(value, dict) else value
            todo += [(v, depth + 1) for v in items]
    return obj


YAML_NODES = 1 << 20  # values of a YAML document with its aliases expanded (a 1 MiB file holds fewer)


class _Bomb(Exception):
    pass


def _children(node: Any) -> list[Any]:
    value = node.value
    if not isinstance(value, list):  # a scalar
        return []
    return [n for pair in value for n in pair] if value and isinstance(value[0], tuple) else value


def _expanded(root: Any) -> int:
    """How many values the node graph `root` stands for with every alias expanded (each shared
    node counted once per use, computed once); _Bomb past YAML_NODES or for an alias inside its
    own anchor (a value containing itself)."""
    size: dict[int, int] = {}
    busy: set[int] = set()
    stack = [root]
    while stack:
        node = stack[-1]
        if id(node) in size:
            stack.pop()
        elif id(node) not in busy:  # first visit: its children first
            busy.add(id(node))
            for child in _children(node):
                if id(child) in busy and id(child) not in size:
                    raise _Bomb(f"line {child.start_mark.line + 1}: a YAML alias inside its own anchor")
                stack.append(child)
        else:
            size[id(node)] = 1 + sum(size[id(c)] for c in _children(node))
            if size[id(node)] > YAML_NODES:
                raise _Bomb(f"its YAML aliases expand to more than {YAML_NODES} values (a billion laughs?)")
            stack.pop()
    return size[id(root)]


@functools.cache
def _yaml_loader() -> type:
    import yaml  # only the commands given a YAML file pay for importing it

    class Bounded(yaml.SafeLoader):
        """SafeLoader whose aliases (`*name`) may repeat a value, but not without bound: nine nested
        aliases of nine items each stand for 9**9 values wherever a reader walks them. Only plain
        data: text, numbers, booleans, null, lists and mappings whose keys are text and appear
        once (YAML 1.2 forbids duplicates; a later one silently winning is a typo unreported)."""

        def compose_document(self) -> Any:
            node = super().compose_document()
            _expanded(node)
            return node

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            self.flatten_mapping(node)
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, str):
                    raise _Bomb(f"line {key_node.start_mark.line + 1}: key {quote(key)} is not text "
                                "(a key names an option or a field)")
                if key in seen:
                    raise _Bomb(f"line {key_node.start_mark.line + 1}: key {quote(key)} appears twice")
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    def plain_only(loader: Any, node: Any) -> Any:
        raise _Bomb(f"line {node.start_mark.line + 1}: tag {node.tag.replace('tag:yaml.org,2002:', '!!')} is not "
                    "plain data (text, numbers, booleans, null, lists and mappings only)")

    for tag in ("binary", "set", "timestamp", "omap", "pairs"):
        Bounded.add_constructor(f"tag:yaml.org,2002:{tag}", plain_only)
    return Bounded


def load_yaml(text: str, where: str) -> Any:
    """The YAML (or JSON) value of `text`, within `check_tree`'s bounds and YAML_NODES values with
    its aliases expanded; malformed YAML, an alias bomb or too deep a nesting is one line naming `where`."""
    import yaml

    try:
        return check_tree(yaml.load(text, Loader=_yaml_loader()), where)
    except _Bomb as e:
        raise UserError(f"{where}: {e}") from None
    except RecursionError:
        raise UserError(f"{where}: nested more than {MAX_DEPTH} levels deep") from None
    except yaml.YAMLError as e:
        raise UserError(f"{where}: not YAML or JSON ({quote(first_line(e), repr_=False)})") from None


def read_json(path: str | Path, what: str = "file", max_bytes: int = SMALL_JSON) -> Any:
    """The JSON value in regular file `path` of at most `max_bytes`, as `loads`; every problem one
    line naming it (malformed JSON with its line)."""
    text = read_text(path, max_bytes, what)
    with naming(path):
        return loads(text, str(path))


def read_json_object(path: str | Path, what: str = "file", max_bytes: int = SMALL_JSON,
                     keys: set[str] | None = None) -> dict[str, Any]:
    """A JSON object as `read_json`; with `keys`, any other key is refused (a typo is not ignored)."""
    obj = read_json(path, what, max_bytes)
    if not isinstance(obj, dict):
        raise UserError(f"{path}: expected a JSON object ({what}), found {type(obj).__name__}")
    if keys is not None:
        check_keys(obj, keys, f"{path}")
    return obj


def read_options(path: str | Path, flag: str = "--config") -> dict[str, Any]:
    """A command's options file (YAML or JSON, a mapping of option names to values): a regular file
    of at most STUDY_BYTES, as `load_yaml`; any problem is one line naming `flag` and the file."""
    where = f"{flag} {path}"
    data = load_yaml(read_text(path, STUDY_BYTES, "config", where), where)
    if data is not None and not isinstance(data, dict):  # an empty file sets nothing
        raise UserError(f"{where}: must hold a mapping of option names to values, not {type(data).__name__}")
    if isinstance(data, dict) and "config" in data:  # the command line's own --config: never silently ignored
        raise UserError(f"{where}: key 'config': an options file cannot name another (give each file with its own "
                        "--config)")
    check_words(data or {}, where)
    return data or {}


WORD_BYTES = 1 << 17  # the longest word a command line can hold (Linux's MAX_ARG_STRLEN)


def check_words(data: Any, where: str, key: str = "") -> None:
    """An options file's keys and values checked as the command line's words are: text that is
    UTF-8 (a lone surrogate, which JSON and YAML escapes can make, is not), none longer than a
    command-line word can be (WORD_BYTES)."""
    if isinstance(data, dict):
        for k, v in data.items():
            check_words(k, where, key)
            check_words(v, where, f"{key}.{k}" if key else str(k))
    elif isinstance(data, list):
        for v in data:
            check_words(v, where, key)
    elif isinstance(data, str):
        name = "--" + key.replace("_", "-") if key else "a key"  # as the command line would say it
        try:
            size = len(data.encode("utf-8"))
        except UnicodeEncodeError:
            shown = data.encode("utf-8", "backslashreplace").decode("utf-8")
            raise UserError(f"{where}: {name} {quote(shown, False)} is not UTF-8 text (a lone surrogate)") from None
        if size > WORD_BYTES:
            raise UserError(f"{where}: {name} {quote(data, False)}: {size} bytes, longer than a command-line word "
                            f"can be ({WORD_BYTES})")


def check_keys(obj: dict[str, Any], known: set[str] | tuple[str, ...], where: str) -> None:
    """Refuse a key that is not one of `known`, naming it and the known ones."""
    unknown = sorted(str(k) for k in obj if k not in known)
    if unknown:
        raise UserError(f"{where}: unknown key {quote(unknown[0])} (known: {', '.join(sorted(known))})")
