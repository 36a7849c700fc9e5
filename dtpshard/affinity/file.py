"""The affinity file: one float32 tensor `edge.{a}.{b}` per edge, shape [units(a), units(b)].

Modules are numbered 2i (attention of layer i) and 2i+1 (FFN of layer i). Units are KV groups
for attention and neurons for FFNs. Metadata (all strings, as safetensors requires): format,
model (JSON: layers, kv_groups, heads_per_group, neurons), delay, tokens, options (JSON), source.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import save_file

from dtpshard.core.errors import UserError
from dtpshard.core.io import atomic_path, check_keys, dumps, loads, open_safetensors
from dtpshard.core.memory import check_fits
from dtpshard.core.shape import UnitShape
from dtpshard.model.delay import schedule

FORMAT = "dtpshard.affinity/1"
META_KEYS = ("format", "model", "delay", "tokens", "options", "source")  # every metadata key, as save writes
_META_BYTES = 1 << 20  # one metadata value: a few hundred bytes in practice


def is_affinity_file(path: str | Path) -> bool:
    """Whether `path` is an affinity file (what `dtpshard affinity --out` may replace): its header says so."""
    with open_safetensors(path, "numpy") as f:
        return (f.metadata() or {}).get("format") == FORMAT


def edges_for_delay(modules: int, delay: float, delayed: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """Edges (a, b): module b runs before a's partials arrive (b - δ <= a <= b - 1, a delayed), as
    the delay schedule says (model/delay.py; neither L nor the stage-3 scale changes when a sum
    lands). `delayed`: the delayed modules (None: all); a plain module is the source of no edge."""
    return schedule(modules, 2, delay, "sqrt", delayed).edges()


def _needed(name: str, needed: set[str]) -> bool:
    """Whether tensor `name` is one of the `needed` edges' (a name that is no edge's is kept, to be refused later)."""
    parts = name.split(".")
    if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()):
        return True
    return name in needed


@dataclass
class Affinity:
    model: UnitShape
    delay: float
    edges: dict[tuple[int, int], np.ndarray]  # raw mean scores, float64 in memory
    tokens: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    def save(self, path: str | Path) -> None:
        """Written only when it is a result: at least one edge, every score a finite number, and not
        all of them 0 (the calibration of a model whose numbers overflow gives NaN, and a layout
        optimised on nothing would be reported as optimised)."""
        if not self.edges:
            raise UserError(f"{path}: no edge was scored (nothing written)")
        for (a, b), s in self.edges.items():
            if not np.isfinite(s).all():
                raise UserError(f"{path}: edge {a}->{b} has NaN or infinite scores (the model's activations are "
                                "not finite numbers); nothing written")
        if not any(np.any(s) for s in self.edges.values()):
            raise UserError(f"{path}: every affinity score is 0 (no signal to optimise a layout on); nothing written")
        tensors = {f"edge.{a}.{b}": np.ascontiguousarray(s, dtype=np.float32) for (a, b), s in self.edges.items()}
        meta = {"format": FORMAT, "model": dumps(self.model.to_json()), "delay": dumps(self.delay),
                "tokens": str(int(self.tokens)), "options": dumps(self.options), "source": self.source}
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, delay: float | None = None) -> Affinity:
        """Every edge, or only those `delay` needs (a δ = 1 layout from a δ = 2 file skips
        the neurons x neurons edges); refused in one line if they do not fit in memory."""
        path = Path(path)
        if not os.path.lexists(path):
            raise UserError(f"affinity file not found: {path}")
        try:
            with open_safetensors(path, "numpy") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:  # the header, checked before any tensor is read
                    raise UserError(f"{path}: format={meta.get('format')!r}, expected {FORMAT!r}")
                check_keys(meta, META_KEYS, f"{path}: metadata")
                model, file_delay, options, tokens = _metadata(meta, path)
                model = UnitShape.from_json(model, f"{path}: metadata")
                needed = None if delay is None else {f"edge.{a}.{b}" for a, b in edges_for_delay(model.modules, delay)}
                names = [k for k in f.keys() if needed is None or _needed(k, needed)]
                sizes = [math.prod(f.get_slice(k).get_shape()) for k in names]
                check_fits(8 * sum(sizes) + 4 * max(sizes, default=0), f"{path}: {len(names)} edges in float64",
                           "at delay >= 2 every FFN -> FFN edge is neurons x neurons")
                arrays = {k: f.get_tensor(k) for k in names}
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{path}: not a safetensors affinity file ({e})") from None
        edges: dict[tuple[int, int], np.ndarray] = {}
        for name, arr in arrays.items():
            parts = name.split(".")
            if len(parts) != 3 or parts[0] != "edge" or not (parts[1].isdigit() and parts[2].isdigit()):
                raise UserError(f"{path}: unexpected tensor {name!r}")
            a, b = int(parts[1]), int(parts[2])
            if not (0 <= a < b < model.modules):
                raise UserError(f"{path}: {name} is not an edge of a {model.layers}-layer model")
            want = (model.units(a), model.units(b))
            if arr.shape != want:
                raise UserError(f"{path}: {name} has shape {list(arr.shape)}, expected {list(want)}")
            if not np.isfinite(arr).all():
                raise UserError(f"{path}: {name} contains NaN or infinite values")
            if (arr < 0).any():
                raise UserError(f"{path}: {name} has negative scores")
            edges[(a, b)] = arr.astype(np.float64)
        return cls(model, file_delay, edges, tokens, options, meta.get("source", ""))

    def require_edges(self, delay: float, delayed: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
        """The edges δ needs (of the `delayed` modules; None: all), each present, or one line saying
        which is missing."""
        need = edges_for_delay(self.model.modules, delay, delayed)
        for e in need:
            if e not in self.edges:
                raise UserError(f"affinity has no edge.{e[0]}.{e[1]}, needed at delay {delay} "
                                f"(it was computed for delay {self.delay})")
        return need


def _metadata(meta: dict[str, str], path: Path) -> tuple[Any, float, dict[str, Any], int]:
    """(model, delay, options, tokens) from the header's strings, each parsed within bounds."""
    where = f"{path}: metadata"
    for key, value in meta.items():
        if len(value) > _META_BYTES:
            raise UserError(f"{where}: {key} is {len(value)} bytes, more than it can need ({_META_BYTES} at most)")
    try:
        model = loads(meta["model"], f"{where} model")
        delay = loads(meta.get("delay", "1"), f"{where} delay")
        options = loads(meta.get("options", "{}"), f"{where} options")
        tokens = loads(meta.get("tokens", "0"), f"{where} tokens")
    except (KeyError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: bad metadata ({e})") from None
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay < math.inf:
        raise UserError(f"{where}: delay = {meta.get('delay')!r} is not a finite number >= 0")
    if not isinstance(options, dict):
        raise UserError(f"{where}: options must be a JSON object")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise UserError(f"{where}: tokens = {meta.get('tokens')!r} is not a count")
    return model, delay, options, tokens
