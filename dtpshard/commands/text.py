"""What the `dtpshard` command says in words: --help's table of flags, cyclopts' refusals as one
line, and the refusal of a command line that is not UTF-8. cli.py wires these into its App."""
from __future__ import annotations

from typing import Any

from cyclopts import CycloptsError

from dtpshard.core.errors import quote
from dtpshard.core.typed import wants, words

# the help of a flag several commands share, written once (a command's own docstring line wins)
SHARED_HELP = {"--device": "auto (cuda if available, else cpu), cpu, cuda or cuda:N",
               "--stage3": "own-partial scale of the last δ modules: sqrt (√L, the paper's) or one"}
HINTS: dict[str, Any] = {}  # flag -> full type, of the command chosen (cli.load_command)
help_type = words  # what --help says a flag takes: `list[Path] | None` -> `list of path, or null`


def positional(argument: Any) -> bool:
    kind = argument.field_info.kind
    return kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD) and argument.required


def flag(argument: Any) -> str:
    return argument.field_info.name.upper() if positional(argument) else argument.name


def words_of(argument: Any) -> str:
    return quote(" ".join(t.value for t in argument.tokens if t.implicit_value is not None) or "null", repr_=False)


def one_line(e: CycloptsError) -> str:
    """The error boundary: cyclopts' error as the one line of a refusal, from its parts."""
    from cyclopts import exceptions as x

    a, token = getattr(e, "argument", None), getattr(e, "token", None)
    if isinstance(e, x.ValidationError) and isinstance(e.__cause__, ValueError):  # _constrained's line
        return str(e.__cause__)
    if isinstance(e, x.MissingArgumentError) and a is not None:
        given = e.keyword or (a.tokens and a.tokens[-1].keyword)
        return f"{given}: needs a value" if given else f"missing {flag(a)}"
    if isinstance(e, x.UnknownOptionError) and token is not None:
        if token.source not in ("", "cli"):  # a key of a --config file: [training][lr]
            key = quote(token.keyword.strip("[]").replace("][", "."))
            return f"--config {token.source}: unknown key {key} (see --help)"
        return f"unknown argument {quote((token.keyword or token.value).partition('=')[0], False)} (see --help)"
    if isinstance(e, x.UnusedCliTokensError) and e.unused_tokens:
        return f"unknown argument {quote(e.unused_tokens[0], False)} (see --help)"
    if isinstance(e, x.CoercionError) and a is not None:
        said = quote(token.value, False) if token is not None else words_of(a)
        return f"{flag(a)} {said}: must be {wants(a.field_info.annotation)}"
    return " ".join(str(e).split())  # anything else cyclopts refuses, in its words


def columns(console: Any, options: Any, entries: Any) -> Any:
    """--help's table: a flag named by its key (`--seq-len SEQ_LEN`), its docstring line (or the
    shared one), what it takes in words, then its default and [required] on lines of their own."""
    from attrs import evolve
    from cyclopts.help.inline_text import InlineText
    from cyclopts.help.specs import DescriptionRenderer, get_default_parameter_columns
    from rich.text import Text

    def name(entry: Any) -> Any:
        flag = next(iter(entry.positive_names), "")
        key = flag.lstrip("-").rpartition(".")[2].replace("-", "_").upper()
        return names.renderer(evolve(entry, metavar=entry.metavar and (entry.metavar if flag == "--config" else key)))

    def describe(entry: Any) -> Any:
        flag = next(iter(entry.positive_names), "")
        said = (entry.description.primary_renderable.plain if entry.description else "") or SHARED_HELP.get(flag, "")
        text = InlineText(Text(" ".join(said.split())))  # a docstring line and its continuation, one paragraph
        if entry.type is not None:
            text.append(Text(f"(type: {help_type(HINTS.get(flag, HINTS.get(entry.positional_label, entry.type)))})"))
        return DescriptionRenderer(newline_metadata=True)(evolve(entry, description=InlineText(text)))

    *marks, names, text = get_default_parameter_columns(console, options, entries)
    return (*marks, names.copy(renderer=name), text.copy(renderer=describe))


def not_utf8(argv: list[str]) -> str | None:
    """The refusal of the first word that is not UTF-8 (Python decodes the command line with
    surrogateescape, so such bytes arrive as lone surrogates, which no reader of text accepts),
    naming the flag it is the value of; None when every word is UTF-8."""
    for i, word in enumerate(argv):
        try:
            word.encode("utf-8")
        except UnicodeEncodeError:
            flag, eq, value = word.partition("=")
            if eq and flag.startswith("--") and flag.isascii():
                what, word = flag, value
            elif i and argv[i - 1].startswith("-") and "=" not in argv[i - 1] and argv[i - 1].isascii():
                what = argv[i - 1]
            else:
                what = f"argument {i + 1}"
            raw = word.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            return f"{what}: {quote(raw, False)} is not UTF-8 text (write the command line in UTF-8)"
    return None
