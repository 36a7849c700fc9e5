"""Layouts (docs/design.md §3): per layer, a permutation of its KV groups and one of its neurons.

A permutation is keyed by its module m, as everywhere in dtpshard (m = 2i: layer i's attention,
whose units are KV groups; m = 2i + 1: layer i's FFN, whose units are neurons): `perm(m)`,
`device(m)`, `model.units(m)`. Position p after permutation holds original unit perm[p]; device
d holds positions [d·units/L, (d+1)·units/L). A layout is plain data and is saved as JSON
(`dtpshard.layout/1`, per layer a kv_perm and an ffn_perm); `kv_perms`/`ffn_perms` are the same
permutations by layer.

A shared layout (docs/design.md §6) replicates `shared` = n neurons of every layer on all devices:
they are the last n positions of each ffn_perm (the file records n, how they were chosen and,
per layer, the set, checked against the permutation's tail), and device d holds positions
[d·(N - n)/L, (d+1)·(N - n)/L) of the rest. Their device is SHARED (-1): co-located with everything.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dtpshard.core.delayed import DELAYED_KEY, check_delayed
from dtpshard.core.errors import UserError
from dtpshard.core.io import atomic_write_text, check_keys, dumps, loads, read_bytes, short_sha256
from dtpshard.core.owned import raw_mark
from dtpshard.core.settings import DEFAULT
from dtpshard.core.shape import UNIT_FIELDS, UnitShape, check_devices
from dtpshard.core.vocab import SHARED_BY

FORMAT = "dtpshard.layout/1"
KEYS = ("format", "devices", "delay", "kind", "seed", "model", "layers", "score")  # what a layout file is written with
SHARED_KEYS = ("shared", "shared_by")  # written only by a shared layout (older readers see no change otherwise)
HASH_KEY = "layout_sha256"  # the one key of a layout's content hash (content_sha256), wherever it is recorded
# DELAYED_KEY is written only by a layout for some modules (core/delayed.py): absent, every module is
# delayed; a file may record its hash, under the key or the older "sha256"
READ_KEYS = (*KEYS, *SHARED_KEYS, DELAYED_KEY, HASH_KEY, "sha256")
LAYER_KEYS = ("kv_perm", "ffn_perm", "shared")
SHARED = -1  # the device of a shared neuron: every device's
PERMUTED_JSON = "layout.json"  # the layout a permuted checkpoint was made with, beside its weights (permute)
PERMUTE_COMMAND = "permute"  # the mark (core/owned.py) of a directory `dtpshard permute` wrote
MAX_BYTES = 1 << 30  # before the model it is for is known: a 405B model's layout is ~50 MB


def max_bytes(model: UnitShape) -> int:
    """The most a layout file of `model` can need: every index with its separator and generous
    indentation (16 characters), a few KiB per layer of score parts, 1 MiB for the rest."""
    digits = len(str(max(model.kv_groups, model.neurons)))
    return model.layers * ((model.kv_groups + model.neurons) * (digits + 16) + 8192) + (1 << 20)


def is_layout_file(path: Path) -> bool:
    """Whether `path` holds a dtpshard layout (what `dtpshard layout --out` may replace)."""
    return Path(path).is_file() and Layout.load(path).devices >= 1


@dataclass
class Layout:
    devices: int
    delay: float
    kind: str
    model: UnitShape
    kv_perms: list[np.ndarray]  # per layer, [G] ints
    ffn_perms: list[np.ndarray]  # per layer, [N] ints
    seed: int | None = None
    score: dict[str, Any] = field(default_factory=dict)
    shared: int = 0  # n: the last n positions of every ffn_perm are replicated on all devices
    shared_by: str | None = None  # how they were chosen (core.vocab.SHARED_BY); None when n = 0
    # the modules delayed by δ (core/delayed.py; None: every module), and how they were chosen
    delayed: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_devices(self.model, self.devices, shared=self.shared)
        self.delayed = check_delayed(self.delayed, self.model.modules, "layout: delayed")

    # -- construction --------------------------------------------------------------------
    @classmethod
    def contiguous(cls, model: UnitShape, devices: int, delay: float = DEFAULT.delay) -> Layout:
        check_devices(model, devices)
        n = model.layers
        return cls(devices, delay, "contiguous", model.unit_shape(),
                   [np.arange(model.kv_groups) for _ in range(n)], [np.arange(model.neurons) for _ in range(n)])

    @classmethod
    def random(cls, model: UnitShape, devices: int, delay: float = DEFAULT.delay, seed: int = 0,
               shared: list[np.ndarray] | None = None, shared_by: str | None = None) -> Layout:
        """Seeded uniform permutations; `shared`: each layer's shared neurons, put last (None: none, or
        with shared_by "random", n of them drawn by the same permutation: its last n)."""
        rng = np.random.default_rng(seed)
        kv = [rng.permutation(model.kv_groups) for _ in range(model.layers)]
        ffn = [rng.permutation(model.neurons) for _ in range(model.layers)]
        if shared is not None:
            ffn = [shared_last(p, s) for p, s in zip(ffn, shared)]
        n = 0 if shared is None else len(shared[0])
        return cls(devices, delay, "random", model.unit_shape(), kv, ffn, seed=seed, shared=n,
                   shared_by=shared_by if n else None)

    @classmethod
    def contiguous_shared(cls, model: UnitShape, devices: int, delay: float, shared: list[np.ndarray],
                          shared_by: str) -> Layout:
        """The contiguous layout over the sharded neurons (in their order), each layer's `shared` last."""
        ffn = [shared_last(np.arange(model.neurons), s) for s in shared]
        kv = [np.arange(model.kv_groups) for _ in range(model.layers)]
        n = len(shared[0])
        return cls(devices, delay, "contiguous", model.unit_shape(), kv, ffn, shared=n,
                   shared_by=shared_by if n else None)

    @classmethod
    def from_module_perms(cls, model: UnitShape, devices: int, delay: float, kind: str,
                          perms: list[np.ndarray], seed: int | None = None, shared: int = 0) -> Layout:
        """From perms[m], one per module (2 per layer); `shared`: the last n of each FFN's are shared."""
        return cls(devices, delay, kind, model.unit_shape(), list(perms[0::2]), list(perms[1::2]), seed=seed,
                   shared=shared)

    def with_shared(self, shared: int, shared_by: str | None) -> Layout:
        """This layout with the last `shared` neurons of every ffn_perm replicated."""
        return Layout(self.devices, self.delay, self.kind, self.model, self.kv_perms, self.ffn_perms, self.seed,
                      self.score, shared, shared_by if shared else None, self.delayed)

    # -- queries -------------------------------------------------------------------------
    @property
    def layers(self) -> int:
        return self.model.layers

    def perm(self, m: int) -> np.ndarray:
        """Module m's permutation of its units (KV groups for even m, neurons for odd m)."""
        return (self.kv_perms if m % 2 == 0 else self.ffn_perms)[m // 2]

    def device(self, m: int) -> np.ndarray:
        """[units(m)]: the device of each original unit of module m (SHARED for a shared neuron)."""
        return _device_of(self.perm(m), self.devices, self.shared if m % 2 else 0)

    def shared_neurons(self, layer: int) -> np.ndarray:
        """The original indices of layer `layer`'s shared neurons, in the order they are stored (last)."""
        perm = self.ffn_perms[layer]
        return perm[len(perm) - self.shared:]

    def kv_device(self, layer: int) -> np.ndarray:
        """[G]: the device of each original KV group (module 2·layer)."""
        return self.device(2 * layer)

    def ffn_device(self, layer: int) -> np.ndarray:
        """[N]: the device of each original neuron (module 2·layer + 1)."""
        return self.device(2 * layer + 1)

    def is_identity(self) -> bool:
        return all((p == np.arange(len(p))).all() for p in self.kv_perms + self.ffn_perms)

    def content_sha256(self) -> str:
        """A hash of what the layout does (L and every permutation), not of its file: a layout
        rescored or saved with other timings keeps its hash: core.io.short_sha256. Published as
        `layout_sha256` everywhere (a layout file, a run's config.json, a student's record)."""
        perms = [[int(i) for i in p] for p in self.kv_perms + self.ffn_perms]
        what: dict[str, Any] = {"devices": self.devices, "perms": perms}
        if self.shared:  # the same permutations with their tail replicated are another function
            what["shared"] = self.shared
        if self.delayed is not None:  # so are the same permutations with some modules plain
            what[DELAYED_KEY] = list(self.delayed)
        data = json.dumps(what, separators=(",", ":"))
        return short_sha256(data.encode())

    def function_key(self) -> str:
        """What makes two layouts the same DTP function: which units share a device, layer by layer.
        The devices are interchangeable (relabelling them, or reordering units within one, changes
        nothing), so the key is the sorted list of each device's units over all layers."""
        per_device = []
        for d in range(self.devices):
            units = []
            for kv, ffn in zip(self.kv_perms, self.ffn_perms):
                g, n = len(kv) // self.devices, (len(ffn) - self.shared) // self.devices
                units.append((sorted(int(i) for i in kv[d * g:(d + 1) * g]),
                              sorted(int(i) for i in ffn[d * n:(d + 1) * n])))
            per_device.append(units)
        key: list[Any] = sorted(per_device)
        if self.shared:
            key = [key, [sorted(int(i) for i in self.shared_neurons(i)) for i in range(self.layers)]]
        return json.dumps(key, separators=(",", ":"))

    # -- serialisation -------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        layers = [{"kv_perm": [int(i) for i in k], "ffn_perm": [int(i) for i in f]}
                  for k, f in zip(self.kv_perms, self.ffn_perms)]
        shared = {}
        if self.shared:
            shared = {"shared": self.shared, "shared_by": self.shared_by}
            for i, entry in enumerate(layers):  # for a reader: the tail of ffn_perm, sorted
                entry["shared"] = sorted(int(u) for u in self.shared_neurons(i))
        delayed = {} if self.delayed is None else {DELAYED_KEY: list(self.delayed)}
        return {
            "format": FORMAT, "devices": self.devices, "delay": self.delay, "kind": self.kind,
            "seed": self.seed, "model": self.model.to_json(), **shared, **delayed, "layers": layers,
            "score": self.score,
        }

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, dumps(self.to_json()) + "\n")

    @classmethod
    def from_json(cls, obj: Any, where: str = "layout", nbytes: int | None = None) -> Layout:
        """A layout from its parsed file (`nbytes`: the file's size, refused when more than the
        model it names could need), every key and value checked before any array is made."""
        if not isinstance(obj, dict):
            raise UserError(f"{where}: not a JSON object")
        if obj.get("format") != FORMAT:
            raise UserError(f"{where}: format={obj.get('format')!r}, expected {FORMAT!r}")
        check_keys(obj, READ_KEYS, where)
        for key in ("devices", "delay", "model", "layers"):
            if key not in obj:
                raise UserError(f"{where}: missing field {key!r}")
        model = UnitShape.from_json(obj["model"], where)
        if nbytes is not None and nbytes > max_bytes(model):
            raise UserError(f"{where}: {nbytes} bytes, more than a layout of this model can need "
                            f"({max_bytes(model)} at most)")
        devices, delay = obj["devices"], obj["delay"]
        if not _is_int(devices) or devices < 1:
            raise UserError(f"{where}: devices={devices!r} must be a positive integer")
        if (isinstance(delay, bool) or not isinstance(delay, (int, float)) or not math.isfinite(delay)
                or delay < 0):
            raise UserError(f"{where}: delay={delay!r} must be a number >= 0")
        score = obj.get("score") or {}
        if not isinstance(score, dict):
            raise UserError(f"{where}: score must be an object, not {type(score).__name__}")
        shared, shared_by = obj.get("shared", 0), obj.get("shared_by")
        if not _is_int(shared) or shared < 0:
            raise UserError(f"{where}: shared={shared!r} must be an integer >= 0")
        if shared and shared_by not in SHARED_BY:
            raise UserError(f"{where}: shared_by={shared_by!r} must be one of {', '.join(SHARED_BY)}")
        check_devices(model, devices, where, shared=shared)
        layers = obj["layers"]
        if not isinstance(layers, list) or len(layers) != model.layers:
            got = len(layers) if isinstance(layers, list) else type(layers).__name__
            raise UserError(f"{where}: {got} layers listed, model has {model.layers}")
        kv, ffn = [], []
        for i, entry in enumerate(layers):
            if not isinstance(entry, dict):
                raise UserError(f"{where}: layer {i} is not an object")
            check_keys(entry, LAYER_KEYS, f"{where}: layer {i}")
            kv.append(_check_perm(entry.get("kv_perm"), model.kv_groups, f"{where}: layer {i} kv_perm"))
            ffn.append(_check_perm(entry.get("ffn_perm"), model.neurons, f"{where}: layer {i} ffn_perm"))
            listed = entry.get("shared", [])
            tail = sorted(int(u) for u in ffn[-1][model.neurons - shared:])
            if not isinstance(listed, list) or not all(_is_int(u) for u in listed) or sorted(listed) != tail:
                raise UserError(f"{where}: layer {i} lists shared neurons other than the last {shared} of its ffn_perm")
        seed = obj.get("seed")
        listed = obj.get(DELAYED_KEY)
        if listed is not None and not isinstance(listed, list):
            raise UserError(f"{where}: delayed must be a list of module indices")
        delayed = check_delayed(listed, model.modules, f"{where}: delayed")
        if delayed is not None and listed != list(delayed):
            raise UserError(f"{where}: delayed must list its module indices in increasing order")
        layout = cls(devices, delay, str(obj.get("kind", "unknown")), model, kv, ffn,
                     seed=seed if _is_int(seed) else None, score=dict(score), shared=shared,
                     shared_by=shared_by if shared else None, delayed=delayed)
        recorded = obj.get(HASH_KEY, obj.get("sha256"))
        if recorded is not None and recorded != layout.content_sha256():
            raise UserError(f"{where}: records {HASH_KEY} {recorded!r}, but its permutations hash to "
                            f"{layout.content_sha256()!r} (the file was edited)")
        return layout

    @classmethod
    def load(cls, path: str | Path, model: UnitShape | None = None) -> Layout:
        """The layout in `path`, parsed within bounds: at most `max_bytes(model)` when the model
        it must fit is known (else MAX_BYTES, then the bound of the model it names), no deeper
        nesting or larger integer than io.loads allows, no unknown key."""
        path = Path(path)
        where = f"layout {path}"
        if not os.path.lexists(path):
            raise UserError(f"layout file not found: {path}")
        # the one reader: a FIFO, a device or a file past the cap is refused, never waited on or read whole
        data = read_bytes(path, MAX_BYTES if model is None else max_bytes(model), "layout of this model", where)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{where}: not a text (JSON) file") from None
        try:
            obj = loads(text, where)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not valid JSON ({e.msg}, line {e.lineno})") from None
        return cls.from_json(obj, where=where, nbytes=len(data))

    def check_model(self, model: UnitShape, where: str = "layout", other: str = "the model") -> None:
        """Refuse a layout made for another model shape."""
        for key in UNIT_FIELDS:
            if getattr(self.model, key) != getattr(model, key):
                raise UserError(f"{where}: {key}={getattr(self.model, key)} but {other} has "
                                f"{key}={getattr(model, key)}")


def as_layout(layout: Layout | str | Path | None) -> Layout | None:
    if layout is None or isinstance(layout, Layout):
        return layout
    return Layout.load(layout)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not a count


def _device_of(perm: np.ndarray, devices: int, shared: int = 0) -> np.ndarray:
    sharded = len(perm) - shared
    dev = np.empty(len(perm), dtype=np.int64)
    dev[perm[:sharded]] = np.arange(sharded) // (sharded // devices)
    dev[perm[sharded:]] = SHARED
    return dev


def shared_last(perm: np.ndarray, shared: np.ndarray) -> np.ndarray:
    """`perm` with the units of `shared` moved to its end (in the order `shared` gives), the rest in
    the order `perm` has them."""
    keep = perm[~np.isin(perm, shared)]
    return np.concatenate([keep, np.asarray(shared, dtype=keep.dtype)])


def _check_perm(values: Any, size: int, where: str) -> np.ndarray:
    if not isinstance(values, list) or not all(_is_int(v) for v in values):
        raise UserError(f"{where}: must be a list of integers")
    if len(values) != size:
        raise UserError(f"{where}: length {len(values)}, expected {size}")
    arr = np.asarray(values, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= size):
        bad = int(arr[(arr < 0) | (arr >= size)][0])
        raise UserError(f"{where}: index {bad} out of range 0..{size - 1}")
    counts = np.bincount(arr, minlength=size)
    if (counts != 1).any():
        dup = int(np.flatnonzero(counts > 1)[0])
        missing = int(np.flatnonzero(counts == 0)[0])
        raise UserError(f"{where}: index {dup} appears {counts[dup]} times and {missing} is missing")
    return arr


def permuted_layout(path: Path) -> Layout | None:
    """The layout a permuted checkpoint was made with (its layout.json), None for any directory
    without permute's mark: the one reader of it, for its shared neurons (held last, docs/design.md
    §6) and its delayed modules alike. The mark is read as data here, bound or not: a permuted
    checkpoint copied elsewhere still holds its weights in the layout's order (ownership, which a
    copy loses, decides only what --force may remove)."""
    mark = raw_mark(Path(path))
    if mark is None or mark.get("command") != PERMUTE_COMMAND or not (Path(path) / PERMUTED_JSON).is_file():
        return None
    return Layout.load(Path(path) / PERMUTED_JSON)
