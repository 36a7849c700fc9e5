"""The calibration pass (`calibrate`) and `dtpshard affinity`, its command.

`calibrate` reads the model and the calibration tokens, plans where the pass keeps what (in
memory or streamed, affinity/offload.py), scores every edge (affinity/scorer.py) and writes the
affinity file; it returns what it did. The command only turns flags into its arguments and prints.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dtpshard.affinity.file import Affinity, edges_for_delay, is_affinity_file
from dtpshard.affinity.offload import HiddenStates, Plan, default_budget, plan
from dtpshard.affinity.scorer import ScoreOptions, compute_affinity
from dtpshard.affinity.settings import (  # noqa: F401 - CalibrationData, PassSettings re-exported
    CALIBRATION_DATA,
    PASS_SETTINGS,
    CalibrationData,
    PassSettings,
)
from dtpshard.core.devices import pick_device
from dtpshard.core.errors import UserError
from dtpshard.core.guard import check_outputs, check_replaceable, local_paths
from dtpshard.core.io import check_output_file, check_writable_dir
from dtpshard.core.lock import locked_output
from dtpshard.core.memory import GIB
from dtpshard.core.settings import DEFAULT
from dtpshard.core.shape import check_delay, check_seq_len
from dtpshard.data.blocks import load_texts, make_blocks
from dtpshard.model.checkpoint import check_token_ids, load_tokenizer, open_checkpoint
from dtpshard.model.dense import DenseModel, StreamedDense


@dataclass
class CalibrationResult:
    out: Path
    edges: int
    tokens: int
    seconds: float
    device: str
    data: str  # the data's one-line description
    options: dict[str, Any]
    plan: Plan = field(repr=False)

    def to_json(self, model: Path, delay: float, data: CalibrationData) -> dict[str, Any]:
        return {"out": str(self.out), "model": str(model), "delay": delay, "edges": self.edges, "tokens": self.tokens,
                "blocks": data.blocks, "seq_len": data.seq_len, "seconds": self.seconds, "device": self.device,
                "data": self.data, "options": self.options}


@dataclass
class CalibrationPlan:
    """A checked pass, before it runs: the model's files, the tokens, and where the pass keeps what."""

    model: Path
    out: Path
    ckpt: Any
    ids: torch.Tensor  # [blocks, seq_len]
    data: CalibrationData
    source: str  # the texts' one-line description
    delay: float
    run: PassSettings
    device: str
    memory: Plan

    def describe(self) -> str:
        return f"affinity pass: {self.memory.describe()}"


def plan_calibration(model: Path, out: Path, data: CalibrationData = CALIBRATION_DATA, *, delay: float = DEFAULT.delay,
                     run: PassSettings = PASS_SETTINGS) -> CalibrationPlan:
    """Read the model's headers and the calibration tokens and plan the pass; every bad input
    (model, data, δ, --out) is refused here, before any scoring."""
    check_outputs({"--out": out}, {"the model directory": model, "the tokenizer": data.tokenizer,
                                   "the calibration text": data.text, "the dataset": local_paths([data.dataset])})
    device = pick_device(run.device)
    ckpt = open_checkpoint(model)
    shape = ckpt.shape
    check_delay(shape, delay)
    if not edges_for_delay(shape.modules, delay):
        raise UserError(f"--delay {delay}: no edges (every module sees all partials below δ = 1)")
    check_output_file(Path(out))  # before the pass, not after it
    check_replaceable(Path(out), is_affinity_file, "an affinity file (dtpshard.affinity/1)")
    tok = load_tokenizer(data.tokenizer or model)
    texts = load_texts(data.text, data.dataset, role="calibration", text_field=data.text_field)
    ids = make_blocks(tok, texts, data.seq_len, data.blocks, seed=data.seed)  # [blocks, seq_len]
    check_token_ids(ids, shape.vocab, data.tokenizer or model)
    check_seq_len(ckpt.hf_config, data.seq_len)  # the text's own refusals first: they say more
    budget = int(run.memory_budget * GIB) if run.memory_budget > 0 else default_budget(device)
    how = plan(shape, ids.numel(), delay, getattr(torch, run.dtype), budget, run.offload)
    if how.hidden > how.hidden_budget:
        check_writable_dir(spill_dir(run, out) / "spill")
    return CalibrationPlan(Path(model), Path(out), ckpt, ids, data, texts.source, delay, run, device, how)


def spill_dir(run: PassSettings, out: Path) -> Path:
    return run.spill_dir if run.spill_dir is not None else Path(out).parent


def run_calibration(p: CalibrationPlan, proxy: str = "first-order", progress: bool = False) -> CalibrationResult:
    """Score every edge (a, b) that δ creates (b - δ <= a <= b - 1) under `proxy` and write the
    affinity file (dtpshard.affinity/1)."""
    opts = ScoreOptions.of(proxy)
    dtype = getattr(torch, p.run.dtype)
    t0 = time.perf_counter()
    dense = (StreamedDense(p.ckpt, dtype, p.device) if p.memory.offload
             else DenseModel.from_checkpoint(p.ckpt, dtype, p.device))
    edges = compute_affinity(dense, p.ids, p.delay, opts, micro_batch=p.run.micro_batch, chunk=p.run.chunk or None,
                             progress=progress, hidden=HiddenStates(p.memory.hidden_budget, spill_dir(p.run, p.out)))
    seconds = time.perf_counter() - t0
    d = p.data
    options = dict(opts.metadata(p.delay), blocks=d.blocks, seq_len=d.seq_len, seed=d.seed, dtype=p.run.dtype)
    Affinity(p.ckpt.shape.unit_shape(), p.delay, edges, tokens=p.ids.numel(), options=options,
             source=f"{p.source} seed={d.seed}").save(p.out)
    return CalibrationResult(p.out, len(edges), int(p.ids.numel()), seconds, str(p.device), p.source, options, p.memory)


def calibrate(model: Path, out: Path, data: CalibrationData = CALIBRATION_DATA, *, delay: float = DEFAULT.delay,
              proxy: str = "first-order", run: PassSettings = PASS_SETTINGS,
              progress: bool = False) -> CalibrationResult:
    """The whole pass: plan_calibration, then run_calibration, one writer of `out` at a time."""
    with locked_output(out):
        return run_calibration(plan_calibration(model, out, data, delay=delay, run=run), proxy, progress)
