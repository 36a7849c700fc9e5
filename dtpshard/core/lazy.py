"""Package exports that import their module only when first used, so `dtpshard --help` stays fast."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """`names` maps an exported name to the submodule (relative to `package`) that defines it."""
    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{names[name]}"), name)
    return __getattr__, sorted(names)
