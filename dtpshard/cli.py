"""The `dtpshard` command. Each subcommand is a typed function; cyclopts parses its flags.

A command's flags come from its signature and the `Args:` lines of its docstring: parameters
without a default before `*` are positional, keyword-only ones without a default are required
flags, the rest are optional flags (`--seq-len` for seq_len; `--x`/`--no-x` for booleans; a list
takes the words up to the next flag). A parameter typed as a dataclass (distill's `DistillConfig`)
contributes its fields as flags, so the recipe is written once; a field that several of a command's
dataclasses have (convert's --seq-len) is one flag, which sets it in each. A command with an
`override_flags = (dataclass, keys left out)` attribute (`experiment`) also gets that dataclass's
fields as flags, nested (`--training.lr`), and receives the ones given as `overrides`.

Every value is checked by dtpshard.core.typed against the parameter's type (the constrained types
of dtpshard.core.vocab: counts >= 1, finite numbers, the choices) while parsing, before any work,
and so is every value of a `--config FILE` (YAML or JSON of the flags; the flags given override
it). cyclopts splits the words and prints --help; this module turns the signatures into its
parameters and its errors into one line, `dtpshard CMD: error: ...`, exit code 2. Only the chosen
command's module is imported.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import docstring_parser

from dtpshard.core.errors import UserError, explain
from dtpshard.core.io import STUDY_BYTES, check_tree
from dtpshard.core.typed import Invalid, check, choices, is_bool, is_list, wants, words

# name -> (module:function, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("dtpshard.model.generate:generate_cmd", "print a continuation of a prompt from the DTP model"),
    "layout": ("dtpshard.layouts.make:layout_cmd", "make a layout (contiguous, random, optimised, ...)"),
    "permute": ("dtpshard.layouts.permute:permute_cmd", "write a permuted Hugging Face checkpoint"),
    "score": ("dtpshard.layouts.score:score_cmd", "co-located score J of a layout"),
    "affinity": ("dtpshard.affinity.calibrate:affinity_cmd", "one calibration pass: unit-to-unit affinity scores"),
    "eval": ("dtpshard.training.evaluate:eval_cmd", "perplexity and KL to a teacher on held-out blocks"),
    "distill": ("dtpshard.training.distill:distill_cmd", "distil the DTP student from the dense teacher (resumable)"),
    "convert": ("dtpshard.training.convert:convert_cmd",
                "a dense checkpoint to a DTP student ready to serve: affinity, layout, distill (resumable)"),
    "teacher-cache": ("dtpshard.training.teacher_cache:teacher_cache_cmd",
                      "top-k teacher log-probabilities of the training blocks, once, for distill --teacher-cache"),
    "experiment": ("dtpshard.studies.experiment:experiment_cmd", "run a whole study from a config file (resumable)"),
    "report": ("dtpshard.studies.report:report_cmd", "Markdown report with figures for an experiment directory"),
    "demo": ("dtpshard.studies.demo:demo_cmd", "the whole pipeline on SmolLM2-135M, offline, on a CPU"),
    "study": ("dtpshard.studies.demo:study_cmd",
              "the SmolLM2 study: does J predict the KL after training? (18 distillation runs, resumable)"),
    "run": ("dtpshard.runtime.run:run_cmd", "DTP across processes (use under torchrun)"),
}
REQUIRED = inspect.Parameter.empty  # an Option's default when it has none
OVERRIDES = "overrides"  # the parameter that receives the nested flags given (experiment)


class Refused(Exception):
    """A command line that does not parse: the one line to print."""


def help_type(hint: Any) -> str:
    """What --help says a flag takes, in words: `list[Path] | None` -> `list of path, or null`."""
    return words(hint)


@dataclass
class Option:
    """One flag or positional argument of a command, from its signature or a dataclass's fields.
    key: the parameter, field or nested key it sets (`seq_len`, `training.lr`); into: the
    dataclass parameter it is a field of (distill's `cfg`), `overrides`, or None for the
    function's own parameters."""

    key: str
    hint: Any
    default: Any = REQUIRED
    help: str = ""
    positional: bool = False
    into: str | None = None

    @property
    def flag(self) -> str:
        return self.key.upper() if self.positional else "--" + self.key.replace("_", "-")

    @property
    def name(self) -> str:  # as a Python identifier, for the parser's signature
        return self.key.replace(".", "__")


def _arg_docs(obj: Any) -> dict[str, str]:
    """name -> its `Args:` line, from the docstring of a function or of a class and its bases."""
    docs: dict[str, str] = {}
    for o in reversed(getattr(obj, "__mro__", (obj,))):
        for p in docstring_parser.parse(inspect.getdoc(o) or "").params:
            docs[p.arg_name] = " ".join((p.description or "").split())
    return docs


def _fields(cls: type, into: str, prefix: str = "", nested: bool = False) -> list[Option]:
    """A dataclass's fields as options; with nested, a field that is a dataclass gives its fields
    under `field.` (`training.lr`)."""
    hints, docs, out = typing.get_type_hints(cls, include_extras=True), _arg_docs(cls), []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if nested and dataclasses.is_dataclass(hint):
            out += _fields(hint, into, f"{prefix}{f.name}.", nested)
            continue
        default = (f.default if f.default is not dataclasses.MISSING else
                   f.default_factory() if f.default_factory is not dataclasses.MISSING else REQUIRED)
        out.append(Option(prefix + f.name, hint, default, docs.get(f.name, ""), into=into))
    return out


def _dataclass_params(fn: Callable) -> dict[str, type]:
    hints = typing.get_type_hints(fn, include_extras=True)
    return {n: hints[n] for n in inspect.signature(fn).parameters if dataclasses.is_dataclass(hints.get(n))}


def options(fn: Callable) -> list[Option]:
    """Every option of a command function: the positional ones, the required flags, the rest, each
    in signature order."""
    hints, docs = typing.get_type_hints(fn, include_extras=True), _arg_docs(fn)
    params = inspect.signature(fn).parameters
    nested = getattr(fn, "override_flags", None)
    out: list[Option] = []
    for name, p in params.items():
        if nested and name == OVERRIDES:
            continue
        if dataclasses.is_dataclass(hints[name]):  # its fields, but those the function or an earlier dataclass names
            seen = {o.key for o in out}
            out += [o for o in _fields(hints[name], into=name) if o.key not in params and o.key not in seen]
            continue
        positional = p.kind is not p.KEYWORD_ONLY and p.default is p.empty
        out.append(Option(name, hints[name], p.default, docs.get(name, ""), positional))
    if nested:
        cls, skip = nested
        out += [o for o in _fields(cls, into=OVERRIDES, nested=True) if o.key not in skip]
    return sorted(out, key=lambda o: (not o.positional, o.default is not REQUIRED))


def _shown(value: Any) -> str:
    """A value as a command line would write it (a --config file's, a default)."""
    if isinstance(value, (str, Path)):
        return str(value)
    return "null" if value is None else str(value) if isinstance(value, (bool, int, float)) else json.dumps(value)


def _help_line(o: Option, required: bool) -> str:
    """The option's Args: line and what it takes in words (cyclopts marks it [required])."""
    default = ("" if required or o.default is REQUIRED else ", default: the study file's" if o.into == OVERRIDES
               else f", default: {_shown(o.default)}")
    return f"{o.help} (type: {help_type(o.hint)}{default})".lstrip()


# -- --config FILE ----------------------------------------------------------------------------
def _read_config(path: Path) -> dict[str, Any]:
    """A --config file: readable UTF-8 YAML or JSON holding a mapping, else one line naming it."""
    import yaml

    try:
        if path.is_file() and path.stat().st_size > STUDY_BYTES:
            raise Refused(f"--config {path}: {path.stat().st_size} bytes, more than a config can need "
                          f"({STUDY_BYTES} at most)")
        data = check_tree(yaml.safe_load(path.read_text(encoding="utf-8")), f"--config {path}")
    except UserError as e:
        raise Refused(str(e)) from None
    except RecursionError:
        raise Refused(f"--config {path}: nested too deeply") from None
    except FileNotFoundError:
        raise Refused(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else (e.strerror or str(e)).lower()
        raise Refused(f"--config {path}: cannot read it ({why})") from None
    except yaml.YAMLError as e:
        raise Refused(f"--config {path}: not YAML or JSON ({str(e).splitlines()[0]})") from None
    if data is not None and not isinstance(data, dict):  # an empty file sets nothing
        raise Refused(f"--config {path}: must hold a mapping of option names to values, not {type(data).__name__}")
    return data or {}


def _config_values(argv: list[str], opts: list[Option]) -> tuple[list[str], dict[str, Any]]:
    """(argv without its --config FILE words, key -> value of those files, checked as the flags
    are). A key is an option's name (`seq_len` or `seq-len`), nested in tables for `training.lr`;
    a later file overrides an earlier one."""
    by_key, rest, values = {o.key: o for o in opts}, [], {}

    def take(table: dict[str, Any], prefix: str, path: Path) -> None:
        for name, value in table.items():
            key = prefix + str(name).replace("-", "_")
            if key in by_key:
                try:
                    values[key] = check(by_key[key].hint, value)
                except Invalid as e:
                    raise Refused(f"{by_key[key].flag} {_shown(value)}: must be {e.wants}") from None
            elif isinstance(value, dict) and any(k.startswith(key + ".") for k in by_key):
                take(value, key + ".", path)
            else:
                raise Refused(f"--config {path}: unknown key {key!r} (see --help)")

    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if argv[i] == "--":
            rest += argv[i:]
            break
        if flag != "--config":
            rest.append(argv[i])
        elif eq or i + 1 < len(argv):
            i += 0 if eq else 1
            path = Path(value if eq else argv[i])
            take(_read_config(path), "", path)
        else:
            raise Refused("--config: needs a file")
        i += 1
    return rest, values


def _switches(argv: list[str], opts: list[Option]) -> list[str]:
    """A choice with on and off (distill --compile auto|on|off) is also a switch, as a boolean
    flag: a bare `--compile` is on and `--no-compile` off. The word after a bare one is its value
    only when it is one of the choices."""
    switch = {o.flag: choices(o.hint) for o in opts if {"on", "off"} <= set(choices(o.hint))}
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg in switch and not (i + 1 < len(argv) and argv[i + 1] in switch[arg]):
            out.append(f"{arg}=on")
        elif arg.startswith("--no-") and f"--{arg[5:]}" in switch:
            out.append(f"--{arg[5:]}=off")
        else:
            out.append(arg)
    return out


# -- parsing ------------------------------------------------------------------------------------
def _parameters(opts: list[Option], given: typing.Collection[str]) -> list[inspect.Parameter]:
    """The options as the parameters of a signature for cyclopts, each annotated with its flag,
    help and our converter. An option a --config file gave is not required on the command line."""
    from cyclopts import Parameter

    P, params, optional = inspect.Parameter, [], False
    for o in opts:
        required = o.default is REQUIRED and o.key not in given and not (o.positional and optional)
        optional |= o.positional and not required  # a signature's later positionals need defaults too
        flag = ({"negative": f"--no-{o.flag[2:]}"} if is_bool(o.hint) else
                {"negative": (), "metavar": o.key.split(".")[-1].upper()})
        spec = Parameter(name=o.flag, help=_help_line(o, required), converter=_converter(o), show_default=False,
                         show_choices=False, consume_multiple=is_list(o.hint), allow_repeating=True, **flag)
        params.append(P(o.name, P.POSITIONAL_ONLY if o.positional else P.KEYWORD_ONLY,
                        default=P.empty if required else None, annotation=Annotated[o.hint, spec]))
    config = Parameter(name="--config", help="YAML or JSON file of this command's options (keys as the flags' "
                       "names, tables for the dotted ones); the flags given override it (type: path)",
                       show_default=False, negative=(), metavar="FILE")
    return params + [P("config", P.KEYWORD_ONLY, default=None, annotation=Annotated[Path | None, config])]


def _converter(o: Option) -> Callable[[Any, Any], Any]:
    def convert(_hint: Any, tokens: Any) -> Any:  # Invalid is a ValueError: cyclopts' CoercionError
        said = [t.value for t in tokens]
        return check(o.hint, said if is_list(o.hint) else said[-1], text=True)

    return convert


def _one_line(e: Exception, by_name: dict[str, Option]) -> str:
    """The error boundary: cyclopts' error as the one line of a refusal, from its parts."""
    from cyclopts.exceptions import (
        CoercionError,
        MissingArgumentError,
        UnknownOptionError,
        UnusedCliTokensError,
    )

    argument = getattr(e, "argument", None)
    o = by_name.get(argument.field_info.name) if argument is not None else None
    if isinstance(e, MissingArgumentError) and o is not None:
        return f"{e.keyword or o.flag}: needs a value" if e.keyword or argument.tokens else f"missing {o.flag}"
    if isinstance(e, UnknownOptionError):
        return f"unknown argument {(e.token.keyword or e.token.value).partition('=')[0]} (see --help)"
    if isinstance(e, UnusedCliTokensError) and e.unused_tokens:
        return f"unknown argument {e.unused_tokens[0]} (see --help)"
    if isinstance(e, CoercionError) and o is not None:
        wanted = e.__cause__.wants if isinstance(e.__cause__, Invalid) else wants(o.hint)
        said = e.token.value if e.token is not None else " ".join(t.value for t in argument.tokens)
        return f"{o.flag} {said}: must be {wanted}"
    return " ".join(str(e).split())  # anything else cyclopts refuses, in its words


def _parse_words(name: str, fn: Callable, opts: list[Option], argv: list[str],
                 given: typing.Collection[str]) -> dict[str, Any]:
    """key -> value of every option the command line gives; --help prints the help and exits."""
    from cyclopts import App, CycloptsError

    def command(*args: Any, **kwargs: Any) -> None:
        """Never called: only its signature is parsed."""

    command.__signature__ = inspect.Signature(_parameters(opts, given))  # type: ignore[attr-defined]
    command.__doc__ = None
    app = App(name=f"dtpshard {name}", help=(inspect.getdoc(fn) or "").split("Args:")[0].strip(),
              help_format="plaintext", help_formatter="default", version_flags=[], result_action="return_value")
    app.default(command)
    app["--help"].show = False
    by_name = {o.name: o for o in opts}
    try:
        called, bound, _ = app.parse_args(argv, exit_on_error=False, print_error=False)
    except CycloptsError as e:
        raise Refused(_one_line(e, by_name)) from None
    if called is not command:  # --help
        called(*bound.args, **bound.kwargs)
        raise SystemExit(0)
    return {by_name[k].key: v for k, v in bound.arguments.items() if k in by_name}


def parse(name: str, fn: Callable, argv: list[str]) -> dict[str, Any]:
    """The keyword arguments of `fn` for a command line; raises Refused with one line."""
    opts = options(fn)
    argv, from_config = _config_values(list(argv), opts)
    values = {**from_config, **_parse_words(name, fn, opts, _switches(argv, opts), from_config)}
    missing = [o.flag for o in opts if o.default is REQUIRED and o.key not in values]
    if missing:
        raise Refused("missing " + ", ".join(missing))
    kwargs = {o.key: values[o.key] for o in opts if o.into is None and o.key in values}
    for pname, cls in _dataclass_params(fn).items():
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs[pname] = cls(**{k: v for k, v in kwargs.items() if k in fields},
                            **{o.key: values[o.key] for o in opts if o.into not in (None, OVERRIDES)
                               and o.key in fields and o.key in values})
    if getattr(fn, "override_flags", None):  # only the nested options given (flags or --config), nested
        kwargs[OVERRIDES] = {}
        for o in opts:
            if o.into == OVERRIDES and o.key in values:
                *tables, last = o.key.split(".")
                table = kwargs[OVERRIDES]
                for t in tables:
                    table = table.setdefault(t, {})
                table[last] = values[o.key]
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
        kwargs = parse(name, fn, rest)
    except Refused as e:
        print(f"dtpshard {name}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
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
