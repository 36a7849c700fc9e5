"""The `dtpshard` command. Each subcommand is a typed function; its flags come from its signature.

Parameters without a default are positional (keyword-only ones are required flags), the others are `--flags` (underscores become
dashes). Types: str, int, float, Path, bool (`--x/--no-x`), Literal[...] (choices), list[...]
(one or more values), and `X | None`. The help text of a flag is its line under `Args:` in the
function's docstring. Only the chosen subcommand's module is imported, so `--help` is fast.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal

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
    "experiment": ("dtpshard.studies.experiment:experiment_cmd", "run a whole study from a config file (resumable)"),
    "report": ("dtpshard.studies.report:report_cmd", "Markdown report with figures for an experiment directory"),
    "demo": ("dtpshard.studies.demo:demo_cmd", "the whole pipeline on SmolLM2-135M, offline, on a CPU"),
    "run": ("dtpshard.runtime.ranks:run_cmd", "DTP across processes (use under torchrun)"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _doc_args(fn: Callable) -> dict[str, str]:
    doc = inspect.getdoc(fn) or ""
    out: dict[str, str] = {}
    if "Args:" in doc:
        for line in doc.split("Args:", 1)[1].splitlines():
            m = re.match(r"\s*(\w+)\s*:\s*(.+)", line)
            if m:
                out[m.group(1)] = m.group(2).strip()
    return out


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _add_param(parser: argparse.ArgumentParser, name: str, param: inspect.Parameter, tp: Any, help_: str) -> None:
    tp = _unwrap_optional(tp)
    required = param.default is inspect.Parameter.empty
    positional = required and param.kind is not inspect.Parameter.KEYWORD_ONLY  # keyword-only: a required flag
    flag = "--" + name.replace("_", "-")
    kw: dict[str, Any] = {"help": help_}
    if not required:
        kw["default"] = param.default
        if param.default is not None and tp is not bool:
            kw["help"] = f"{help_} (default: {param.default})".strip()
    if tp is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        return
    origin = typing.get_origin(tp)
    if origin is Literal:
        kw["choices"] = list(typing.get_args(tp))
        kw["type"] = type(kw["choices"][0])
    elif origin in (list, tuple):
        kw["nargs"] = "+"
        kw["type"] = _unwrap_optional(typing.get_args(tp)[0])
    elif tp in (int, float, str, Path):
        kw["type"] = tp
    if positional:
        kw.pop("default", None)
        parser.add_argument(name, metavar=name.upper(), **kw)
    else:
        parser.add_argument(flag, dest=name, required=required, **kw)


def build_parser(name: str, fn: Callable) -> argparse.ArgumentParser:
    doc = (inspect.getdoc(fn) or "").split("Args:")[0].strip()
    parser = _Parser(prog=f"dtpshard {name}", description=doc)
    hints = typing.get_type_hints(fn)
    helps = _doc_args(fn)
    for pname, param in inspect.signature(fn).parameters.items():
        _add_param(parser, pname, param, hints.get(pname, str), helps.get(pname, ""))
    return parser


def load_command(name: str) -> Callable:
    target, _ = COMMANDS[name]
    mod, fn = target.split(":")
    return getattr(importlib.import_module(mod), fn)


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: dtpshard COMMAND [ARGS...]   (dtpshard COMMAND --help for its flags)", "", "commands:"]
    lines += [f"  {n.ljust(width)}  {s}" for n, (_, s) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dtpshard: error: unknown command {name!r} (one of: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    fn = load_command(name)
    args = build_parser(name, fn).parse_args(rest)
    try:
        result = fn(**vars(args))
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
