"""The packages follow the pipeline: each imports only from the stages before it (README)."""
import ast
import importlib
import pkgutil
from pathlib import Path

import dtpshard

ORDER = ["core", "model", "data", "affinity", "layouts", "training", "studies"]
ALLOWED = {p: set(ORDER[:i + 1]) for i, p in enumerate(ORDER)}
ALLOWED["runtime"] = {"core", "model", "runtime"}
PKG = Path(dtpshard.__file__).parent


def test_every_module_imports():
    for m in pkgutil.walk_packages(dtpshard.__path__, "dtpshard."):
        if not m.name.endswith("__main__"):
            importlib.import_module(m.name)


def test_no_module_imports_from_a_later_stage():
    upward = []
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(PKG).with_suffix("").parts
        if len(parts) < 2:  # top-level modules (cli, __init__) may import anything
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dtpshard."):
                stage = node.module.split(".")[1]
                if stage not in ALLOWED[parts[0]]:
                    upward.append(f"{f.relative_to(PKG)}:{node.lineno} imports {node.module}")
    assert not upward, upward
