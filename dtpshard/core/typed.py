"""Values checked against type hints: one mechanism for every input a user writes.

A command-line word, a value of a `--config` file and a key of a study file or of an experiment's
config.json are each checked against the type of the parameter or dataclass field they set: the
constrained types of dtpshard.core.vocab (`Annotated[int, Constraint(...)]`), `Literal` choices,
lists, `X | None`, paths and nested dataclasses. A refused value raises `Invalid`, which says in
words what it must be; the caller names the flag or the key. No CLI library is imported here:
cli.py hands `check` to its parser as the converter of every flag, studies/config.py builds its
dataclasses with `from_table`, and training/recipe.py checks a DistillConfig built in Python.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypedDict, Union

from dtpshard.core.errors import quote

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


@dataclass(frozen=True)
class Constraint:
    """What a value of a constrained type must also satisfy, as `Annotated` metadata:
    `Count = Annotated[int, Constraint(lambda n: n >= 1, "int >= 1", "an integer >= 1")]`.
    ok tests a value already of the base type; words is what --help says the type takes, wants
    what a refusal says a value must be."""

    ok: Callable[[Any], bool]
    words: str
    wants: str


class Invalid(ValueError):
    """A value its type refuses. wants: what it must be ("an integer >= 1"); value: as given; key:
    where it was in a table (`training.lr`, `arms[2].kind`), empty for a command-line word. Its
    text is the one line a file's refusal prints: `training.lr = -1: must be a finite number > 0`."""

    def __init__(self, wants: str, value: Any, key: str = "", line: str | None = None):
        self.wants, self.value, self.key = wants, value, key
        super().__init__(line or (f"{key} = {quote(value)}: must be {wants}" if key else f"must be {wants}"))


def _parts(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    return typing.get_origin(hint), typing.get_args(hint)


def _members(hint: Any) -> list[Any] | None:
    """The members of a Union (`X | None` included), or None for any other hint."""
    origin, args = _parts(hint)
    return list(args) if origin in (Union, types.UnionType) else None


def optional_of(hint: Any) -> Any:
    """X for `X | None`, else the hint itself."""
    members = _members(hint)
    rest = [m for m in members or () if m is not type(None)]
    return rest[0] if members and len(rest) == 1 else hint


def is_list(hint: Any) -> bool:
    base = optional_of(hint)
    return base is list or _parts(base)[0] is list


def is_bool(hint: Any) -> bool:
    return optional_of(hint) is bool


def choices(hint: Any) -> tuple[Any, ...]:
    """The choices of a `Literal` (or `Literal | None`), else ()."""
    origin, args = _parts(optional_of(hint))
    return args if origin is Literal else ()


def words(hint: Any, inner: bool = False) -> str:
    """What --help says a value of `hint` is: `list[Path] | None` -> `list of path, or null`,
    `Literal["auto", "on"]` -> `auto | on` (in brackets inside a list), Count -> `int >= 1`."""
    origin, args = _parts(hint)
    if origin is Annotated:
        return next((m.words for m in args[1:] if isinstance(m, Constraint)), None) or words(args[0], inner)
    members = _members(hint)
    if members is not None:
        rest = [m for m in members if m is not type(None)]
        if len(rest) < len(members):
            return "true, false or null" if rest == [bool] else " | ".join(words(m) for m in rest) + ", or null"
        return " | ".join(words(m, inner) for m in rest)
    if origin is Literal:
        text = " | ".join(map(str, args))
        return f"({text})" if inner and len(args) > 1 else text
    if hint is list or origin is list:
        return "list of " + words(args[0] if args else Any, inner=True)
    if dataclasses.is_dataclass(hint):
        return "table"
    return {bool: "true or false", int: "int", float: "number", str: "text", Path: "path"}.get(hint, "value")


def wants(hint: Any) -> str:
    """What a refusal says a value of `hint` must be: Count -> `an integer >= 1`."""
    origin, args = _parts(hint)
    if origin is Annotated:
        return next((m.wants for m in args[1:] if isinstance(m, Constraint)), None) or wants(args[0])
    members = _members(hint)
    if members is not None:
        return " or ".join(wants(m) for m in members if m is not type(None))
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if hint is list or origin is list:
        return "a list, each " + wants(args[0]) if args else "a list"
    if dataclasses.is_dataclass(hint):
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a path"}.get(
        hint, "a value")


def _deeper(e: Invalid, key: str) -> bool:
    """An error from inside a value (a table's key, a list's item): it keeps its own key."""
    return e.key != key and e.key.startswith(key)


def check(hint: Any, value: Any, *, text: bool = False, key: str = "") -> Any:
    """`value` as `hint` says (a Path from a string, a dataclass from a table), or Invalid.
    text: value is a command-line word, or a list of words for a list type, parsed as the type
    says ("3" an int, "off" false, "null" None where None is allowed); otherwise it is a value of
    a parsed file (TOML, YAML, JSON) or of Python, where 2.5 is no integer and "3" no number.
    key names the value in a table, for the refusal."""
    origin, args = _parts(hint)
    if origin is Annotated:  # a constrained type: every failure says what the constraint wants
        try:
            out = check(args[0], value, text=text, key=key)
        except Invalid as e:
            if _deeper(e, key):
                raise
            out = e
        if isinstance(out, Invalid) or not all(m.ok(out) for m in args[1:] if isinstance(m, Constraint)):
            raise Invalid(wants(hint), value, key) from None
        return out
    members = _members(hint)
    if members is not None:
        if type(None) in members and (value is None or (text and value == "null")):
            return None
        for member in (m for m in members if m is not type(None)):
            try:
                return check(member, value, text=text, key=key)
            except Invalid as e:
                if _deeper(e, key):
                    raise
        raise Invalid(wants(hint), value, key)
    if origin is Literal:
        if any(type(value) is type(c) and value == c for c in args):
            return value
        raise Invalid(wants(hint), value, key)
    if hint is list or origin is list:
        items = (value if isinstance(value, list) else [value]) if text else value
        if not isinstance(items, list):
            raise Invalid(wants(hint), value, key)
        try:
            return [check(args[0] if args else Any, v, text=text, key=f"{key}[{i}]") for i, v in enumerate(items)]
        except Invalid as e:
            if e.key.startswith(f"{key}[") and "." in e.key[len(key):]:  # inside a table of it: arms[2].kind
                raise
            raise Invalid(wants(hint), value, key) from None
    if dataclasses.is_dataclass(hint):
        return from_table(hint, value, key)
    if hint is Any or isinstance(hint, typing.TypeVar) or origin is dict:
        return value
    return _scalar(hint, value, text, key)


def _scalar(hint: Any, value: Any, text: bool, key: str) -> Any:
    if text and isinstance(value, str):
        word = value.strip().lower()
        try:
            if hint is bool and word in _TRUE + _FALSE:
                return word in _TRUE
            if hint is int:
                return int(value)
            if hint is float:
                return float(value)
        except ValueError:
            pass
        if hint in (str, Path):
            return hint(value)
        raise Invalid(wants(hint), value, key)
    if hint is bool and isinstance(value, bool):
        return value
    if (hint is float and isinstance(value, (int, float)) or hint is int and isinstance(value, int)) and \
            not isinstance(value, bool):
        return value  # an int is a number: δ = 1 stays 1 (config.json and the report print 1, not 1.0)
    if hint is str and isinstance(value, (str, os.PathLike)):
        return os.fspath(value)  # a Path where a list of file names is expected, from Python
    if hint is Path and isinstance(value, (str, os.PathLike)):
        return Path(value)
    if not isinstance(hint, type):
        raise TypeError(f"no check for the type {hint!r}")  # a signature this module does not know
    if hint not in (bool, int, float, str, Path) and isinstance(value, hint):
        return value
    raise Invalid(wants(hint), value, key)


def join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def from_table(cls: type, table: Any, key: str = "") -> Any:
    """The dataclass `cls` from a mapping (a study file's table, a config.json record): each key
    checked against its field's type (nested tables and lists of tables too), the defaults for
    the keys it does not give. An unknown key or a missing required one is refused by its full key."""
    if not isinstance(table, dict):
        raise Invalid("a table", table, key or "config")
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    values = {}
    for name, value in table.items():  # in the table's order: the first problem is the one named
        if name not in fields:
            raise Invalid("", value, join(key, str(name)),
                          line=f"unknown key {quote(join(key, str(name)))} (known: {', '.join(sorted(fields))})")
        values[name] = check(hints[name], value, key=join(key, name))
    for name, f in fields.items():
        if name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise Invalid("", None, join(key, name), line=f"missing key {join(key, name)!r}")
    return cls(**values)


def partial_of(cls: type, skip: tuple[str, ...] = ()) -> type:
    """A TypedDict of the dataclass `cls`'s fields but `skip`, every key optional, a dataclass
    field a TypedDict of its own fields: the keys of a table that overrides some of a file's
    (`experiment --training.lr`), each with its field's type and its class's docstring."""
    hints = typing.get_type_hints(cls, include_extras=True)
    keys = {f.name: partial_of(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else hints[f.name]
            for f in dataclasses.fields(cls) if f.name not in skip}
    out = TypedDict(f"Partial{cls.__name__}", keys, total=False)  # type: ignore[operator]
    out.__doc__ = cls.__doc__
    return out
