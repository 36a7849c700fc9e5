"""A command's flags as a view of the library's settings dataclasses: the fields it takes, each
with its type and default from the one definition, and its help from that definition's docstring
unless the command says it otherwise. cyclopts reads the view as any dataclass."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

import docstring_parser


def view(name: str, *classes: type, drop: set[str] | frozenset[str] = frozenset(),
         helps: dict[str, str] | None = None, doc: str = "", positional: tuple[str, ...] = ()) -> type:
    """A frozen dataclass of the fields of `classes` (the first class that has a name wins) but
    `drop`, with their types and defaults, keyword-only but the `positional` ones (TEACHER);
    `helps` replaces a field's help line."""
    helps = dict(helps or {})
    said: dict[str, str] = {}
    for c in classes:  # a class's own docstring first, then its bases' (Recipe's fields in DistillConfig)
        for k in c.__mro__:
            for a in docstring_parser.parse(k.__doc__ or "").params:
                said.setdefault(a.arg_name, a.description or "")
    seen: dict[str, tuple[type, dataclasses.Field]] = {}
    for c in classes:
        for f in dataclasses.fields(c):
            if f.name not in drop and f.name not in seen:
                seen[f.name] = (c, f)

    def default(f: dataclasses.Field) -> Any:
        kw = {"kw_only": f.name not in positional}
        if f.default is not dataclasses.MISSING:
            return dataclasses.field(default=f.default, **kw)
        if f.default_factory is not dataclasses.MISSING:
            return dataclasses.field(default_factory=f.default_factory, **kw)
        return dataclasses.field(**kw)

    fields = [(n, typing.get_type_hints(c, include_extras=True)[n], default(f)) for n, (c, f) in seen.items()]
    missing = dataclasses.MISSING
    required = [x for x in fields if x[2].default is missing and x[2].default_factory is missing]
    cls = dataclasses.make_dataclass(name, required + [x for x in fields if x not in required], frozen=True,
                                     namespace={"__module__": __name__})
    cls.__doc__ = (doc or name) + "\n\nArgs:\n" + "".join(
        f"    {n}: {' '.join((helps.get(n) or said.get(n) or '').split())}\n" for n, _, _ in fields)
    return cls


def values(flags: Any) -> dict[str, Any]:
    """A view's values by field name."""
    return {f.name: getattr(flags, f.name) for f in dataclasses.fields(flags)}
