"""Local Hugging Face checkpoints: config, (sharded) safetensors, tokenizer. The state-dict adapter.

dtpshard's modules use Hugging Face's own parameter names, so the adapter is mostly a check
that every tensor is one the DTP forward understands (anything else, such as a fused qkv or a
Gemma post-norm, is refused by name).
"""
from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dtpshard.core.delayed import DELAYED_KEY, check_delayed
from dtpshard.core.errors import UserError, config_errors, first_line, quote, typed_config
from dtpshard.core.family import FAMILY, stored_shapes
from dtpshard.core.io import copy_regular, dumps, file_hashes, read_json_object
from dtpshard.core.layout import Layout, permuted_layout
from dtpshard.core.memory import check_fits
from dtpshard.core.settings import read_record
from dtpshard.core.shape import (
    FAMILIES,
    STUDENT_TYPE,
    ModelShape,
    check_numbers,
    shape_from_hf_config,
)
from dtpshard.model.pretrained import load, refused_code
from dtpshard.model.shards import (
    DEFAULT_MAX_SHARD_SIZE,
    SAFETENSORS_DTYPES,
    Weights,
    parse_size,
    write_weights,
)
from dtpshard.model.tensor_files import TensorFiles
from dtpshard.model.tokenizer import TOKENIZER_BYTES, TOKENIZER_FILES, read_tokenizer

# a student gets the tokenizer's files and the generation defaults copied beside its weights
COPIED_FILES = (*TOKENIZER_FILES, "generation_config.json")
__all__ = ["TOKENIZER_BYTES", "TOKENIZER_FILES"]  # where the tokenizer's are read (model/tokenizer.py)

DTP_JSON = "dtp.json"  # students before the config block recorded their settings only here (still read)
DTP_KEY = "dtp"  # the block in a student's config.json: family, devices, delay, stage3, layout_sha256

def load_hf_config(path: str | Path) -> Any:
    """The checkpoint's transformers config, config.json read once; a DTP student's (model_type
    "dtp") is dtpshard's own DTPConfig (model/student.py), read without transformers' remote code:
    dtpshard is that code."""
    path = Path(path)
    if not path.is_dir():
        if path.suffix.lower() == ".gguf" and os.path.lexists(path):
            raise UserError(f"{path} is a GGUF file: dtpshard reads Hugging Face checkpoint directories (config.json "
                            "and safetensors); convert it with transformers first (from_pretrained(..., gguf_file=...) "
                            "then save_pretrained)")
        if os.path.lexists(path):
            raise UserError(f"{path} is not a directory: give a Hugging Face checkpoint directory")
        raise UserError(f"model directory not found: {path}")
    if not os.path.lexists(path / "config.json"):  # anything else there: the reader names it
        raise UserError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    raw = read_json_object(path / "config.json", "model config")  # within bounds before transformers parses it
    if raw.get("model_type") in (*FAMILIES, STUDENT_TYPE):  # any other model is refused by name below
        check_numbers(raw, str(path / "config.json"))
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    where = f"{path}/config.json"
    if raw.get("model_type") == STUDENT_TYPE:
        from dtpshard.model.student import DTPConfig

        return typed_config(DTPConfig, raw, where)
    if raw.get("model_type") in FAMILIES:  # what AutoConfig does with the file's dict for these
        if raw.get("auto_map"):  # transformers would run its own class instead, silently: never what was meant
            named = next(iter(raw["auto_map"].values()), "") if isinstance(raw["auto_map"], dict) else raw["auto_map"]
            raise UserError(f"{where}: auto_map names Python of its own ({quote(named)}), which dtpshard never runs; "
                            f"it would run transformers' built-in {raw['model_type']!r} in its place. If that is the "
                            "model, remove auto_map from config.json (or copy the checkpoint without it)")
        return typed_config(CONFIG_MAPPING[raw["model_type"]], raw, where)
    try:  # any other model is refused by name (core.shape), after transformers has read it its own way
        return load(AutoConfig, path)
    except (ValueError, TypeError, KeyError, OSError, json.JSONDecodeError, *config_errors()) as e:
        if refused_code(e):
            raise UserError(f"{where}: model_type {raw.get('model_type')!r} names Python of its own "
                            "(auto_map), which dtpshard never runs") from None
        raise UserError(f"{where}: {first_line(e)}") from None


def is_student(hf_config: Any) -> bool:
    """Whether a config is a DTP student's (model_type "dtp")."""
    return getattr(hf_config, "model_type", None) == STUDENT_TYPE


def student_record(path: Path, hf_config: Any) -> dict[str, Any] | None:
    """What a distilled student at `path` recorded about itself (checked), None for a dense model:
    the `dtp` block of its config.json, or the dtp.json of students saved before that block."""
    record = read_record(getattr(hf_config, DTP_KEY, None), str(path / "config.json"))
    if record is None and (path / DTP_JSON).is_file():
        record = read_record(read_json_object(path / DTP_JSON, "DTP settings"), str(path / DTP_JSON))
    return record


def read_shape(path: str | Path) -> ModelShape:
    """The model's shape from its config.json alone (no weights read)."""
    return shape_from_hf_config(load_hf_config(path))


def check_keys(files: TensorFiles, shape: ModelShape, fused: bool, path: Path) -> None:
    """Every tensor the family's format (fused: its own; else the canonical one, a student's) has,
    with the shape config.json implies, and no other: the DTP forward would silently ignore one
    (a post-norm, an o_proj bias, a fused tensor of another family)."""
    want = stored_shapes(shape, fused)
    for k in files.stored_keys():
        if k.endswith("rotary_emb.inv_freq") or (k == "lm_head.weight" and shape.tied):
            continue
        if k not in want:
            fam = FAMILY[shape.family]
            per = fam.stored() if fused else fam.canonical(shape.qkv_bias, shape.qk_norm)
            raise UserError(f"unsupported tensor {k!r} in checkpoint (a {shape.family} "
                            f"{'checkpoint' if fused else 'student'} holds {', '.join(per)} in each layer; "
                            "extra norms and o_proj/MLP biases are not supported)")
        if files.shapes[files.alias[k]] != want[k]:
            raise UserError(f"{path}: tensor {k} has shape {files.shapes[files.alias[k]]} in the weights but "
                            f"config.json implies {want[k]} (the config does not match the weights)")
    for k in want:
        if k not in files.alias:
            raise UserError(f"checkpoint is missing tensor {k!r}")


@dataclass
class Checkpoint:
    """A checkpoint opened once (open_checkpoint) and passed along: config.json read once, every
    weight file's header read once, and what a command asks of it from those."""

    path: Path
    hf_config: Any
    shape: ModelShape
    files: TensorFiles
    applied: Layout | None = None  # a permuted checkpoint's layout (core/layout.py permuted_layout)

    @property
    def family(self) -> str:
        """The base family (a student's: the one its weights came from)."""
        return self.shape.family

    @functools.cached_property
    def record(self) -> dict[str, Any] | None:
        """What a distilled student recorded about itself (model/hf.py's student_record), None for a
        dense model."""
        record = student_record(self.path, self.hf_config)
        if record is not None:  # its set against this model's modules, naming the file that lists it
            check_delayed(record.get(DELAYED_KEY), self.shape.modules, f"{self.path / 'config.json'}: dtp.delayed")
        return record

    @property
    def defaults(self) -> dict[str, Any] | None:
        """The settings this checkpoint runs with unless told otherwise, and the layout its weights
        hold already: a student's record, else a permuted checkpoint's layout (its L, δ and delayed
        modules: the function that layout applied at load gives), else None (a dense model)."""
        if self.record is not None or self.applied is None:
            return self.record
        lay = self.applied
        return {"devices": lay.devices, "delay": lay.delay, DELAYED_KEY: None if lay.delayed is None else
                list(lay.delayed), "layout_sha256": lay.content_sha256()}

    @property
    def weight_files(self) -> list[Path]:
        return self.files.files

    def tokenizer_files(self) -> list[Path]:
        """The tokenizer files in the checkpoint's directory (copied beside a student)."""
        return [self.path / n for n in TOKENIZER_FILES if (self.path / n).is_file()]

    def tokenizer(self, directory: str | Path | None = None) -> Any:
        """The tokenizer in `directory`, else the checkpoint's own, picked by this config (not read again)."""
        return read_tokenizer(Path(directory or self.path), self.hf_config)

    def weight_hashes(self) -> dict[str, str]:
        """sha256 of every weight file, by name (the model card's and a study's provenance)."""
        return file_hashes(self.weight_files)

    def check_fits(self, dtype: torch.dtype | str | None) -> None:
        """Refuse, before reading a weight, a checkpoint whose tensors (in `dtype`, "auto"/None: as
        stored) need more RAM than is available now: it would be killed for memory half-way."""
        dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        stored = {name: t.itemsize for t, name in SAFETENSORS_DTYPES.items()}
        need = sum(math.prod(self.files.shape(k)) * (dtype.itemsize if isinstance(dtype, torch.dtype)
                                                     else stored.get(self.files.dtype(k), 4))
                   for k in self.files.keys())
        check_fits(need, f"{self.path}: loading its weights")

    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        sd = {}
        for k in self.files.keys():
            if k.endswith("rotary_emb.inv_freq"):
                continue
            t = self.files.get(k)
            sd[k] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        return sd


def open_checkpoint(path: str | Path, hf_config: Any = None) -> Checkpoint:
    """The checkpoint at `path` (`hf_config`: its config when read already, load_hf_config's)."""
    path = Path(path)
    cfg = load_hf_config(path) if hf_config is None else hf_config
    shape = shape_from_hf_config(cfg)  # a student's shared neurons from its config, a permuted checkpoint's here:
    applied = None if is_student(cfg) else permuted_layout(path)
    if not shape.shared and applied is not None:
        shape = replace(shape, shared=applied.shared)
    files = TensorFiles(path)
    fused = not is_student(cfg)  # a student keeps the canonical names (its DTPForCausalLM's); a dense model its own
    check_keys(files, shape, fused, path)
    if fused:
        files.unfuse(shape)
    return Checkpoint(path, cfg, shape, files, applied)


def load_tokenizer(path: str | Path | Checkpoint) -> Any:
    """The tokenizer of a directory, or of an open checkpoint (whose config is not read again)."""
    if isinstance(path, Checkpoint):
        return path.tokenizer()
    path = Path(path)
    return read_tokenizer(path, load_hf_config(path) if (path / "config.json").is_file() else None)


def save_checkpoint(out_dir: Path, hf_config: Any, weights: Weights, source: Path | None = None,
                    extra_json: dict[str, Any] | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                    write: bool = True) -> None:
    """Write a transformers-loadable directory (into an already-temporary `out_dir`): config, the
    weights in safetensors shards (model/shards.py), the tokenizer files of `source`, extra JSON
    files. write=False: only ask for the weights in turn (the other ranks of a sharded save)."""
    if hf_config.tie_word_embeddings:
        weights = weights.without({"lm_head.weight"})
    if not write:
        write_weights(out_dir, weights.specs, weights.produce, parse_size(max_shard_size), write=False)
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(out_dir))
    write_weights(out_dir, weights.specs, weights.produce, parse_size(max_shard_size))
    if source is not None:
        for name in COPIED_FILES:
            if (source / name).is_file():  # read as every input is (core/reading.py)
                copy_regular(source / name, out_dir / name, TOKENIZER_BYTES, "tokenizer file")
    for name, obj in (extra_json or {}).items():
        (out_dir / name).write_text(dumps(obj, indent=1) + "\n", encoding="utf-8")


def check_token_ids(ids: torch.Tensor, vocab: int, model: str | Path) -> None:
    """Refuse ids the model has no embedding for: the tokenizer files belong to another model."""
    if ids.numel() and int(ids.max()) >= vocab:
        raise UserError(f"the tokenizer in {model} produced token id {int(ids.max())} but the model's vocab_size is "
                        f"{vocab} (its tokenizer files belong to another model)")
