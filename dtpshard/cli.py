"""The `dtpshard` command: a cyclopts App whose commands are the library's `*_cmd` functions.

cyclopts reads each command's signature and docstring: parameters without a default before `*`
are positional, keyword-only ones without a default required flags, a dataclass parameter
annotated `Parameter(name="*")` contributes its fields as flags (distill's DistillConfig,
affinity's CalibrationData and PassSettings), and experiment's partial study (a TypedDict)
its nested keys (`--training.lr`). A command is imported only when it is the one chosen.

What this module adds to cyclopts: every value is checked by dtpshard.core.typed against the
full type of its parameter or field (the constrained types of dtpshard.core.vocab: counts >= 1,
finite numbers, choices), while parsing and before any work; `--config FILE` (YAML or JSON of
the flags, read by core.io's bounded reader, the flags given override it); a choice with on and
off (distill --compile) also works as a switch; --help says in words what each flag takes; and
every refusal is one line, `dtpshard CMD: error: ...`, exit code 2.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, NamedTuple

from cyclopts import App, CycloptsError, Group, Parameter

from dtpshard.core.errors import UserError, explain
from dtpshard.core.typed import Invalid, check, choices, is_bool, is_list, wants, words

# name -> (module:function, one-line summary); the summary is the root --help's, so that it
# imports no command
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
              "the SmolLM2 study: does J predict the KL after training? (18 distillation runs, resumable)"),
    "run": ("dtpshard.runtime.run:run_cmd", "DTP across processes (use under torchrun)"),
}
# the help of a flag several commands share, written once (a command's own docstring line wins)
SHARED_HELP = {
    "--device": "auto (cuda if available, else cpu), cpu, cuda or cuda:N",
    "--stage3": "own-partial scale of the last δ modules: sqrt (√L, the paper's) or one",
    "--tokenizer": "tokenizer directory, where the model has no tokenizer files",
    "--text-field": "the column or JSON field that holds the text",
}
CONFIG_HELP = ("YAML or JSON file of this command's options (keys as the flags' names, tables for the "
               "dotted ones); the flags given override it")


class Refused(Exception):
    """A command line that does not parse: the one line to print."""


class Option(NamedTuple):
    """One flag or positional argument of a command, as cyclopts assembled it. key: the
    parameter or field it sets (`seq_len`, `training.lr`); hint: its full type."""

    key: str
    hint: Any
    default: Any
    positional: bool

    @property
    def flag(self) -> str:
        return self.key.upper() if self.positional else "--" + self.key.replace("_", "-")


def help_type(hint: Any) -> str:
    """What --help says a flag takes, in words: `list[Path] | None` -> `list of path, or null`."""
    return words(hint)


def _hint(argument: Any) -> Any:
    return argument.field_info.annotation  # Annotated kept: cyclopts' own `hint` drops the Constraint


def _words(argument: Any) -> str:
    return " ".join(t.value for t in argument.tokens if t.implicit_value is not None) or "null"


def _convert(hint: Any, tokens: Any) -> Any:
    """Every command-line word (or --config value) parsed as its base type says; the constraint
    is _constrained's, which sees the full type."""
    said = [t.value for t in tokens]
    return check(hint, said if is_list(hint) else said[-1], text=True)


def _constrained(arguments: Any) -> None:
    """A group validator: every value given checked against its parameter's full type."""
    for a in arguments:
        if a.tokens and not a.children and a.field_info.kind is not a.field_info.VAR_POSITIONAL:
            try:
                check(_hint(a), a.value)
            except Invalid as e:
                raise ValueError(f"{a.name} {_words(a)}: must be {e.wants}") from None


def _flag(argument: Any) -> str:
    kind = argument.field_info.kind
    positional = kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD) and argument.required
    return argument.field_info.name.upper() if positional else argument.name


def _one_line(e: CycloptsError) -> str:
    """The error boundary: cyclopts' error as the one line of a refusal, from its parts."""
    from cyclopts.exceptions import (
        CoercionError,
        MissingArgumentError,
        UnknownOptionError,
        UnusedCliTokensError,
        ValidationError,
    )

    a, token = getattr(e, "argument", None), getattr(e, "token", None)
    if isinstance(e, ValidationError) and isinstance(e.__cause__, ValueError):
        return str(e.__cause__)
    if isinstance(e, MissingArgumentError) and a is not None:
        given = e.keyword or (a.tokens and a.tokens[-1].keyword)
        return f"{given}: needs a value" if given else f"missing {_flag(a)}"
    if isinstance(e, UnknownOptionError) and token is not None:
        if token.source not in ("", "cli"):  # a key of a --config file: [training][lr]
            key = token.keyword.strip("[]").replace("][", ".")
            return f"--config {token.source}: unknown key {key!r} (see --help)"
        return f"unknown argument {(token.keyword or token.value).partition('=')[0]} (see --help)"
    if isinstance(e, UnusedCliTokensError) and e.unused_tokens:
        return f"unknown argument {e.unused_tokens[0]} (see --help)"
    if isinstance(e, CoercionError) and a is not None:
        wanted = wants(_hint(a))
        return f"{_flag(a)} {token.value if token is not None else _words(a)}: must be {wanted}"
    return " ".join(str(e).split())  # anything else cyclopts refuses, in its words


def _describe(entry: Any) -> Any:
    """A flag's help: its docstring line (or the shared one) and what it takes in words."""
    from attrs import evolve
    from cyclopts.help.specs import DescriptionRenderer

    flag = next(iter(entry.positive_names), "")
    text = entry.description or SHARED_HELP.get(flag, "")
    if entry.type is not None:
        kind = f"(type: {help_type(HINTS.get(flag, HINTS.get(entry.positional_label, entry.type)))})"
        text = f"{text} {kind}" if isinstance(text, str) else text
        if not isinstance(text, str):
            from rich.text import Text

            text.append(Text(kind))
    return DescriptionRenderer(newline_metadata=True)(evolve(entry, description=text or None))


def _columns(console: Any, options: Any, entries: Any) -> Any:
    from cyclopts.help.specs import ColumnSpec, get_default_parameter_columns

    *names, _ = get_default_parameter_columns(console, options, entries)
    return (*names, ColumnSpec(renderer=_describe, header="Description", justify="left", overflow="fold"))


def _app() -> App:
    from cyclopts.help import DefaultFormatter

    checked = Parameter(converter=_convert, show_choices=False, negative_iterable=(), consume_multiple=True,
                        allow_repeating=True)
    app = App(name="dtpshard", help="Delayed tensor parallelism: affinity, layouts, distillation, serving.",
              version=lambda: f"dtpshard {version()}", version_flags=["--version", "-V"], help_format="markdown",
              help_formatter=DefaultFormatter(column_specs=_columns), default_parameter=checked,
              group_arguments=Group("Arguments", validator=_constrained),
              group_parameters=Group("Parameters", validator=_constrained), result_action="return_value")
    for name, (target, summary) in COMMANDS.items():
        app.command(target, name=name, help=summary)
    app.meta.default(_meta)
    return app


def _raw(_hint: Any, tokens: Any) -> str:
    return tokens[0].value


def _meta(*tokens: Annotated[str, Parameter(show=False, allow_leading_hyphen=True, converter=_raw)],
          config: Annotated[list[Path] | None, Parameter(metavar="FILE", help=CONFIG_HELP, negative=())] = None
          ) -> Any:
    """A command line, with its --config files as the lowest-priority source of its options."""
    from cyclopts.config import Dict

    from dtpshard.core.io import read_options

    # the first source that sets a key wins: a later file overrides an earlier one
    APP.config = [Dict(read_options(p), source=str(p), use_commands_as_keys=False) for p in reversed(config or [])]
    return APP.parse_args(_switches(tokens), exit_on_error=False, print_error=False)


def _switches(tokens: tuple[str, ...]) -> list[str]:
    """A choice with on and off (distill --compile auto|on|off) is also a switch: a bare
    `--compile` is on and `--no-compile` off; the word after a bare one is its value only when it
    is one of the choices."""
    switch = {flag: choices(hint) for flag, hint in HINTS.items() if {"on", "off"} <= set(choices(hint))}
    out: list[str] = []
    for i, word in enumerate(tokens):
        if word == "--":
            return out + list(tokens[i:])
        after = tokens[i + 1] if i + 1 < len(tokens) else None
        if word in switch and after not in switch[word]:
            word = f"{word}=on"
        elif word.startswith("--no-") and f"--{word[5:]}" in switch:
            word = f"--{word[5:]}=off"
        elif word.startswith("--no-") and "." in word and is_bool(HINTS.get(f"--{word[5:]}")):
            word = f"--{word[5:]}=false"  # a nested switch: --no-training.progress
        out.append(word)
    return out


HINTS: dict[str, Any] = {}  # flag -> full type, of the command chosen (_choose)


def _choose(name: str) -> Any:
    """Import the chosen command: its docstring becomes its help, its flags' types are known."""
    command = APP[name]
    command.help = None  # the docstring, not the summary the root --help lists
    HINTS.update({o.flag: o.hint for o in options(command.default_command)})
    return command.default_command


def options(fn: Any) -> list[Option]:
    """Every option of a command function, as cyclopts assembles them (the leaves: a dataclass
    parameter's fields, not the dataclass)."""
    app = App(default_parameter=Parameter(converter=_convert))
    app.default(fn)
    out = []
    for a in app.assemble_argument_collection():
        if not a.children and a.parse and a.show:
            kind = a.field_info.kind
            positional = kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD) and a.required
            key = a.field_info.name if positional else a.name[2:].replace("-", "_")
            out.append(Option(key, _hint(a), a.field_info.default, positional))
    return out


def parse(name: str, fn: Any, argv: list[str]) -> dict[str, Any]:
    """The keyword arguments of `fn` for a command line; raises Refused with one line."""
    try:
        _, bound, _ = APP.meta(argv and [name, *argv] or [name], exit_on_error=False, print_error=False,
                               result_action="return_value")
    except CycloptsError as e:
        raise Refused(_one_line(e)) from None
    except UserError as e:
        raise Refused(str(e)) from None
    bound.apply_defaults()
    return dict(bound.arguments)


def load_command(name: str) -> Any:
    return _choose(name)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("dtpshard")
    except PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv[0] if argv else ""
    if argv and not name.startswith("-") and name not in COMMANDS:
        print(f"dtpshard: error: unknown command {name!r} (one of: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    try:
        if name in COMMANDS:
            _choose(name)
        parsed = APP.meta(argv, exit_on_error=False, print_error=False, result_action="return_value")
    except (CycloptsError, UserError) as e:
        print(f"dtpshard {name}: error: {_one_line(e) if isinstance(e, CycloptsError) else e}", file=sys.stderr)
        return 2
    if not isinstance(parsed, tuple):  # --help, --version, or no command (its help, exit 2)
        return 0 if argv else 2
    command, bound, _ = parsed
    try:
        result = command(*bound.args, **bound.kwargs)
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"dtpshard {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        line = explain(e)
        if line is None:
            raise
        print(f"dtpshard {name}: error: {line}", file=sys.stderr)
        return 2
    return int(result) if isinstance(result, int) and not isinstance(result, bool) else 0


APP = _app()

if __name__ == "__main__":
    sys.exit(main())
