"""`dtpshard layout`'s work (the command: dtpshard/commands/layouts.py): a layout of any family
from a model directory or an affinity file.

Either source gives the model shape. Contiguous and random layouts need no affinity, so they
can be made from a model directory (unscored); every other family optimises the co-located
score J and needs an affinity file. With an affinity file every layout is scored.

`--shared FRACTION` (docs/design.md §6) replicates each layer's top neurons by affinity mass
(`--shared-by fo` or `dn`, from an affinity file) or neurons drawn at random (`--shared-by
random`), the same count for every kind; the layout file records which.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from dtpshard.affinity.file import Affinity, edges_for_delay
from dtpshard.core.delayed import describe as describe_delayed
from dtpshard.core.delayed import resolve_delayed_by
from dtpshard.core.errors import UserError
from dtpshard.core.guard import check_outputs, check_replaceable
from dtpshard.core.io import check_output_file
from dtpshard.core.layout import Layout, is_layout_file
from dtpshard.core.lock import one_writer
from dtpshard.core.settings import DEFAULT, DTPSettings, plain_delay
from dtpshard.core.shape import UnitShape, check_delay, check_devices, shared_count
from dtpshard.core.vocab import FIXED_KINDS, LAYOUT_KINDS, OPTIMISING_KINDS, SHARED_BY
from dtpshard.layouts.optimise import Problem, choose_shared, optimise_layout, score_record
from dtpshard.layouts.score import layout_devices


def _shape_of_model_dir(path: Path) -> UnitShape:
    from dtpshard.model.checkpoint import read_shape

    return read_shape(path)


def shared_sets(model: UnitShape, devices: int, fraction: float, by: str, affinity: Any = None,
                seed: int = 0) -> list[np.ndarray] | None:
    """Each layer's shared neurons for `--shared fraction --shared-by by` (None: none shared): the
    seed code's count (core.shape.shared_count), the top by affinity mass or drawn with `seed`."""
    if by not in SHARED_BY:
        raise UserError(f"--shared-by {by!r}: one of {', '.join(SHARED_BY)}")
    count = shared_count(model.neurons, devices, fraction)
    if count == 0:
        return None
    if by == "random":
        rng = np.random.default_rng([seed, count])  # not the layout's own stream: a random layout's perms stay its
        return [np.sort(rng.choice(model.neurons, count, replace=False)) for _ in range(model.layers)]
    if affinity is None:
        raise UserError(f"--shared-by {by} ranks neurons by affinity mass and needs an affinity file; give one, or "
                        "--shared-by random")
    return choose_shared(affinity, count, by)


def make_layout(model: UnitShape, settings: DTPSettings, kind: str, *, affinity: Any = None,
                layers: int | None = None, restarts: int = 1, seed: int = 0, kv_search: str = "assignment",
                max_sweeps: int = 20, shared: float = 0.0, shared_by: str = "fo") -> Layout:
    """A layout of any family: contiguous and random ones here (scored when an affinity is given),
    the optimising families by dtpshard.layouts.optimise (they need the affinity). A layout is
    made for the settings' L and δ (the stage-3 scale does not change which units share a device).
    `shared`: the fraction of each layer's neurons replicated, chosen as `shared_by` says (shared_sets)."""
    devices, delay = settings.devices, settings.delay
    sets = shared_sets(model, devices, shared, shared_by, affinity, seed)
    by = shared_by if sets is not None else None
    if kind in OPTIMISING_KINDS:
        if affinity is None:
            raise UserError(f"kind {kind} optimises J and needs an affinity file")
        return optimise_layout(affinity, devices, delay, kind, layers=layers, restarts=restarts, seed=seed,
                               kv_search=kv_search, max_sweeps=max_sweeps, shared=sets, shared_by=by)
    if kind not in FIXED_KINDS:
        raise UserError(f"kind {kind!r}: one of {', '.join(LAYOUT_KINDS)}")
    if layers is not None or restarts != 1:
        raise UserError(f"--layers and --restarts apply to optimised kinds, not {kind}")
    t0 = time.perf_counter()
    if kind == "contiguous":
        layout = (Layout.contiguous(model, devices, delay) if sets is None
                  else Layout.contiguous_shared(model, devices, delay, sets, by))
    else:
        layout = Layout.random(model, devices, delay, seed=seed, shared=sets, shared_by=by)
    if affinity is None:
        layout.score = {"kind": kind, "seconds": time.perf_counter() - t0}
        return layout
    problem = Problem.build(affinity, devices, delay, sets)
    layout.score = score_record(problem, layout_devices(layout), kind, time.perf_counter() - t0, [], 1, None,
                                kv_search, None)
    return layout


@one_writer
def write_layout(source: Path, out: Path, devices: int = DEFAULT.devices, delay: float = DEFAULT.delay,
                 kind: str = "optimised", layers: int | None = None, restarts: int = 1, seed: int = 0,
                 kv_search: str = "assignment", max_sweeps: int = 20, shared: float = 0.0,
                 shared_by: str = "fo", delayed: str | None = None, delayed_by: str | None = None,
                 model: Path | None = None, text: list[str] | None = None, blocks: int = 8,
                 seq_len: int = 256) -> Layout:
    """`dtpshard layout`: a layout of `kind` from a model directory (contiguous, random: unscored)
    or an affinity file (every kind, scored), checked, made and saved to `out`; returned.
    `delayed`: a partial student's layout (layouts/delayed.py), the set chosen `delayed_by`; by
    sensitivity, measured on checkpoint `model` (default: a model directory `source`) over `blocks`
    blocks of `seq_len` tokens of `text` (default the offline corpus)."""
    check_delay(None, delay)
    delay = plain_delay(delay)
    source = Path(source)
    if not source.exists():
        raise UserError(f"{source}: no such model directory or affinity file")
    delayed_by = resolve_delayed_by(delayed, delayed_by)  # a bad spec or rule, before anything is read
    check_outputs({"--out": out}, {"the source": source, "the model": model, "the text": text})
    affinity = None
    if source.is_dir():
        if kind not in FIXED_KINDS:
            raise UserError(f"--kind {kind} optimises J and needs an affinity file; {source} is a model "
                            "directory (run `dtpshard affinity` first)")
        shape = _shape_of_model_dir(source)
    else:
        affinity = Affinity.load(source, delay=delay)
        shape = affinity.model
        if not edges_for_delay(shape.modules, delay):
            raise UserError(f"--delay {delay}: no edges at δ < 1 (every module sees all partials); J is defined "
                            f"from δ = 1, and {source} scores edges up to δ = {affinity.delay}")
    count = shared_count(shape.neurons, devices, shared)  # refused before anything is made
    check_devices(shape, devices, where=str(source), shared=count)
    if count and shared_by != "random" and affinity is None:
        shared_sets(shape, devices, shared, shared_by)  # the one-line refusal, before the output is checked
    settings = DTPSettings(devices, delay, DEFAULT.stage3)
    check_delay(shape, delay)  # a layout has no stage-3 scale
    check_output_file(Path(out))  # before the (possibly long) optimisation, not after
    check_replaceable(Path(out), is_layout_file, "a layout file (dtpshard.layout/1)")
    from dtpshard.layouts.delayed import measure_for_layout, partial_layout, prepare

    model, ids = prepare(delayed, delayed_by, source=source, model=model, shape=shape, text=text, blocks=blocks,
                         seq_len=seq_len, seed=seed)
    layout = make_layout(shape, settings, kind, affinity=affinity, layers=layers, restarts=restarts,
                         seed=seed, kv_search=kv_search, max_sweeps=max_sweeps, shared=shared, shared_by=shared_by)
    if affinity is not None:
        layout.score["affinity"] = str(source)
    if delayed is not None:
        sens = None if ids is None else measure_for_layout(model, layout, settings, ids)
        layout = partial_layout(layout, delayed, delayed_by, affinity=affinity, sensitivity=sens, seed=seed,
                                kv_search=kv_search, max_sweeps=max_sweeps)
    layout.save(out)
    return layout


def describe(layout: Layout) -> str:
    """One line: the layout, its J and what it took."""
    s = layout.score
    shared = f", {layout.shared} neurons a layer shared ({layout.shared_by})" if layout.shared else ""
    if layout.delayed is not None:
        d = s.get("delayed", {})
        by = f" by {d['by']}" if d.get("by") else ""
        shared += f", {describe_delayed(layout.delayed, layout.model.modules)} delayed{by}"
    if "J" not in s:
        return (f"{layout.kind} layout, L = {layout.devices}, delay {layout.delay}{shared}: not scored "
                "(no affinity file)")
    ratio = f" ({s['ratio_to_random']:.3f}x)" if s.get("ratio_to_random") is not None else ""
    sweeps = f", {s['sweeps']} sweeps" if s.get("sweeps") else ""
    return (f"{layout.kind} layout, L = {layout.devices}, delay {layout.delay}{shared}: J = {s['J']:.6f}{ratio}, "
            f"random expectation {s['random_expectation']:.4f} ({s['n_edges']} edges), "
            f"{s['seconds']:.2f} s{sweeps}")
