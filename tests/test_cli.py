"""The command line: every numeric and enum flag of every command is checked while parsing (one
line naming the flag, exit 2, before any work), --config files with overrides, --version, --help."""
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from dtpshard import cli
from dtpshard.commands.text import help_type
from dtpshard.core.vocab import Beta, Count, Device, Fraction, NonNegativeInt, NonNegativeNumber, PositiveNumber, Seed

# a value each constrained type refuses
BAD = {Count: "0", NonNegativeInt: "-1", Seed: "-1", PositiveNumber: "nan", NonNegativeNumber: "-1",
       Fraction: "1.5", Beta: "1", Device: "tpu", bool: "maybe"}
# positional arguments and required flags, so that only the flag under test is wrong
REQUIRED = {"generate": ["m", "--prompt", "x"], "layout": ["a", "--out", "o"], "permute": ["m", "l", "--out", "o"],
            "score": ["a", "l"], "affinity": ["m", "--out", "o"], "eval": ["m"], "distill": ["t", "--out", "o"],
            "convert": ["t", "--out", "o"], "experiment": ["s", "--out", "o"], "report": ["d"], "demo": [], "study": [],
            "run": ["m", "--prompt", "x"], "publish": ["d", "--out", "o"],
            "teacher-cache": ["t", "--out", "o"]}


def _base(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, __import__("types").UnionType) and args else hint


def _flags():
    for name in cli.COMMANDS:
        for option in cli.options(cli.load_command(name)):
            if not option.positional:
                yield name, option.key, _base(option.hint)


FLAGS = list(_flags())


def _bad_value(hint):
    if typing.get_origin(hint) is typing.Literal:
        return "nope"
    return BAD.get(hint)


def test_every_numeric_and_enum_flag_is_constrained():
    loose = [f"{c} --{d}" for c, d, h in FLAGS if h in (int, float)]
    assert not loose, f"plain int/float flags accept anything (nan, -1): {loose}"


@pytest.mark.parametrize("command,dest,hint", [f for f in FLAGS if _bad_value(f[2]) is not None],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_bad_flag_value_is_refused_while_parsing(command, dest, hint, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the positional paths do not exist: any work would fail otherwise
    flag = "--" + dest.replace("_", "-")
    value = _bad_value(hint)
    assert cli.main([command, *REQUIRED[command], f"{flag}={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"dtpshard {command}: error: {flag} {value}: must"), err


@pytest.mark.parametrize("args,needle", [
    (["generate", "m", "--prompt", "x", "--device", "tpu"], "--device tpu: must be auto, cpu, cuda or cuda:N"),
    (["layout", "a", "--out", "o", "--kind", "random", "--seed", "-1"], "--seed -1: must be an integer >= 0"),
    (["run", "m", "--prompt", "x", "--timeout", "nan"], "--timeout nan: must be a finite number > 0"),
    (["run", "m", "--prompt", "x", "--threads", "-1"], "--threads -1: must be an integer >= 0"),
    (["distill", "t", "--out", "o", "--timeout", "nan"], "--timeout nan: must be a finite number > 0"),
    (["distill", "t", "--out", "o", "--steps", "2.5"], "--steps 2.5: must be an integer from 1 to 2^31"),
    (["layout", "a", "--out", "o", "--kind", "best"], "--kind best: must be one of optimised, contiguous"),
    (["distill", "t", "--out", "o", "--compile", "maybe"], "unknown argument maybe"),  # bare --compile is `on`
    (["distill", "t", "--out", "o", "--compile=maybe"], "--compile maybe: must be one of auto, on, off"),
    (["teacher-cache", "t", "--out", "o", "--k", "0"], "--k 0: must be an integer >= 1"),
    (["generate", "m"], "missing --prompt"),
    (["generate", "--prompt", "x"], "missing MODEL"),
    (["score", "a", "l", "--colour", "red"], "unknown argument --colour"),
])
def test_refusals_named(args, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_config_file_with_overrides(tmp_path):
    cfg = tmp_path / "distill.yaml"
    cfg.write_text("out: run\nsteps: 7\nlr: 0.001\ntext: [a.txt, b.txt]\nprogress: false\n")
    fn = cli.load_command("distill")
    got = cli.parse("distill", fn, ["teacher", "--config", str(cfg), "--steps", "9"])["cfg"]
    assert (got.steps, got.lr, got.text, got.progress, str(got.out)) == (9, 0.001, ["a.txt", "b.txt"], False, "run")
    assert type(got.steps) is int  # plain values: config.json and YAML dumps stay as they were
    cfg.write_text("steps: 0\n")
    with pytest.raises(cli.Refused, match=r"--steps 0: must be an integer from 1 to 2\^31"):
        cli.parse("distill", fn, ["teacher", "--out", "o", "--config", str(cfg)])


def test_flag_spellings(tmp_path):
    fn = cli.load_command("affinity")
    got = cli.parse("affinity", fn, ["m", "--out", "o", "--seq-len", "8", "--text", "a", "b", "--no-progress",
                                     "--json"])
    assert (got["data"].seq_len, got["data"].text, got["progress"], got["json"]) == (8, ["a", "b"], False, True)
    fn = cli.load_command("distill")

    def compile_as(*flags):
        return cli.parse("distill", fn, ["t", "--out", "o", *flags])["cfg"].compile

    assert (compile_as(), compile_as("--compile"), compile_as("--compile", "off"), compile_as("--no-compile"),
            compile_as("--compile=on", "--steps", "3")) == ("auto", "on", "off", "off", "on")


def test_version_help_and_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "dtpshard", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("dtpshard ")
    probe = ("import sys; from dtpshard import cli; cli.main(['--help']); cli.main(['score', '--help']);"
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("False"), out.stderr  # help imports no torch
    assert "--json" in out.stdout and "default: False" in out.stdout and "required" in out.stdout


def test_experiment_keys_as_nested_flags(tmp_path):
    from dtpshard.studies.config import load_config

    study = tmp_path / "study.toml"
    study.write_text('model = "m"\ndevices = 4\n[training]\nsteps = 3\nwarmup = 1\n[[arms]]\nkind = "contiguous"\n')
    fn = cli.load_command("experiment")
    got = cli.parse("experiment", fn, [str(study), "--out", "o", "--training.lr", "0.002", "--devices", "2",
                                       "--calibration.seq-len", "16", "--no-training.progress"])
    assert got["overrides"] == {"training": {"lr": 0.002, "progress": False}, "devices": 2,
                                "calibration": {"seq_len": 16}}
    cfg = load_config(study, got["overrides"])
    assert cfg.devices == 2 and cfg.calibration.seq_len == 16
    assert cfg.training.lr == 0.002 and cfg.training.steps == 3  # the file's other keys stay
    assert cli.parse("experiment", fn, [str(study), "--out", "o"])["overrides"] == {}


def test_root_cause_of_a_failed_launch(capsys):
    from dtpshard.core.launch import RankExit, root_cause

    assert root_cause([RankExit(0, 0), RankExit(1, 0)]) is None
    said = [RankExit(0, 1, traceback="Traceback...\nRuntimeError: peer lost\n"), RankExit(1, 2, said="bad --layout")]
    assert root_cause(said) == "rank 1 of 2 failed: bad --layout"  # the user error, not the peer that lost it
    died = [RankExit(0, 1, traceback="Traceback...\nRuntimeError: peer lost\n"), RankExit(1, 17)]
    assert root_cause(died) == "rank 1 of 2 died (exit code 17)"
    assert root_cause([RankExit(0, 1, traceback="Traceback...\nValueError: x\n"), RankExit(1, -9)]) == \
        "rank 0 of 2 failed: ValueError: x (its traceback is above)"
    assert "ValueError: x" in capsys.readouterr().err


@pytest.mark.parametrize("content, needle", [(b"devices: caf\xe9\n", "cannot read it (not UTF-8 text)"),
                                             (b"just text\n", "must hold a mapping"),
                                             (b"devices: [1\n", "not YAML or JSON"),
                                             (None, "no such file")])
def test_bad_config_file_is_one_line_naming_it(tmp_path, capsys, content, needle):
    cfg = tmp_path / "opts.yaml"
    if content is not None:
        cfg.write_bytes(content)
    assert cli.main(["layout", str(tmp_path / "a.safetensors"), "--config", str(cfg), "--out",
                     str(tmp_path / "l.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--config {cfg}: {needle}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["opts.yaml"] if content is not None else [])


def test_help_says_what_each_flag_takes_in_words(capsys):
    Optional = typing.Optional  # the old spelling, which help_type reads too (ruff's UP045 would respell it)
    assert help_type(Optional[list[Path]]) == "list of path, or null"
    assert help_type(typing.Literal['auto', 'on', 'off']) == "auto | on | off"
    assert help_type(Count | None) == "int >= 1, or null"
    assert (help_type(Optional[list[typing.Literal['first-order', 'ablation']]])
            == "list of (first-order | ablation), or null")
    assert help_type(typing.Literal['str', 'Path']) == "str | Path"  # choices are kept as they are
    python_names = {"Count", "Seconds", "Seed", "Beta", "TopP", "Device", "NonNegativeInt", "NonNegativeNumber",
                    "PositiveNumber", "ClosedUnitInterval", "Path", "str", "float", "bool", "Optional", "Union",
                    "Literal", "List", "class"}
    for name in cli.COMMANDS:
        assert cli.main([name, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        spans = re.findall(r"type: (.*?)(?:, default:|\)(?: |$))", text)
        assert spans, name
        for span in spans:
            assert not re.search(r"\w\[|<", span), (name, span)  # no list[...], Optional[...], <class ...>
            assert not python_names & set(re.findall(r"\w+", span)), (name, span)


def test_each_command_has_its_own_help(capsys, tmp_path):
    """convert's help is convert's: no --layout (it makes its own), its --out is its directory, and
    no default is said to come from a layout; the three DTP flags read alike in every command."""
    assert cli.main(["convert", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--layout" not in out and "the convert directory DIR" in out and "the run directory" not in out
    assert "layout's, else" not in out
    for name in ("generate", "eval", "distill"):
        assert cli.main([name, "--help"]) == 0
        said = " ".join(re.sub("[│─╭╮╰╯]", " ", capsys.readouterr().out).split())  # the help's box
        assert "default a student's recorded L, else the layout's, else 4" in said, name
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert cli.main(["convert", str(gguf), "--out", str(tmp_path / "o")]) == 2
    assert "is a GGUF file" in capsys.readouterr().err


def test_the_cyclopts_internals_help_is_built_from_are_still_there(capsys):
    """commands/text.py builds --help's table from cyclopts internals, not its public API
    (cyclopts.help.specs, cyclopts.help.inline_text.InlineText; cyclopts is pinned < 6 in
    pyproject.toml). An upgrade that moves or changes them fails here, by name, rather than in a
    user's --help."""
    import inspect

    from cyclopts.help.inline_text import InlineText
    from cyclopts.help.specs import DescriptionRenderer, get_default_parameter_columns

    assert list(inspect.signature(get_default_parameter_columns).parameters)[:3] == ["console", "options", "entries"]
    assert "newline_metadata" in inspect.signature(DescriptionRenderer).parameters
    assert callable(getattr(InlineText, "append", None))
    assert cli.main(["layout", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--devices DEVICES" in out and "(type: int >= 1" in out, out
