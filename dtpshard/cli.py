"""The `dtpshard` command: a cyclopts App whose commands, the library's `*_cmd` functions, are
imported only when chosen. cyclopts reads their signatures and docstrings (a dataclass parameter
annotated `Parameter(name="*")` gives its fields as flags). Added here: every value checked by
dtpshard.core.typed against its full type while parsing; `--config FILE` (read by core.io, the
flags given override it); --help in words; every refusal one line, `dtpshard CMD: error: ...`, exit 2.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import signal
import sys
import typing
from collections import namedtuple
from pathlib import Path
from typing import Annotated, Any

from cyclopts import App, CycloptsError, Group, Parameter
from cyclopts.config import Dict
from cyclopts.help import DefaultFormatter

from dtpshard.commands.text import HINTS, columns, flag, not_utf8, one_line, positional, words_of
from dtpshard.core.errors import UserError, explain, quote
from dtpshard.core.io import read_options
from dtpshard.core.launch_checks import check_launch
from dtpshard.core.signals import exit_on_sigterm, signals_deferred
from dtpshard.core.typed import Invalid, check, choices, is_bool, is_list, optional_of

# name -> (module:function, its summary in the root --help, which imports no command)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("dtpshard.commands.generate:generate_cmd", "print a continuation of a prompt from the DTP model"),
    "layout": ("dtpshard.commands.layouts:layout_cmd", "make a layout (contiguous, random, optimised, ...)"),
    "permute": ("dtpshard.commands.layouts:permute_cmd", "write a permuted Hugging Face checkpoint"),
    "score": ("dtpshard.commands.layouts:score_cmd", "co-located score J of a layout"),
    "affinity": ("dtpshard.commands.affinity:affinity_cmd", "one calibration pass: unit-to-unit affinity scores"),
    "eval": ("dtpshard.commands.training:eval_cmd", "perplexity and KL to a teacher, or benchmark accuracy (--tasks)"),
    "distill": ("dtpshard.commands.training:distill_cmd", "distil the DTP student from the dense teacher (resumable)"),
    "convert": ("dtpshard.commands.convert:convert_cmd", "a dense checkpoint to a served DTP student (resumable)"),
    "teacher-cache": ("dtpshard.commands.training:teacher_cache_cmd", "the teacher's top-k, for distill"),
    "experiment": ("dtpshard.commands.studies:experiment_cmd", "run a whole study from a config file (resumable)"),
    "report": ("dtpshard.commands.studies:report_cmd", "Markdown report with figures for an experiment directory"),
    "publish": ("dtpshard.commands.studies:publish_cmd", "an experiment's records and report, with no local path"),
    "demo": ("dtpshard.commands.studies:demo_cmd", "the whole pipeline on SmolLM2-135M, offline, on a CPU"),
    "study": ("dtpshard.commands.studies:study_cmd", "the SmolLM2 study: does J predict the KL after training?"),
    "run": ("dtpshard.commands.generate:run_cmd", "DTP across processes (use under torchrun)"),
}
SPAWNS = {"run", "distill", "convert"}  # the commands whose --nproc K starts K local processes
CONFIG_HELP = ("YAML or JSON file of this command's options (keys as the flags' names, tables for the "
               "dotted ones); the flags given override it")


Refused = UserError  # a command line that does not parse: the one line to print
# a flag or positional argument: the key it sets (`seq_len`, `training.lr`) and its full type
Option = namedtuple("Option", "key hint default positional")


def _convert(hint: Any, tokens: Any) -> Any:
    """A command-line word (or --config value) as its base type; _constrained checks the rest."""
    said = [t.value for t in tokens]
    return check(hint, said if is_list(hint) else said[-1], text=True)


def _constrained(arguments: Any) -> None:
    """A group validator: every value given checked against its parameter's full type."""
    for a in arguments:
        if a.tokens and not a.children and a.field_info.kind is not a.field_info.VAR_POSITIONAL:
            try:
                check(a.field_info.annotation, a.value)
            except Invalid as e:
                raise ValueError(f"{flag(a)} {words_of(a)}: must be {e.wants}") from None


APP = App(name="dtpshard", help="Delayed tensor parallelism: affinity, layouts, distillation, serving.",
          version=lambda: f"dtpshard {version()}", version_flags=["--version", "-V"], help_format="plaintext",
          help_formatter=DefaultFormatter(column_specs=columns),  # every flag's words: _convert, _constrained
          default_parameter=Parameter(converter=_convert, show_choices=False, negative_iterable=(),
                                      consume_multiple=True, allow_repeating=True),
          group_arguments=Group("Arguments", validator=_constrained),
          group_parameters=Group("Parameters", validator=_constrained), result_action="return_value")
for _name, (_target, _summary) in COMMANDS.items():
    APP.command(_target, name=_name, help=_summary)


@APP.meta.default
def _meta(*tokens: Annotated[str, Parameter(show=False, allow_leading_hyphen=True, converter=lambda _, t: t[0].value)],
          config: Annotated[list[Path] | None, Parameter(metavar="FILE", help=CONFIG_HELP, negative=())] = None
          ) -> Any:
    """A command line, with its --config files as the lowest-priority source of its options."""
    # the first source that sets a key wins: a later file overrides an earlier one
    APP.config = [Dict(_text_typed(read_options(p), p), source=str(p), use_commands_as_keys=False)
                  for p in reversed(config or [])]
    return APP.parse_args(_switches(tokens), exit_on_error=False, print_error=False)


def _text_typed(data: dict[str, Any], path: Path, key: str = "") -> dict[str, Any]:
    """An options file's value for a text or path flag is text: YAML's `prompt: true` or `out: 5`
    would reach the command as the words "True" and "5" (quote them if meant)."""
    for k, v in data.items():
        name = f"{key}.{k}" if key else k
        if isinstance(v, dict):
            _text_typed(v, path, name)
            continue
        hint = optional_of(HINTS.get("--" + name.replace("_", "-")))
        base = typing.get_args(hint)[0] if typing.get_origin(hint) is list else hint
        values = v if isinstance(v, list) else [v]
        if base in (str, Path) and any(not isinstance(x, str) for x in values):
            bad = next(x for x in values if not isinstance(x, str))
            raise UserError(f"--config {path}: {name}: {quote(bad)} is not text (write it in quotes if it is meant "
                            "as text)")
    return data


def _switches(tokens: tuple[str, ...]) -> list[str]:
    """A choice with on and off (distill --compile auto|on|off) is also a switch: a bare
    `--compile` is on and `--no-compile` off (the word after a bare one is its value only when it
    is one of the choices); a nested boolean is off as `--no-training.progress` too."""
    switch = {flag: choices(hint) for flag, hint in HINTS.items() if {"on", "off"} <= set(choices(hint))}
    out: list[str] = []
    for i, word in enumerate(tokens):
        positive = f"--{word[5:]}" if word.startswith("--no-") else None
        if word == "--":
            return out + list(tokens[i:])
        if word in switch and (tokens[i + 1] if i + 1 < len(tokens) else None) not in switch[word]:
            word = f"{word}=on"
        elif positive in switch or positive and "." in positive and is_bool(HINTS.get(positive)):
            word = f"{positive}={'off' if positive in switch else 'false'}"
        out.append(word)
    return out


def load_command(name: str) -> Any:
    """Import the chosen command: its docstring becomes its help, its flags' types are known."""
    command = APP[name]
    # the docstring, not the root --help's summary; each paragraph one line, wrapped to the terminal
    head, args, tail = (inspect.getdoc(command.default_command) or "").partition("\nArgs:")
    paragraphs = [" ".join(p.split()) for p in head.split("\n\n")]
    command.help = "\n\n".join(paragraphs) + (f"\n\nArgs:{tail}" if args else "")
    HINTS.clear()
    HINTS.update({o.key.upper() if o.positional else "--" + o.key.replace("_", "-"): o.hint
                  for o in options(command.default_command)})
    return command.default_command


def options(fn: Any) -> list[Option]:
    """Every option of a command function as cyclopts assembles them (a dataclass's fields)."""
    app = App(default_parameter=Parameter(converter=_convert))
    app.default(fn)
    return [Option(a.field_info.name if positional(a) else a.name[2:].replace("-", "_"), a.field_info.annotation,
                   a.field_info.default, positional(a))
            for a in app.assemble_argument_collection() if not a.children and a.parse and a.show]


def _parse(argv: list[str]) -> Any:
    """(command, bound arguments, _) for a command line, or None for --help and --version."""
    if argv and argv[0] in COMMANDS:
        with signals_deferred():  # a command's module may import torch (core/signals.py)
            load_command(argv[0])
    try:
        parsed = APP.meta(argv, exit_on_error=False, print_error=False, result_action="return_value")
    except CycloptsError as e:
        raise Refused(one_line(e)) from None
    return parsed if isinstance(parsed, tuple) else None


def parse(name: str, fn: Any, argv: list[str]) -> dict[str, Any]:
    """The arguments of command `name` (`fn`) for a command line, defaults included."""
    _, bound, _ = _parse([name, *argv])
    bound.apply_defaults()
    return dict(bound.arguments)


def version() -> str:
    import importlib.metadata as metadata

    try:
        return metadata.version("dtpshard")
    except metadata.PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv[0] if argv else ""
    bad = not_utf8(argv)
    if bad is not None:  # before anything reads a word: a lone surrogate fails wherever text is encoded
        print(f"dtpshard{' ' + name if name in COMMANDS else ''}: error: {bad}", file=sys.stderr)
        return 2
    if argv and not name.startswith("-") and name not in COMMANDS:
        print(f"dtpshard: error: unknown command {name!r} (one of: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    # a signal at any moment, importing the command too, is one line: SIGTERM raises SystemExit(143)
    # (as inside a write); not in a torchrun rank, whose launcher reports it
    rank = "RANK" in os.environ
    with contextlib.nullcontext() if rank else exit_on_sigterm():
        try:
            code = _run(argv, name)
            launch = sys.modules.get("dtpshard.core.launch")  # a process that never imported it has no group
            if rank and launch is not None:
                launch.leave(code)  # a rank that ended its process group ends here, past torch's teardown
            return code
        except KeyboardInterrupt:
            print(f"dtpshard {name}: interrupted", file=sys.stderr)
            return 130
        except SystemExit as e:  # exits all the same (143), once it has said so
            if not rank and e.code == 128 + signal.SIGTERM:
                print(f"dtpshard {name}: terminated", file=sys.stderr)
            raise


def _run(argv: list[str], name: str) -> int:
    try:
        parsed = _parse(argv)
    except Refused as e:
        print(f"dtpshard {name}: error: {e}", file=sys.stderr)
        return 2
    if parsed is None:  # --help, --version
        return 0
    with signals_deferred():  # every command uses torch: imported where a signal waits (core/signals.py)
        import torch  # noqa: F401
    try:
        command, bound, _ = parsed
        check_launch(bound.arguments, spawns=name in SPAWNS)  # the environment, --timeout, --nproc: before any work
        result = command(*bound.args, **bound.kwargs)
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
        return 0
    except Exception as e:
        line = explain(e)
        if line is None:
            raise
        print(f"dtpshard {name}: error: {line}", file=sys.stderr)
        return 2
    if not argv:  # no command: cyclopts printed the root --help
        return 2
    return int(result) if isinstance(result, int) and not isinstance(result, bool) else 0
