"""Issue 41's rules for what a directory holds, by every command that reads it: nothing from a
checkpoint runs (a tokenizer's or a config's auto_map, with `y` waiting on stdin); weights and
tokenizers are checked as data (a float8, integer or bool tensor, two names of one parameter, a
malformed tokenizer file: one line naming it, nothing written); every file goes through the one
reader (a layout or metrics.jsonl that is a FIFO or a link to /dev/zero is refused by name, and no
package module opens a file any other way).

The commands run in a child process with a timeout and limits on memory and file size
(test_reliability_files.run_cli): a read that blocks fails the test instead of hanging it."""
import ast
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_reliability_files import KINDS, TOKENIZER_COMMANDS, command_line, make, refused, run_cli, study, tree

ROOT = Path(__file__).resolve().parents[1]
EVIL = "import pathlib\npathlib.Path({marker!r}).touch()\n{body}"


@pytest.fixture
def world(tmp_path, tiny_dirs):
    from test_experiment import corpus

    model = tmp_path / "model"
    shutil.copytree(tiny_dirs["llama"], model)
    return {"root": tmp_path, "model": model, "text": corpus(tmp_path / "t.txt")}


def variant(world, name, edit) -> Path:
    """A copy of the good model, changed by edit(directory)."""
    path = world["root"] / name
    shutil.copytree(world["model"], path)
    edit(path)
    return path


def one_line(result, *words):
    rc, err = result
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert all(w in lines[0] for w in words), (words, lines[0])
    return lines[0]


# -- no code from a checkpoint runs ----------------------------------------------------------------
def _own_tokenizer(marker: Path):
    def edit(d: Path) -> None:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg.update(tokenizer_class="EvilTokenizer",
                   auto_map={"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]})
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        (d / "tokenization_evil.py").write_text(EVIL.format(marker=str(marker), body=(
            "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n"
            "    pass\n")))
    return edit


def _own_config(marker: Path):
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(model_type="evil", auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                                "AutoModelForCausalLM": "modeling_evil.EvilModel"})
        (d / "config.json").write_text(json.dumps(cfg))
        body = "from transformers import LlamaConfig\nclass EvilConfig(LlamaConfig):\n    model_type = 'evil'\n"
        (d / "configuration_evil.py").write_text(EVIL.format(marker=str(marker), body=body))
    return edit


CONFIG_COMMANDS = [*TOKENIZER_COMMANDS, "layout", "permute"]


def test_no_code_from_a_checkpoint_runs_even_when_stdin_says_yes(world):
    root, marker = world["root"], world["root"] / "pwned"
    lay = root / "l.json"
    assert run_cli(["layout", world["model"], "--kind", "random", "--devices", "2", "--out", lay])[0][0] == 0
    models = {"tokenizer": variant(world, "own-tokenizer", _own_tokenizer(marker)),
              "config": variant(world, "own-config", _own_config(marker))}

    def argv(command, model):
        if command == "layout":
            return ["layout", model, "--kind", "contiguous", "--devices", "2", "--out", root / "out.json"]
        if command == "permute":
            return ["permute", model, lay, "--out", root / "out", "--check", "logits"]
        return command_line(command, world, root / "out", model=model)

    cases = [(kind, c) for kind, commands in (("tokenizer", TOKENIZER_COMMANDS), ("config", CONFIG_COMMANDS))
             for c in commands]
    argvs = [argv(c, models[kind]) for kind, c in cases]
    argvs += [["experiment", study(world, kind, model=models[kind]), "--out", root / "e"] for kind in models]
    before = tree(root)
    results = run_cli(*argvs, stdin="y\n" * 1000)  # transformers used to ask here, and take the yes
    for (kind, command), result in zip(cases + [(k, "experiment") for k in models], results):
        words = ("auto_map in tokenizer_config.json", "never runs") if kind == "tokenizer" else \
            ("config.json: model_type 'evil' names Python of its own", "never runs")
        one_line(result, str(models[kind]), *words)
        assert not marker.exists(), (kind, command)
    assert tree(root) == before


def test_every_pretrained_load_says_no_to_remote_code():
    """transformers is asked for nothing but through model/pretrained.py's `load`, which passes
    trust_remote_code=False (and refuses a caller's True); DTPModel's own from_pretrained reads data."""
    from dtpshard.model.pretrained import load

    calls = []
    for path in (ROOT / "dtpshard").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "from_pretrained":
                calls.append(f"{path.relative_to(ROOT)}: {ast.unparse(node.func)}")
    ours = [c for c in calls if c.startswith("dtpshard/model/pretrained.py") or "DTPModel.from_pretrained" in c]
    assert sorted(set(calls) - set(ours)) == []

    class Loader:
        @staticmethod
        def from_pretrained(path, **kw):
            return kw

    assert load(Loader, "x")["trust_remote_code"] is False
    with pytest.raises(TypeError, match="never runs a checkpoint's code"):
        load(Loader, "x", trust_remote_code=True)


# -- weights are numbers ------------------------------------------------------------------------------
Q = "model.layers.0.self_attn.q_proj.weight"


def _retyped(dtype, scales=False):
    def edit(d: Path) -> None:
        sd = load_file(d / "model.safetensors")
        sd[Q] = sd[Q].to(dtype) if dtype is not torch.bool else sd[Q] > 0
        if scales:
            sd[Q + "_scale_inv"] = torch.ones(1)
        save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    return edit


def _aliased(d: Path) -> None:
    sd = load_file(d / "model.safetensors")
    sd["norm.weight"] = sd["model.norm.weight"] * 2  # transformers reads model.norm.weight; which would we?
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})


WEIGHTS = {"float8": (_retyped(torch.float8_e4m3fn), f"tensor '{Q}' is stored as F8_E4M3 (float8) without its scales"),
           "float8 scaled": (_retyped(torch.float8_e4m3fn, True), "F8_E4M3 (float8) with its scales"),
           "int64": (_retyped(torch.int64), f"tensor '{Q}' is stored as I64, not floating-point weights"),
           "bool": (_retyped(torch.bool), f"tensor '{Q}' is stored as BOOL, not floating-point weights"),
           "two names": (_aliased, "holds both 'model.norm.weight' and 'norm.weight'")}


def test_weights_that_are_not_numbers_are_refused_by_every_command(world):
    root = world["root"]
    lay = root / "l.json"
    assert run_cli(["layout", world["model"], "--kind", "random", "--devices", "2", "--out", lay])[0][0] == 0
    models = {name: variant(world, name.replace(" ", "-"), edit) for name, (edit, _) in WEIGHTS.items()}
    commands = [*TOKENIZER_COMMANDS, "permute", "experiment"]

    def argv(command, model, name):
        if command == "permute":
            return ["permute", model, lay, "--out", root / "out"]
        if command == "experiment":
            return ["experiment", study(world, name.replace(" ", "-"), model=model), "--out", root / "e"]
        return command_line(command, world, root / "out", model=model)

    argvs = [argv(c, models[name], name) for name in WEIGHTS for c in commands]
    before = tree(root)
    results = iter(run_cli(*argvs))
    for name, (_, words) in WEIGHTS.items():
        for command in commands:
            assert one_line(next(results), str(models[name] / "model.safetensors"), words), command
    assert tree(root) == before  # refused before a stage ran (convert), nothing written


# -- tokenizers are data -----------------------------------------------------------------------------
def _json_edit(name, change):
    def edit(d: Path) -> None:  # a file transformers' save_pretrained may leave out is added
        old = json.loads((d / name).read_text()) if (d / name).is_file() else {}
        (d / name).write_text(json.dumps(change(old)))
    return edit


TOKENIZERS = {
    "no added_tokens": ("tokenizer.json", lambda t: {k: v for k, v in t.items() if k != "added_tokens"},
                        "no added_tokens list"),
    "added_tokens 5": ("tokenizer.json", lambda t: {**t, "added_tokens": 5}, "added_tokens must be a list"),
    "no model": ("tokenizer.json", lambda t: {k: v for k, v in t.items() if k != "model"},
                 "not a tokenizer the tokenizers library reads"),
    "a list": ("tokenizer.json", lambda t: [t], "not a tokenizer file (a JSON object expected, found list)"),
    "class 5": ("tokenizer_config.json", lambda c: {**c, "tokenizer_class": 5}, "tokenizer_class must be a class name"),
    "eos 5": ("tokenizer_config.json", lambda c: {**c, "eos_token": 5}, "eos_token must be a token's text"),
    "special map list": ("special_tokens_map.json", lambda _: ["<s>"], "a JSON object expected, found list"),
    "added ids": ("added_tokens.json", lambda _: {"x": "y"}, "token 'x' must map to an id"),
}


def test_a_malformed_tokenizer_file_is_refused_by_every_command(world):
    root = world["root"]
    models = {name: variant(world, name.replace(" ", "-"), _json_edit(f, change))
              for name, (f, change, _) in TOKENIZERS.items()}
    argvs = [a for name, m in models.items() for a in [
        *(command_line(c, world, root / "out", model=m) for c in TOKENIZER_COMMANDS),
        ["experiment", study(world, name.replace(" ", "-"), model=m), "--out", root / "e"]]]
    before = tree(root)
    results = iter(run_cli(*argvs))
    for name, (f, _, words) in TOKENIZERS.items():
        for _ in [*TOKENIZER_COMMANDS, "experiment"]:
            one_line(next(results), str(models[name] / f), words)
    assert tree(root) == before


# -- one reader: layouts and metrics ----------------------------------------------------------------------
def test_a_layout_that_is_not_a_regular_file_is_refused(world):
    """score, permute, distill --layout, eval --layout and generate --layout: a FIFO used to block
    forever, a link to /dev/zero to fill the memory."""
    from dtpshard.core.layout import MAX_BYTES

    root, m = world["root"], world["model"]
    aff = root / "a.safetensors"
    assert run_cli(["affinity", m, "--text", world["text"], "--blocks", "1", "--seq-len", "8", "--out", aff,
                    "--no-progress"])[0][0] == 0
    cases = {kind: make(kind, root / f"{kind}.json", MAX_BYTES) for kind in KINDS}
    before = tree(root)

    def argvs(lay):
        return [["score", aff, lay], ["permute", m, lay, "--out", root / "p"],
                command_line("distill", world, root / "out") + ["--layout", lay],
                ["eval", m, "--layout", lay, "--devices", "2", "--text", world["text"], "--blocks", "1",
                 "--seq-len", "8"],
                ["generate", m, "--layout", lay, "--devices", "2", "--prompt", "hi", "--max-new-tokens", "1"]]

    results = iter(run_cli(*[a for lay in cases.values() for a in argvs(lay)]))
    for kind, lay in cases.items():
        for _ in argvs(lay):
            refused(next(results), lay, kind)
    assert tree(root) == before


def test_metrics_that_are_not_a_regular_file_are_refused(world):
    """A run's metrics.jsonl as a FIFO or a link to /dev/zero: distill resuming it, and convert
    summing up a finished directory, refuse it by name."""
    root = world["root"]
    run, conv = root / "run", root / "cv"
    distill, convert = command_line("distill", world, run), command_line("convert", world, conv)
    assert [rc for rc, _ in run_cli(distill, convert)] == [0, 0]
    (run / "DONE").unlink()  # as if killed before it finished: the rerun resumes, reading its metrics
    for kind in ("fifo", "dev-zero"):
        for metrics in (run / "metrics.jsonl", conv / "run" / "metrics.jsonl"):
            metrics.unlink()
            make(kind, metrics, 0)
        dist, (rc, err) = run_cli(distill, convert)
        link = "is a symbolic link" if kind == "dev-zero" else None  # a name written to: never through a link
        refused(dist, run / "metrics.jsonl", kind, link)
        said = [line for line in err.strip().splitlines() if not line.startswith("[convert]")]  # its progress
        refused((rc, "\n".join(said)), conv / "run" / "metrics.jsonl", kind)  # read, not written: what it is


# -- one reader: no other way in -------------------------------------------------------------------------
_LOADERS = {"json": {"load"}, "pickle": {"load"}, "np": {"load", "fromfile"}, "numpy": {"load", "fromfile"},
            "yaml": {"load", "safe_load", "full_load", "unsafe_load"}, "tomllib": {"load"}, "torch": {"load"},
            "shutil": {"copy", "copy2", "copyfile"}, "io": {"open"}, "codecs": {"open"}}
_WRITES = {"O_CREAT", "O_WRONLY", "O_RDWR"}
# (module, what): why it may read another way
ALLOWED = {
    ("dtpshard/core/reading.py", "open"): "the reader itself",
    ("dtpshard/core/reading.py", "os.open"): "the reader itself",
    ("dtpshard/core/reading.py", "safe_open"): "safetensors' reader, on a file open_regular checked",
    ("dtpshard/core/reading.py", "yaml.load"): "parses text the reader read, within bounds",
    ("dtpshard/training/trust.py", "torch.load"): "a file object open_regular opened, or bytes in memory",
    ("dtpshard/serve/env.py", ".read_text"): "its own marker in the environment it made, and importlib.metadata",
    ("dtpshard/serve/env.py", ".read_bytes"): "the scripts of the venv it built, in its temporary, to name where it is "
                                              "published",
    ("dtpshard/data/local.py", "load_from_disk"): "datasets' own reader of a save_to_disk directory's arrow files",
    ("dtpshard/core/lock.py", "os.open"): "a lock's own descriptor, fstat'ed and flock'ed; its signature is read from "
                                          "it, O_NOFOLLOW | O_NONBLOCK: no link followed, no FIFO waited on",
    ("dtpshard/core/identity.py", "os.open"): "a descriptor for FS_IOC_GETVERSION, O_NOFOLLOW | O_NONBLOCK; nothing "
                                              "is read from it",
    ("dtpshard/core/children.py", ".read_bytes"): "a process's environment in /proc, the kernel's, to find the "
                                                  "run's token",
}


def _mode(call: ast.Call) -> str:
    if len(call.args) > 1 and isinstance(call.args[1], ast.Constant):
        return str(call.args[1].value)
    return next((str(k.value.value) for k in call.keywords if k.arg == "mode" and isinstance(k.value, ast.Constant)),
                "r")


def _read(call: ast.Call) -> str | None:
    """How `call` reads a file other than through core/reading.py, or None."""
    f, writes = call.func, bool(set(_mode(call)) & set("wax+"))
    if isinstance(f, ast.Name):
        return "open" if f.id == "open" and not writes else f.id if f.id in ("safe_open", "load_file") else None
    if not isinstance(f, ast.Attribute):
        return None
    base = f.value.id if isinstance(f.value, ast.Name) else ""
    if f.attr in ("read_text", "read_bytes"):
        return f".{f.attr}"
    if f.attr == "open" and base == "os":
        flags = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "") for n in ast.walk(call.args[1])}
        return None if flags & _WRITES else "os.open"
    if f.attr == "open" and (not writes or base in ("io", "codecs")):
        return f"{base}.open"
    if f.attr in _LOADERS.get(base, ()):
        return f"{base}.{f.attr}"
    if f.attr in ("safe_open", "load_file", "load_from_disk", "read_table", "read_csv") or \
            (f.attr == "read_parquet" and base in ("pd", "pandas")):
        return f.attr
    if base == "shutil" and f.attr == "copytree" and not any(k.arg == "copy_function" for k in call.keywords):
        return "shutil.copytree"
    return None


def test_every_file_is_read_by_the_one_reader():
    found = []
    for path in sorted((ROOT / "dtpshard").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            how = _read(node) if isinstance(node, ast.Call) else None
            if how is not None and (rel, how) not in ALLOWED:
                found.append(f"{rel}:{node.lineno}: {how}")
    assert found == [], "read through core/reading.py (open_regular, read_bytes, read_text, read_json, " \
                        f"open_safetensors) instead: {found}"
