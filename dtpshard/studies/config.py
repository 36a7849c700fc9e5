"""The experiment config (see experiment.py for its keys): read TOML or YAML, check every key.

An unknown key or a bad value is refused in one line that names the key (``training.lr``,
``arms[2].kind``), before anything is computed or written. The [training] keys are the fields
of `dtpshard.distill.DistillConfig` that an experiment does not set itself, checked against the
field types and then by distill's own range checks.
"""
from __future__ import annotations

import dataclasses
import math
import re
import typing
from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError

FORMAT = "dtpshard.experiment/1"
KINDS = ("optimised", "contiguous", "random", "anti", "heads-only", "neurons-only")
OPTIMISING = ("optimised", "anti", "heads-only", "neurons-only")
TOP = {"model": str, "devices": int, "delay": float, "device": str, "stage3": str, "text_field": str, "tokenizer": str,
       "calibration": dict, "evaluation": dict, "training": dict, "layouts": dict, "arms": list}
CALIBRATION = {"text": list, "dataset": str, "blocks": int, "seq_len": int, "seed": int, "micro_batch": int}
EVALUATION = {"text": list, "dataset": str, "blocks": int, "micro_batch": int}
LAYOUTS = {"restarts": int, "kv_search": str, "max_sweeps": int}
ARM = {"kind": str, "seeds": list, "layout_seeds": list, "layers": int, "name": str}
# DistillConfig fields the experiment sets itself (per arm, or from the other sections)
NOT_TRAINING = ("teacher", "out", "layout", "devices", "delay", "stage3", "seed", "force", "device",
                "eval_blocks", "eval_text", "eval_dataset", "eval_micro_batch", "text_field", "tokenizer", "tensorboard")


def _type_ok(value: Any, want: Any) -> bool:
    if want is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if want is list:
        return isinstance(value, list)
    return isinstance(value, want)


def _name(want: Any) -> str:
    return {float: "a number", int: "an integer", str: "a string", bool: "true or false", list: "a list",
            dict: "a table"}.get(want, str(want))


def _check_table(table: Any, schema: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise UserError(f"{where}: must be a table")
    for key, value in table.items():
        full = f"{where}.{key}" if where != "config" else key
        if key not in schema:
            raise UserError(f"unknown key {full!r} (known: {', '.join(sorted(schema))})")
        if not _type_ok(value, schema[key]):
            raise UserError(f"{full} = {value!r}: must be {_name(schema[key])}")
    return dict(table)


def _training_schema() -> dict[str, Any]:
    from dtpshard.training.distill import DistillConfig

    hints = typing.get_type_hints(DistillConfig)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(DistillConfig):
        if f.name in NOT_TRAINING:
            continue
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        base = typing.get_origin(args[0]) or args[0]
        out[f.name] = {Path: str}.get(base, base)
    return out


def _positive(value: int, key: str, low: int = 1) -> None:
    if value < low:
        raise UserError(f"{key} = {value}: must be at least {low}")


def _int_list(value: Any, key: str) -> list[int]:
    if not isinstance(value, list) or not all(_type_ok(v, int) and v >= 0 for v in value):
        raise UserError(f"{key} = {value!r}: must be a list of integers >= 0")
    if len(set(value)) != len(value):
        raise UserError(f"{key} = {value!r}: repeats a seed")
    return list(value)


def _text_list(value: Any, key: str) -> None:
    if value is not None and not (value and all(isinstance(v, str) for v in value)):
        raise UserError(f"{key} = {value!r}: must be a non-empty list of file paths")


def check_config(raw: Any) -> dict[str, Any]:
    """The validated config with its defaults filled in; one line naming the key if anything is wrong."""
    from dtpshard.training.distill import DistillConfig, check_config as check_distill

    cfg = _check_table(raw, TOP, "config")
    for key in ("model", "arms"):
        if key not in cfg:
            raise UserError(f"missing key {key!r}")
    cfg.setdefault("devices", 4)
    cfg.setdefault("delay", 1)
    cfg.setdefault("device", "auto")
    cfg.setdefault("stage3", "sqrt")
    cfg.setdefault("text_field", "text")  # the column/field of every text source
    cfg.setdefault("tokenizer", None)  # None: the model's
    _positive(cfg["devices"], "devices")
    if cfg["delay"] < 0:
        raise UserError(f"delay = {cfg['delay']}: must be >= 0")
    if cfg["stage3"] not in ("sqrt", "one"):
        raise UserError(f"stage3 = {cfg['stage3']!r}: must be 'sqrt' or 'one'")
    cal = _check_table(cfg.get("calibration", {}), CALIBRATION, "calibration")
    cal = {"text": None, "dataset": None, "blocks": 64, "seq_len": 1024, "seed": 0, "micro_batch": 4, **cal}
    ev = _check_table(cfg.get("evaluation", {}), EVALUATION, "evaluation")
    ev = {"text": None, "dataset": None, "blocks": 16, "micro_batch": None, **ev}
    lay = _check_table(cfg.get("layouts", {}), LAYOUTS, "layouts")
    lay = {"restarts": 1, "kv_search": "assignment", "max_sweeps": 20, **lay}
    for where, table, keys in (("calibration", cal, ("blocks", "seq_len", "micro_batch")),
                               ("evaluation", ev, ("blocks", "micro_batch")),
                               ("layouts", lay, ("restarts", "max_sweeps"))):
        for k in keys:
            if table[k] is not None:
                _positive(table[k], f"{where}.{k}")
        if where != "layouts":
            _text_list(table["text"], f"{where}.text")
            if table["text"] is not None and table["dataset"] is not None:
                raise UserError(f"{where}: give text or dataset, not both")
    if lay["kv_search"] not in ("assignment", "exhaustive"):
        raise UserError(f"layouts.kv_search = {lay['kv_search']!r}: must be 'assignment' or 'exhaustive'")
    train = _check_table(cfg.get("training", {}), _training_schema(), "training")
    _text_list(train.get("text"), "training.text")
    if "text" not in train and "dataset" not in train:  # train on the calibration source by default
        train["text"], train["dataset"] = cal["text"], cal["dataset"]
    try:
        check_distill(DistillConfig(teacher=Path("."), out=Path("."), **train))
    except UserError as e:  # the distill check names flags; name the config key instead
        raise UserError(re.sub(r"--([\w-]+)", lambda m: "training." + m.group(1).replace("-", "_"), str(e))) from None
    cfg.update(calibration=cal, evaluation=ev, layouts=lay, training=train,
               arms=[_check_arm(a, i) for i, a in enumerate(cfg["arms"])])
    if not cfg["arms"]:
        raise UserError("arms = []: give at least one arm")
    names = [layout["name"] for arm in cfg["arms"] for layout in arm["layouts"]]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"arms: layout name {dup[0]!r} appears twice (give the arms distinct names)")
    return cfg


def _check_arm(arm: Any, i: int) -> dict[str, Any]:
    where = f"arms[{i}]"
    arm = _check_table(arm, ARM, where)
    kind = arm.get("kind")
    if kind not in KINDS:
        raise UserError(f"{where}.kind = {kind!r}: must be one of {', '.join(KINDS)}")
    seeds = _int_list(arm.get("seeds", [0]), f"{where}.seeds")
    if "layout_seeds" in arm and kind != "random":
        raise UserError(f"{where}.layout_seeds: only random arms have layout seeds")
    if "layers" in arm:
        if kind not in OPTIMISING:
            raise UserError(f"{where}.layers: only optimising kinds ({', '.join(OPTIMISING)}) take layers")
        _positive(arm["layers"], f"{where}.layers")
    base = arm.get("name") or (kind if "layers" not in arm else f"{kind}-layers-{arm['layers']}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", base):
        raise UserError(f"{where}.name = {base!r}: use letters, digits, '.', '_' and '-' only")
    if kind == "random":
        layout_seeds = _int_list(arm.get("layout_seeds", [0]), f"{where}.layout_seeds")
        if not layout_seeds:
            raise UserError(f"{where}.layout_seeds = []: give at least one")
        layouts = [{"name": f"{base}-{s}", "kind": kind, "seed": s, "layers": None} for s in layout_seeds]
    else:
        layouts = [{"name": base, "kind": kind, "seed": 0, "layers": arm.get("layers")}]
    return {"kind": kind, "seeds": seeds, "layouts": layouts}


def load_config(path: Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read config {path}: {e}") from None
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
        return check_config(raw)
    except UserError as e:
        raise UserError(f"config {path}: {e}") from None


def resolve_model(model: str) -> Path:
    """A local checkpoint dir, or an HF id found in the local HF cache (never downloaded here)."""
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
