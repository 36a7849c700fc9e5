"""Applying a layout to dense weights, git-re-basin style: a permutation is data.

`permutation_spec` says which axis of which tensor moves with which unit permutation, and in
blocks of how many rows (a KV group carries its r query heads of head_dim rows each).
`layout_indices` turns a layout into one (axis, index) gather per tensor; `apply_layout` (a whole
state dict) and the streaming `dtpshard permute` (one tensor at a time) both apply those gathers,
so the dense function is unchanged either way.
"""
from __future__ import annotations

import numpy as np
import torch

from dtpshard.core.family import FAMILY, MOVED, layer_name
from dtpshard.core.layout import Layout
from dtpshard.core.shape import ModelShape


def permutation_spec(shape: ModelShape) -> dict[str, tuple[int, int, int]]:
    """tensor name -> (module m whose permutation moves it, axis, rows per unit): family.MOVED for
    each layer (a group's query heads move with it; q/k/v biases only where the model has them)."""
    rows = {"group": shape.heads_per_group * shape.head_dim, "head": shape.head_dim, "neuron": 1}
    spec: dict[str, tuple[int, int, int]] = {}
    for i in range(shape.layers):
        for key, (module, axis, unit) in MOVED.items():
            if shape.qkv_bias or not key.endswith(".bias"):
                spec[layer_name(i, key)] = (2 * i + (module == "ffn"), axis, rows[unit])
    return spec


def unit_index(perm: np.ndarray, rows: int) -> torch.Tensor:
    """Row indices that put original unit perm[p] at position p, `rows` rows per unit."""
    idx = np.asarray(perm)[:, None] * rows + np.arange(rows)[None, :]
    return torch.from_numpy(idx.reshape(-1))


def layout_indices(shape: ModelShape, layout: Layout) -> dict[str, tuple[int, torch.Tensor]]:
    """tensor name -> (axis, index): its permuted form is `tensor.index_select(axis, index)`."""
    out = {}
    for name, (m, axis, rows) in permutation_spec(shape).items():
        out[name] = (axis, unit_index(layout.perm(m), rows))
    return out


def stored_indices(shape: ModelShape, layout: Layout, fused: bool = True) -> dict[str, tuple[int, torch.Tensor]]:
    """layout_indices for the tensors as a checkpoint stores them: a fused tensor (Phi-3's
    qkv_proj, gate_up_proj; fused=False: none, a student's canonical names) is gathered along rows
    by its parts' indices, each shifted to where its part starts."""
    canonical = layout_indices(shape, layout)
    if not fused:
        return canonical
    fam, out = FAMILY[shape.family], dict(canonical)
    rows = fam.rows(shape)
    for i in range(shape.layers):
        for stored, parts in fam.fused.items():
            out[layer_name(i, stored)] = (0, torch.cat([canonical[layer_name(i, p)][1] + rows[p][1] for p in parts]))
            for p in parts:
                del out[layer_name(i, p)]
    return out


def apply_layout(state_dict: dict[str, torch.Tensor], shape: ModelShape, layout: Layout) -> dict[str, torch.Tensor]:
    """A new state dict with every layer's KV groups and neurons permuted as the layout says; the
    state dict in its family's format (fused tensors gathered whole) or the canonical one."""
    out = dict(state_dict)
    for name, (axis, index) in {**layout_indices(shape, layout), **stored_indices(shape, layout)}.items():
        if name in out:
            out[name] = out[name].index_select(axis, index.to(out[name].device))
    return out
