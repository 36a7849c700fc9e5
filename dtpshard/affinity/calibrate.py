"""The calibration pass (`calibrate`) and `dtpshard affinity`, its command.

`calibrate` reads the model and the calibration tokens, plans where the pass keeps what (in
memory or streamed, affinity/offload.py), scores every edge (affinity/scorer.py) and writes the
affinity file; it returns what it did. The command only turns flags into its arguments and prints.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
from cyclopts import Parameter

from dtpshard.affinity.file import Affinity, edges_for_delay, is_affinity_file
from dtpshard.affinity.offload import GiB, HiddenStates, Plan, default_budget, plan
from dtpshard.affinity.scorer import ScoreOptions, compute_affinity
from dtpshard.core.devices import pick_device
from dtpshard.core.errors import UserError
from dtpshard.core.guard import check_outputs, check_replaceable, local_paths
from dtpshard.core.io import check_output_file, check_writable_dir, dumps
from dtpshard.core.settings import DEFAULT
from dtpshard.core.shape import check_delay, check_seq_len
from dtpshard.core.vocab import AffinityDType, Count, Delay, Device, NonNegativeInt, NonNegativeNumber, Proxy, Seed
from dtpshard.data.blocks import load_texts, make_blocks
from dtpshard.model.checkpoint import check_token_ids, load_tokenizer, open_checkpoint
from dtpshard.model.dense import DenseModel, StreamedDense


@dataclass(frozen=True)
class CalibrationData:
    """What the pass scores: `blocks` blocks of `seq_len` tokens of --text files, a --dataset, or
    (neither) the built-in offline corpus, in a document order seeded by `seed`.

    Args:
        text: calibration text files or directories (.txt split at blank lines, .jsonl/.json records, .parquet)
        dataset: a save_to_disk directory, a parquet file or directory, or a hub name: fineweb-edu, wikitext-2,
            owner/name[:config]
        text_field: the column or JSON field that holds the text
        tokenizer: tokenizer directory, where MODEL has no tokenizer files
        blocks: number of calibration blocks
        seq_len: tokens per block
        seed: seed of the document order
    """

    text: list[str] | None = None
    dataset: str | None = None
    text_field: str = "text"
    tokenizer: Path | None = None  # None: the model's
    blocks: Count = 64
    seq_len: Count = 1024
    seed: Seed = 0


@dataclass(frozen=True)
class PassSettings:
    """How the pass runs; none of it changes the scores beyond float rounding.

    Args:
        micro_batch: sequences per module call (memory)
        chunk: cap on tokens per score chunk; 0 = automatic (memory)
        dtype: compute dtype of the calibration pass (sums are always accumulated in float64)
        offload: --offload reads one decoder layer at a time from the checkpoint, --no-offload holds the whole model;
            default: offload only when the model does not fit --memory-budget
        memory_budget: GiB the pass may hold (model and calibration hidden states); 0 = 0.8 x the memory available
            now (RAM, or the GPU's free memory)
        spill_dir: directory for the hidden states that do not fit the budget, in anonymous temporary files
            (default: the directory of --out)
    """

    micro_batch: Count = 4
    chunk: NonNegativeInt = 0
    device: Device = "auto"
    dtype: AffinityDType = "float32"
    offload: bool | None = None
    memory_budget: NonNegativeNumber = 0.0
    spill_dir: Path | None = None


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


def plan_calibration(model: Path, out: Path, data: CalibrationData = CalibrationData(), *, delay: float = DEFAULT.delay,
                     run: PassSettings = PassSettings()) -> CalibrationPlan:
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
    budget = int(run.memory_budget * GiB) if run.memory_budget > 0 else default_budget(device)
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


def calibrate(model: Path, out: Path, data: CalibrationData = CalibrationData(), *, delay: float = DEFAULT.delay,
              proxy: str = "first-order", run: PassSettings = PassSettings(),
              progress: bool = False) -> CalibrationResult:
    """The whole pass: plan_calibration, then run_calibration."""
    return run_calibration(plan_calibration(model, out, data, delay=delay, run=run), proxy, progress)


def affinity_cmd(model: Path, *, out: Path, data: Annotated[CalibrationData, Parameter(name="*")] = CalibrationData(),
                 delay: Delay = DEFAULT.delay, proxy: Proxy = "first-order",
                 run: Annotated[PassSettings, Parameter(name="*")] = PassSettings(), progress: bool = True,
                 json: bool = False) -> int:
    """Score how much every unit depends on every co-located unit (docs/design.md §2), in one pass.

    Calibration text (--text files, or --dataset, or by default the built-in offline corpus) is
    tokenised and packed into --blocks blocks of --seq-len tokens; the dense model runs over them
    once, layer by layer, and every edge (a, b) that delay δ creates gets a score matrix
    [units(a), units(b)], the mean over tokens accumulated in float64. The default proxy is the
    paper's: the up edge is first order through SwiGLU per query head, summed per KV group, with ρ
    held at its dense value; the down edge is the additive q/k/v score.

    A model that does not fit --memory-budget is streamed: one decoder layer at a time is read
    from the checkpoint, all calibration tokens go through it, its edges are accumulated and it is
    dropped (the scores are the same as in memory); calibration hidden states beyond what is left
    of the budget are kept in temporary files.

    Args:
        model: Hugging Face checkpoint directory (llama, mistral, qwen2 or qwen3 family)
        out: affinity file to write (required; safetensors, format dtpshard.affinity/1)
        delay: DTP delay δ; every edge b-δ <= a <= b-1 is scored (δ >= 2 adds attention->attention, FFN->FFN, ...)
        proxy: the score: first-order (the paper's), group-unit (a KV group's heads summed before squaring),
            exact-jacobian (ρ moves with the contribution), ablation (the contribution actually removed, norm and
            unit recomputed)
        progress: show a progress bar
        json: print one JSON object {out, edges, tokens, seconds, ...} on stdout
    """
    pass_ = plan_calibration(model, out, data, delay=delay, run=run)
    print(pass_.describe(), file=sys.stderr)
    result = run_calibration(pass_, proxy, progress)
    print(f"wrote {out}: {result.edges} edges, {result.tokens} tokens ({data.blocks} x {data.seq_len}), "
          f"{result.seconds:.1f} s on {result.device}", file=sys.stderr)
    if json:
        print(dumps(result.to_json(model, delay, data)))
    return 0
