"""A layout for a partial student (docs/design.md §1, per-module delay): which modules are delayed,
chosen by measured sensitivity, the upper ones or at random, and the layout refined for them.

The set is chosen under the full layout (every module delayed): a module's sensitivity is what
delaying it alone costs there (affinity/sensitivity.py). The optimiser then places only what the
delayed modules need: J counts only the edges whose source is delayed (a plain module's sum lands
at once, so no unit of it is ever missed), starting from the full layout, whose placement of every
other unit it keeps. The layout file records the set (`delayed`) and, in its score, how it was
chosen and every module's sensitivity.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from dtpshard.core.delayed import check_delayed, choose_delayed, delayed_count, describe, parse_spec
from dtpshard.core.errors import UserError
from dtpshard.core.layout import Layout
from dtpshard.core.settings import DTPSettings
from dtpshard.core.vocab import OPTIMISING_KINDS


def sensitivity_ids(model: Path, text: list[str] | None = None, dataset: str | None = None, *, blocks: int,
                    seq_len: int, seed: int = 0, text_field: str = "text", tokenizer: Path | None = None) -> Any:
    """The token blocks sensitivity is measured on: calibration text (--text, a dataset, else the
    offline corpus) in the calibration pass's order, checked as the pass checks its own; at most
    affinity.sensitivity.SENSITIVITY_BLOCKS of them where a pass's `blocks` are given."""
    from dtpshard.core.shape import check_seq_len
    from dtpshard.data.blocks import load_texts, make_blocks
    from dtpshard.model.checkpoint import check_token_ids, load_tokenizer, open_checkpoint

    ckpt = open_checkpoint(model)
    check_seq_len(ckpt.hf_config, seq_len)
    texts = load_texts(text, dataset, role="calibration", text_field=text_field)
    ids = make_blocks(load_tokenizer(tokenizer or model), texts, seq_len, blocks, seed=seed)
    check_token_ids(ids, ckpt.shape.vocab, tokenizer or model)
    return ids


def measure_for_layout(model: Path, layout: Layout, settings: DTPSettings, ids: Any, device: str = "cpu",
                       micro_batch: int = 4, progress: bool = False) -> dict[str, Any]:
    """Every module's sensitivity (affinity/sensitivity.py) of checkpoint `model` under `layout`, on
    calibration token ids [blocks, T]."""
    import torch

    from dtpshard.affinity.sensitivity import module_sensitivity
    from dtpshard.model.checkpoint import open_checkpoint
    from dtpshard.model.dtp import DTPModel

    ckpt = open_checkpoint(model)
    full = replace(settings, delayed=None)
    student = DTPModel.from_state_dict(ckpt.hf_config, ckpt.state_dict(torch.float32),
                                       layout=replace(layout, delayed=None), settings=full).to(device)
    return module_sensitivity(student, ids, student.settings, micro_batch, progress)


def partial_layout(layout: Layout, spec: Any, by: str = "sensitivity", *, affinity: Any = None,
                   sensitivity: dict[str, Any] | None = None, seed: int = 0, kv_search: str = "assignment",
                   max_sweeps: int = 20) -> Layout:
    """`layout` (made for every module) for the modules `spec` names (core/delayed.py), chosen
    `by` (sensitivity: `sensitivity` as measure_for_layout returns it). An optimising layout with
    its `affinity` is re-optimised over the delayed modules' edges, from itself; any other keeps
    its permutations. The score records the choice."""
    from dtpshard.layouts.optimise import optimise_layout

    M = layout.model.modules
    parsed = parse_spec(spec)
    delayed = choose_delayed(parsed, by, M, None if sensitivity is None else sensitivity["kl"], seed)
    base_kind = layout.score.get("kind", layout.kind)
    if delayed is not None and affinity is not None and base_kind in OPTIMISING_KINDS:
        out = optimise_layout(affinity, layout.devices, layout.delay, base_kind, seed=seed, kv_search=kv_search,
                              max_sweeps=max_sweeps, delayed=delayed, start=layout,
                              shared=_shared_sets(layout), shared_by=layout.shared_by)
        out.kind = layout.kind
        out.score["full_J"] = layout.score.get("J")
    else:
        out = replace(layout, delayed=delayed, score=dict(layout.score))
    out.score["delayed"] = {
        "spec": spec if isinstance(spec, (int, float)) else str(spec),
        "by": None if isinstance(parsed, tuple) else by,
        "count": delayed_count(delayed, M), "modules": M, "describe": describe(delayed, M),
        **({} if sensitivity is None else {"sensitivity": sensitivity}),
    }
    return out


def _shared_sets(layout: Layout) -> Any:
    return [layout.shared_neurons(i) for i in range(layout.layers)] if layout.shared else None


def suffix(share: float | None, by: str) -> str:
    """What a partial student's layouts add to their name in a study: -delayed50 for half the
    modules by sensitivity, -delayed50-upper by another rule (none when every module is delayed)."""
    if share is None:
        return ""
    return f"-delayed{100 * share:.4g}" + ("" if by == "sensitivity" else f"-{by}")


def prepare(delayed: str | None, delayed_by: str, *, source: Path, model: Path | None, shape: Any,
            text: list[str] | None, blocks: int, seq_len: int, seed: int) -> tuple[Path | None, Any]:
    """`dtpshard layout --delayed`'s inputs checked before any layout is made: (the checkpoint
    sensitivity is measured on, default a model directory `source`; its token blocks), both None
    where the set is listed or drawn, or every module is delayed (`delayed` None)."""
    from dtpshard.core.shape import UNIT_FIELDS
    from dtpshard.model.checkpoint import open_checkpoint
    from dtpshard.model.dense_only import dense_only

    spec = None if delayed is None else parse_spec(delayed)
    if isinstance(spec, tuple):
        check_delayed(spec, shape.modules)
    if spec is None or isinstance(spec, tuple) or delayed_by != "sensitivity":
        if model is not None:
            raise UserError("--model is read only to measure sensitivity (--delayed SHARE --delayed-by sensitivity)")
        return None, None
    model = model or (source if source.is_dir() else None)
    if model is None:
        raise UserError("--delayed-by sensitivity measures each module's delay on the model: give --model DIR "
                        "(the dense checkpoint the affinity was computed from), or --delayed-by upper|random")
    other = dense_only(open_checkpoint(model), "--model").shape  # sensitivity is the dense model's
    if any(getattr(other, k) != getattr(shape, k) for k in UNIT_FIELDS):
        raise UserError(f"--model {model}: not the model {source} was made from (its shape differs)")
    return model, sensitivity_ids(model, text, blocks=blocks, seq_len=seq_len, seed=seed)
