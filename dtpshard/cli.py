"""The `dtpshard` command. Each subcommand is a typed function; jsonargparse makes its flags.

A command's flags come from its signature and the `Args:` lines of its docstring: parameters
without a default before `*` are positional, keyword-only ones without a default are required
flags, the rest are optional flags (underscores written as dashes; `--x`/`--no-x` for booleans).
A parameter typed as a dataclass (distill's `DistillConfig`) contributes its fields as flags, so
the recipe is written once. A command with a `nested_options(parser)` attribute (`experiment`)
gets those flags too, nested (`--training.lr`), and receives the ones given as `overrides`.
The constrained types of dtpshard.core.vocab check every number and choice while parsing, before
any work; a refusal is one line and exit code 2. Every command takes `--config FILE` (YAML or
JSON of its options; flags given after it override it). Only the chosen command's module is
imported.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import sys
import typing
from pathlib import Path
from typing import Any, Callable

from dtpshard.core.errors import explain

# name -> (module:function, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("dtpshard.model.generate:generate_cmd", "print a continuation of a prompt from the DTP model"),
    "layout": ("dtpshard.layouts.make:layout_cmd", "make a layout (contiguous, random, optimised, ...)"),
    "permute": ("dtpshard.layouts.permute:permute_cmd", "write a permuted Hugging Face checkpoint"),
    "score": ("dtpshard.layouts.score:score_cmd", "co-located score J of a layout"),
    "affinity": ("dtpshard.affinity.calibrate:affinity_cmd", "one calibration pass: unit-to-unit affinity scores"),
    "eval": ("dtpshard.training.evaluate:eval_cmd", "perplexity and KL to a teacher on held-out blocks"),
    "distill": ("dtpshard.training.distill:distill_cmd", "distil the DTP student from the dense teacher (resumable)"),
    "teacher-cache": ("dtpshard.training.teacher_cache:teacher_cache_cmd",
                      "top-k teacher log-probabilities of the training blocks, once, for distill --teacher-cache"),
    "experiment": ("dtpshard.studies.experiment:experiment_cmd", "run a whole study from a config file (resumable)"),
    "report": ("dtpshard.studies.report:report_cmd", "Markdown report with figures for an experiment directory"),
    "demo": ("dtpshard.studies.demo:demo_cmd", "the whole pipeline on SmolLM2-135M, offline, on a CPU"),
    "study": ("dtpshard.studies.demo:study_cmd",
              "the SmolLM2 study: does J predict the KL after training? (75.7 min on a 2-core CPU)"),
    "run": ("dtpshard.runtime.run:run_cmd", "DTP across processes (use under torchrun)"),
}
_BOOL_WORDS = {"true", "false", "yes", "no", "1", "0", "on", "off"}


class Refused(Exception):
    """A command line that does not parse: the one line to print."""


def _dashed(text: str) -> str:
    return re.sub(r"--[A-Za-z0-9_.]+", lambda m: m.group().replace("_", "-"), text)


# what --help says a flag takes, instead of the Python type's name
_HELP_TYPES = {"Count": "int >= 1", "NonNegativeInt": "int >= 0", "Seed": "int >= 0", "PositiveNumber": "number > 0",
               "NonNegativeNumber": "number >= 0", "ClosedUnitInterval": "number in [0, 1]",
               "Beta": "number in [0, 1)", "TopP": "number in (0, 1]", "Seconds": "seconds > 0, at most 1e6", "Device": "auto, cpu, cuda or cuda:N",
               "Path": "path", "str": "text", "float": "number", "bool": "true or false"}


def help_type(type_str: str) -> str:
    """jsonargparse's type string in words: `Optional[list[Path]]` -> `list of path, or null`,
    `Literal['auto', 'on']` -> `auto | on`. Choices (quoted) are kept as they are."""
    t = re.sub(r"<class '(?:[\w.]*\.)?(\w+)'>", r"\1", type_str)
    t = re.sub(r"'[^']*'|\"[^\"]*\"|\w+",
               lambda m: m.group() if m.group()[0] in "'\"" else _HELP_TYPES.get(m.group(), m.group()), t)
    t = re.sub(r"Literal\[([^\]]*)\]", lambda m: "(" + " | ".join(c.strip(" '\"") for c in m.group(1).split(",")) + ")", t)
    t = re.sub(r"^Optional\[(.*)\]$", r"\1 | null", t)
    t = re.sub(r"(?:list|List)\[(.*?)\]", r"list of \1", t)
    t = re.sub(r"^\(([^()]*)\)", r"\1", t)  # a choice that stands alone needs no brackets
    return t.replace("true or false | null", "true, false or null").replace(" | null", ", or null")


def _dataclass_params(fn: Callable) -> dict[str, type]:
    hints = typing.get_type_hints(fn)
    return {n: hints[n] for n in inspect.signature(fn).parameters if dataclasses.is_dataclass(hints.get(n))}


def build_parser(name: str, fn: Callable) -> Any:
    from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter

    class Formatter(DefaultHelpFormatter):
        def _get_type_str(self, action: Any) -> str | None:
            t = super()._get_type_str(action)
            return None if t is None else help_type(t)

    class Parser(ArgumentParser):
        argv: list[str] = []  # the command line being parsed, to quote a refused value as typed

        def format_help(self) -> str:  # flags as typed: dashes, not the parameter names' underscores
            return _dashed(super().format_help())

        def error(self, message: str, ex: Exception | None = None) -> typing.NoReturn:
            raise Refused(_one_line(message, [a.dest for a in self._actions if not a.option_strings], self.argv))

    doc = (inspect.getdoc(fn) or "").split("Args:")[0].strip()
    parser = Parser(prog=f"dtpshard {name}", description=doc, exit_on_error=False, formatter_class=Formatter)
    parser.add_argument("--config", action=ActionConfigFile,
                        help="YAML or JSON file of this command's options; flags given after it override it")
    nested = _dataclass_params(fn)
    hook = getattr(fn, "nested_options", None)
    skip = set(nested) | ({"overrides"} if hook else set())
    parser.add_function_arguments(fn, nested_key=None, as_positional=True, skip=skip, as_group=False)
    own = set(inspect.signature(fn).parameters)
    for cls in nested.values():
        parser.add_class_arguments(cls, nested_key=None, skip=own & {f.name for f in dataclasses.fields(cls)})
    if hook:
        hook(parser)
    return parser


def _one_line(message: str, positionals: typing.Collection[str] = (), argv: typing.Sequence[str] = ()) -> str:
    from dtpshard.core.vocab import parse_refusal

    missing = re.search(r"arguments are required: (.+)", message)
    if missing:
        names = [n.strip() for n in missing.group(1).split(",")]
        return "missing " + ", ".join(n.upper() if n in positionals else _flag_of(n) for n in names)
    unknown = re.search(r"unrecognized arguments: (.+)", message)
    if unknown:
        return f"unknown argument {_dashed(unknown.group(1).split()[0])} (see --help)"
    key, reason = parse_refusal(message)
    if key is None:
        return _dashed(reason)
    value = _typed_value(argv, key)
    if value is None:  # from a --config file: what jsonargparse says it got
        given = re.search(r"(?:Given|Got) value: (.+)|Not of type \w+: (\S+) does not|: '(.+)'$", message)
        value = next((g for g in given.groups() if g), None) if given else None
    return f"{_flag_of(key)}{'' if value is None else ' ' + value}: {reason}"


def _typed_value(argv: typing.Sequence[str], key: str) -> str | None:
    """The value the command line gave `key` last (argv as normalised: `--key=value` or `--key value`)."""
    for i in range(len(argv) - 1, -1, -1):
        flag, eq, value = argv[i].partition("=")
        if flag == f"--{key}":
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def _flag_of(key: str) -> str:
    return "--" + key.replace("_", "-")


def _normalise(argv: list[str], parser: Any) -> list[str]:
    """`--seq-len` -> `--seq_len` (the parameter's name), `--no-x` -> `--x=false`, a bare boolean
    `--x` -> `--x=true` (so the next word is never read as its value), likewise `on`/`off` for an
    on/off choice, `--text a b` -> a list."""
    import json

    hints = {a.dest: getattr(a, "_typehint", a.type) for a in parser._actions}
    bools = {d for d, t in hints.items() if t is bool or set(typing.get_args(t)) == {bool, type(None)}}  # bool | None too
    lists = {d for d, t in hints.items() if list in (typing.get_origin(t), *map(typing.get_origin, typing.get_args(t)))}
    # an on/off/... choice (distill --compile): bare `--x` is `on`, `--no-x` is `off`
    switches = {d: set(typing.get_args(t)) for d, t in hints.items()
                if typing.get_origin(t) is typing.Literal and {"on", "off"} <= set(typing.get_args(t))}
    out, i = [], 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if arg == "--" or not arg.startswith("--"):
            out.append(arg)
            continue
        flag, eq, value = arg.partition("=")
        flag = "--" + flag[2:].replace("-", "_")
        if flag[2:] in lists and not eq:  # `--text a.txt b.txt`: the words up to the next flag
            words = []
            while i < len(argv) and not argv[i].startswith("--"):
                words.append(argv[i])
                i += 1
            out.append(f"{flag}={json.dumps(words)}")
        elif flag.startswith("--no_") and flag[5:] in bools and not eq:
            out.append(f"--{flag[5:]}=false")
        elif flag[2:] in bools and not eq and not (i < len(argv) and argv[i].lower() in _BOOL_WORDS):
            out.append(f"{flag}=true")
        elif flag.startswith("--no_") and flag[5:] in switches and not eq:
            out.append(f"--{flag[5:]}=off")
        elif flag[2:] in switches and not eq and not (i < len(argv) and argv[i] in switches[flag[2:]]):
            out.append(f"{flag}=on")
        else:
            out.append(flag + eq + value)
    return out


def _plain(value: Any) -> Any:
    """Parsed values as plain Python (a constrained int as an int), so JSON/YAML dumps stay as before."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str) and not isinstance(value, Path):
        return str(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _plain_tree(value: Any) -> Any:
    return {k: _plain_tree(v) for k, v in value.items()} if isinstance(value, dict) else _plain(value)


def parse(name: str, fn: Callable, argv: list[str]) -> dict[str, Any]:
    """The keyword arguments of `fn` for a command line; raises Refused with one line."""
    parser = build_parser(name, fn)
    try:
        argv = parser.argv = _normalise(argv, parser)
        ns = parser.parse_args(argv)
    except Refused:
        raise
    except Exception as e:  # noqa: BLE001 -- jsonargparse's ArgumentError and friends: one line
        raise Refused(_one_line(str(e), [a.dest for a in parser._actions if not a.option_strings], argv)) from None
    values = {k: _plain(v) for k, v in ns.as_dict().items() if k not in ("config", "__path__")}
    values.pop("print_config", None)
    params = inspect.signature(fn).parameters
    kwargs = {k: values.pop(k) for k in list(values) if k in params}
    if getattr(fn, "nested_options", None):  # only the nested options given (flags or --config)
        given = parser.parse_args(argv, defaults=False).as_dict()
        kwargs["overrides"] = {k: _plain_tree(v) for k, v in given.items()
                               if k not in params and k not in ("config", "__path__", "print_config")}
    for pname, cls in _dataclass_params(fn).items():
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs[pname] = cls(**{k: v for k, v in {**values, **kwargs}.items() if k in fields})
    return kwargs


def load_command(name: str) -> Callable:
    target, _ = COMMANDS[name]
    mod, fn = target.split(":")
    return getattr(importlib.import_module(mod), fn)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("dtpshard")
    except PackageNotFoundError:
        return "unknown"


def _check_config_files(argv: list[str]) -> None:
    """Each --config FILE is readable UTF-8 YAML/JSON holding a mapping; else one line naming it
    (jsonargparse's own messages do not say which file)."""
    import yaml

    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag != "--config" or (not eq and i + 1 >= len(argv)):
            continue
        path = Path(value if eq else argv[i + 1])
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise Refused(f"--config {path}: no such file") from None
        except (OSError, UnicodeDecodeError) as e:
            why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else (e.strerror or str(e)).lower()
            raise Refused(f"--config {path}: cannot read it ({why})") from None
        except yaml.YAMLError as e:
            raise Refused(f"--config {path}: not YAML or JSON ({str(e).splitlines()[0]})") from None
        if data is not None and not isinstance(data, dict):  # an empty file sets nothing
            raise Refused(f"--config {path}: must hold a mapping of option names to values, not "
                          f"{type(data).__name__}")


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: dtpshard COMMAND [ARGS...]   (dtpshard COMMAND --help for its flags)",
             "       dtpshard --version", "", "commands:"]
    lines += [f"  {n.ljust(width)}  {s}" for n, (_, s) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"dtpshard {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dtpshard: error: unknown command {name!r} (one of: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    fn = load_command(name)
    try:
        _check_config_files(rest)
        kwargs = parse(name, fn, rest)
    except Refused as e:
        print(f"dtpshard {name}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help, --print-config
        return int(e.code or 0)
    try:
        result = fn(**kwargs)
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"dtpshard {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 -- `explain` decides what a user should see in one line
        line = explain(e)
        if line is None:
            raise
        print(f"dtpshard {name}: error: {line}", file=sys.stderr)
        return 2
    return int(result) if isinstance(result, int) and not isinstance(result, bool) else 0


if __name__ == "__main__":
    sys.exit(main())
