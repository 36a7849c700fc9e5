"""The packages follow the pipeline: each imports only from the stages before it (README)."""
import ast
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import dtpshard

ORDER = ["core", "model", "data", "affinity", "layouts", "downstream", "training", "studies"]
ALLOWED = {p: set(ORDER[:i + 1]) for i, p in enumerate(ORDER)}
ALLOWED["transport"] = {"core", "model", "transport"}  # how partials travel between processes
ALLOWED["runtime"] = {"core", "model", "transport", "runtime"}
ALLOWED["serve"] = {"core", "model", "transport", "serve"}  # the vLLM model: the student format and the schedule only
ALLOWED["commands"] = {*ORDER, "transport", "runtime", "serve", "commands"}  # the command layer sits on top of them all
OPTIONAL = {"dtpshard.serve.vllm_model": "vllm"}  # modules that need an optional package, and which
PKG = Path(dtpshard.__file__).parent


def test_every_module_imports():
    for m in pkgutil.walk_packages(dtpshard.__path__, "dtpshard."):
        needs = OPTIONAL.get(m.name)
        if m.name.endswith("__main__") or (needs and importlib.util.find_spec(needs) is None):
            continue
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


def test_commands_sit_on_top_of_the_library():
    """cyclopts and the `*_cmd` functions live in dtpshard/commands/ and cli.py only: a library
    module returns values and parses no flags."""
    found = []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG)
        if rel.parts[0] == "commands" or rel.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(n.split(".")[0] == "cyclopts" for n in names):
                found.append(f"{rel}:{node.lineno} imports cyclopts")
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_cmd"):
                found.append(f"{rel}:{node.lineno} defines {node.name}")
    assert not found, found


def _imports_anywhere() -> dict[str, set[str]]:
    """module -> the dtpshard modules it imports, at the top or inside a function."""
    names = {".".join(("dtpshard", *f.relative_to(PKG).with_suffix("").parts)).removesuffix(".__init__"): f
             for f in PKG.rglob("*.py")}
    graph = {}
    for mod, f in names.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            targets = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                       [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if isinstance(node, ast.ImportFrom) and node.module:  # `from pkg import module`
                targets += [f"{node.module}.{a.name}" for a in node.names]
            deps |= {t for t in targets if t in names and t != mod and not names[t].name == "__init__.py"}
        graph[mod] = deps
    return graph


def test_no_import_cycles_even_inside_functions():
    graph = _imports_anywhere()
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_every_package_export_resolves():
    """A package's lazy exports (core/lazy.py) name the module that defines each."""
    broken = []
    for m in pkgutil.iter_modules(dtpshard.__path__, "dtpshard."):
        if m.ispkg:
            package = importlib.import_module(m.name)
            for name in package.__all__:
                try:
                    getattr(package, name)
                except (AttributeError, ImportError) as e:
                    broken.append(f"{m.name}.{name}: {e}")
    assert not broken, broken


LONG_FUNCTIONS = {"assign", "compute_affinity", "load_study"}  # docs/code.md says why each is one piece


def test_size_bars():
    """cli.py under 250 lines, every module at most 400, no function over 60 lines but the three
    docs/code.md names."""
    assert len((PKG / "cli.py").read_text().splitlines()) < 250
    over = []
    for f in sorted(PKG.rglob("*.py")):
        text = f.read_text()
        if len(text.splitlines()) > 400:
            over.append(f"{f.relative_to(PKG)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in LONG_FUNCTIONS:
                if node.end_lineno - node.lineno + 1 > 60:
                    over.append(f"{f.relative_to(PKG)}:{node.lineno} {node.name}")
    assert not over, over
