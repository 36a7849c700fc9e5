"""One check of a value against its type (dtpshard.core.typed): a command-line word, a --config
value and a study-file key are refused alike, in words, and core imports no CLI library."""
import ast
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import dtpshard
from dtpshard.core.typed import Invalid, check, from_table, wants, words
from dtpshard.core.vocab import Count, Delay, Device, LayoutKind, Seconds, Seed


@pytest.mark.parametrize("hint, word, value", [
    (Count, "3", 3), (Delay, "1.5", 1.5), (Device, "cuda:1", "cuda:1"), (bool, "off", False), (bool, "Yes", True),
    (Path, "a/b", Path("a/b")), (list[Seed], ["0", "2"], [0, 2]), (Count | None, "null", None),
    (LayoutKind, "anti", "anti"),
])
def test_command_line_words_are_parsed_as_their_type(hint, word, value):
    assert check(hint, word, text=True) == value


@pytest.mark.parametrize("hint, word, must", [
    (Count, "0", "an integer >= 1"), (Count, "2.5", "an integer >= 1"), (Delay, "nan", "a finite number >= 0"),
    (Delay, "inf", "a finite number >= 0"), (Seconds, "1e7", "a finite number > 0 (seconds, at most 1e6)"),
    (Device, "tpu", "auto, cpu, cuda or cuda:N"), (bool, "maybe", "true or false"),
    (list[Seed], ["0", "-1"], "a list, each an integer >= 0"), (LayoutKind, "best", "one of optimised, contiguous"),
])
def test_refusals_say_what_the_value_must_be(hint, word, must):
    with pytest.raises(Invalid) as e:
        check(hint, word, text=True)
    assert e.value.wants.startswith(must) and e.value.value == word


def test_file_values_are_not_words():
    """A parsed file's 2.5 is no count and its "3" no number; an int is a number and stays an int."""
    for hint, value in ((Count, 2.5), (Count, True), (Count, "3"), (Delay, "1"), (list[Seed], "0"), (bool, "true")):
        with pytest.raises(Invalid):
            check(hint, value)
    assert check(Delay, 1) == 1 and type(check(Delay, 1)) is int and check(Delay, 0.5) == 0.5
    assert math.isnan(check(float, float("nan")))  # a plain float is any float: every flag is constrained (test_cli)


@dataclass(kw_only=True)
class _Inner:
    blocks: Count = 4


@dataclass(kw_only=True)
class _Arm:
    kind: LayoutKind
    seeds: list[Seed] = field(default_factory=lambda: [0])


@dataclass(kw_only=True)
class _Study:
    model: str
    inner: _Inner = field(default_factory=_Inner)
    arms: list[_Arm] = field(default_factory=list)


@pytest.mark.parametrize("table, line", [
    ({"model": "m", "colour": 1}, "unknown key 'colour' (known: arms, inner, model)"),
    ({"model": "m", "inner": {"size": 1}}, "unknown key 'inner.size' (known: blocks)"),
    ({"model": "m", "inner": {"blocks": 0}}, "inner.blocks = 0: must be an integer >= 1"),
    ({"model": "m", "inner": 3}, "inner = 3: must be a table"),
    ({"model": "m", "arms": [{"kind": "anti"}, {"kind": "best"}]}, "arms[1].kind = 'best': must be one of"),
    ({"model": "m", "arms": [{"kind": "anti", "seeds": [0, -1]}]}, "arms[0].seeds = [0, -1]: must be a list, each"),
    ({"model": "m", "arms": [{"seeds": []}]}, "missing key 'arms[0].kind'"),
    ({"inner": {}}, "missing key 'model'"),
])
def test_tables_are_refused_by_their_full_key(table, line):
    with pytest.raises(Invalid, match=line.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        from_table(_Study, table)


def test_tables_fill_the_defaults_of_their_dataclasses():
    got = from_table(_Study, {"model": "m", "arms": [{"kind": "anti"}]})
    assert got == _Study(model="m", inner=_Inner(blocks=4), arms=[_Arm(kind="anti", seeds=[0])])


def test_help_words():
    assert words(list[Seed] | None) == "list of int >= 0, or null" and words(bool | None) == "true, false or null"
    assert wants(Count | None) == "an integer >= 1" and words(_Inner) == "table"


def test_core_imports_no_cli_library():
    core = Path(dtpshard.__file__).parent / "core"
    for f in core.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.split(".")[0] in ("jsonargparse", "cyclopts", "tyro", "argparse")], f
