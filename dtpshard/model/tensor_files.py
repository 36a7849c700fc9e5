"""A checkpoint's safetensors, read as Hugging Face reads them: which file holds each tensor (the
index and its shards, else model.safetensors), every header checked at once, tensors or some of
their rows and columns read on demand and refused by name when not finite."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError

from dtpshard.core.errors import UserError, first_line, naming
from dtpshard.core.family import FAMILY
from dtpshard.core.io import SMALL_JSON, open_safetensors, read_json
from dtpshard.core.shape import ModelShape
from dtpshard.model.shards import INDEX
from dtpshard.model.weights import check_dtypes, check_names

SINGLE = "model.safetensors"


class TensorFiles:
    """Name -> safetensors file of a checkpoint, found as Hugging Face finds it: the index and the
    shards it names, else model.safetensors. Any other *.safetensors in the directory (an affinity
    file saved next to the model, say) is not a weight file and is ignored."""

    def __init__(self, path: Path):
        self.index: Path | None = path / INDEX
        if os.path.lexists(self.index):  # a FIFO or a device: refused by name as it is read
            index = read_json(self.index, "safetensors index", 4 * SMALL_JSON)  # ~100 KB for a 405B model
            try:
                weight_map = index["weight_map"]
                self.where = {str(k): path / str(v) for k, v in weight_map.items()}
            except (KeyError, TypeError, AttributeError):  # the shape of the object
                raise UserError(f"{self.index}: not a safetensors index (a JSON object with a weight_map)") from None
            outside = sorted({str(v) for v in weight_map.values() if Path(str(v)).name != str(v) or str(v) == ".."})
            if outside:  # Hugging Face reads shards from the checkpoint directory itself
                raise UserError(f"{self.index}: weight file {outside[0]!r} is not a file of {path}")
            if os.path.lexists(path / SINGLE):  # transformers reads the single file first, we the index
                raise UserError(f"{path}: holds both {SINGLE} and {INDEX}, which transformers and dtpshard would "
                                "read differently; remove the one that is not the model")
        elif os.path.lexists(path / SINGLE):
            self.index = None
            self.where = {k: path / SINGLE for k in tensor_names(path / SINGLE)}
        else:
            others = sorted(p.name for p in path.glob("*.safetensors"))
            why = (f"{', '.join(others)} {'is' if len(others) == 1 else 'are'} not model weights" if others
                   else "convert .bin checkpoints with transformers first")
            raise UserError(f"{path}: no {SINGLE} or {INDEX} ({why})")
        missing = sorted({str(f.name) for f in self.where.values() if not os.path.lexists(f)})
        if missing:
            raise UserError(f"{path}: missing weight file {missing[0]}")
        self.alias = check_names(self.where, canonical)  # two stored names of one parameter: refused
        self.shapes: dict[str, list[int]] = {}  # every header read now: a damaged file is refused before any work
        self.dtypes: dict[str, str] = {}  # safetensors' names: F32, BF16, ...
        for f in self.files:
            with naming(f), open_safetensors(f) as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    self.shapes[k], self.dtypes[k] = list(sl.get_shape()), sl.get_dtype()
        absent = [k for k in self.where if k not in self.shapes]
        if absent:
            raise UserError(f"{self.where[absent[0]]}: has no tensor {absent[0]!r} (named in {INDEX})")
        check_dtypes(self.dtypes, self.where)  # weights are numbers: no integer, bool or unscaled float8 tensor
        self.parts: dict[str, tuple[str, int, int]] = {}  # canonical name -> (stored name, first row, end row)

    def unfuse(self, shape: ModelShape) -> None:
        """Read the family's fused tensors (Phi-3's qkv_proj, gate_up_proj) as their canonical parts
        (core/family.py): `keys`, `shape`, `get` and `get_units` then speak of q/k/v and gate/up."""
        for part, (stored, a, b) in FAMILY[shape.family].rows(shape).items():
            for i in range(shape.layers):
                if stored in FAMILY[shape.family].fused and f"model.layers.{i}.{stored}" in self.alias:
                    self.parts[f"model.layers.{i}.{part}"] = (f"model.layers.{i}.{stored}", a, b)

    @property
    def files(self) -> list[Path]:
        """The weight files, each once, in the order the index first names them."""
        return list(dict.fromkeys(self.where.values()))

    def stored_dtype(self) -> torch.dtype | None:
        """The dtype the weights are stored in (of the first floating tensor), from the headers."""
        names = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
        return next((names[d] for d in self.dtypes.values() if d in names), None)

    def keys(self) -> list[str]:
        """The canonical names (a fused tensor's parts in its place), in the files' order."""
        fused: dict[str, list[str]] = {}
        for part, (stored, _, _) in self.parts.items():
            fused.setdefault(stored, []).append(part)
        return [k for name in self.alias for k in fused.get(name, [name])]

    def stored_keys(self) -> list[str]:
        """The names as the files hold them ("model." prefixed)."""
        return list(self.alias)

    def dtype(self, name: str) -> str:
        return self.dtypes[self.alias[self.parts[name][0] if name in self.parts else name]]

    def shape(self, name: str) -> list[int]:
        if name in self.parts:
            stored, a, b = self.parts[name]
            return [b - a, *self.shapes[self.alias[stored]][1:]]
        return self.shapes[self.alias[name]]

    def get_units(self, name: str, idx: np.ndarray, axis: int) -> torch.Tensor:
        """Rows (axis 0) or columns (axis 1) `idx` of tensor `name`, read run by run from the file
        (a run of consecutive indices is one slice), so only those are read."""
        if name in self.parts:  # a part of a fused tensor: its rows, shifted to where it starts
            name, a, _ = self.parts[name]
            idx = np.asarray(idx) + (a if axis == 0 else 0)
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        runs = [slice(int(r[0]), int(r[-1]) + 1) for r in np.split(idx, breaks)]
        key = self.alias[name]
        with naming(self.where[key]), open_safetensors(self.where[key]) as st:
            sl = st.get_slice(key)
            return _finite(torch.cat([sl[r] if axis == 0 else sl[:, r] for r in runs], axis), key, self.where[key])

    def get(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor `name` (canonical HF name), or only its `rows` (a slice of dim 0: the streamed
        calibration reads the embedding in blocks without holding all of it)."""
        if name in self.parts:  # a part of a fused tensor: its rows of the stored one
            name, a, b = self.parts[name]
            rows = slice(a, b) if rows is None else slice(a + (rows.start or 0), a + min(rows.stop or b - a, b - a))
        key = self.alias[name]
        try:
            with open_safetensors(self.where[key]) as st:
                t = st.get_tensor(key) if rows is None else st.get_slice(key)[rows]
        except SafetensorError as e:
            raise UserError(f"{self.where[key]}: cannot read tensor {key} ({first_line(e)})") from None
        return _finite(t, key, self.where[key])


def _finite(t: torch.Tensor, name: str, file: Path) -> torch.Tensor:
    """`t` as read, refused in one line naming it when it holds a NaN or an infinity (a diverged
    or damaged checkpoint would otherwise give NaN logits and a plausible-looking exit 0). One
    pass over each tensor as it is read, no second read of the files."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = "NaN" if bool(torch.isnan(t).any()) else "infinite"
        raise UserError(f"{file}: tensor {name} holds {bad} values (a diverged or damaged checkpoint)")
    return t


def tensor_names(file: Path) -> list[str]:
    """The tensors a safetensors file holds (its header only); a damaged file is one line."""
    try:
        with open_safetensors(file) as st:
            return list(st.keys())
    except SafetensorError as e:
        raise UserError(f"{file}: not a readable safetensors file ({first_line(e)})") from None


def canonical(key: str) -> str:
    """The Hugging Face name of a stored tensor name (some checkpoints drop the "model." prefix)."""
    if key.startswith(("model.", "lm_head.")):
        return key
    return "model." + key
