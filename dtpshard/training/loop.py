"""The distillation loop: one process, or one rank of a data-parallel group (ddp.Dist), its models
replicated or sharded as its strategy says (strategy.py); the loop never asks which.

Order of work per optimizer step k (1-based): train row → eval row (every eval_every steps and at the end) →
checkpoint (every checkpoint_every steps, every checkpoint_minutes, and at the end). A checkpoint therefore
covers every metrics row written before it. A step whose loss or gradient norm is not finite stops the run
before its update: the last checkpoint stays, no final/ is written.

Global data order: step s takes training blocks [s·G, (s+1)·G), G = micro × accum × ranks; micro-batch a of rank r
is rows s·G + (a·ranks + r)·micro ... + micro. Each micro-batch's summed loss is divided by micro × accum × seq_len,
and DDP averages over ranks, so the gradient is the mean over the global batch whatever the split. Sharded, each
micro-batch's gradients are reduce-scattered as soon as its backward ends, so no rank ever holds a whole gradient.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dtpshard.core.devices import dtype_name
from dtpshard.core.errors import UserError
from dtpshard.core.io import dumps
from dtpshard.core.layout import as_layout
from dtpshard.core.memory import return_freed_memory
from dtpshard.core.owned import ID, replacing
from dtpshard.core.shape import check_seq_len, family_config
from dtpshard.data.stream import BlockStream
from dtpshard.model import adapters
from dtpshard.model.checkpoint import load_hf_config, open_checkpoint
from dtpshard.model.shards import Weights
from dtpshard.training import inputs, memory, rundir
from dtpshard.training.card import TeacherHashes, student_card
from dtpshard.training.ddp import Dist
from dtpshard.training.evaluate import eval_blocks_for, summarise
from dtpshard.training.fsdp import clean, full_norm
from dtpshard.training.precision import resolve_precision
from dtpshard.training.recipe import (
    DistillConfig,
    compared_keys,
    layout_as_run,
    lr_factor,
    resolve,
    rng_state,
    run_config,
    save_dtype,
    set_rng_state,
    train_blocks_for,
)
from dtpshard.training.recipes import DEFAULT_RECIPE, Phase, recipe_for
from dtpshard.training.settings import BEFORE_ADAPTERS
from dtpshard.training.strategy import Strategy, strategy_for
from dtpshard.training.teacher_cache import TeacherCache


def _optimizer(cfg: DistillConfig, student: torch.nn.Module):
    named = [(n, p) for n, p in student.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]  # norms: never decayed
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=1e-8,
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: lr_factor(i, cfg.steps, cfg.warmup, cfg.min_lr_ratio))
    return named, opt, sched


def accumulate(net, strategy: Strategy, teacher, batches: list[torch.Tensor], cfg: DistillConfig, device: str,
               cache: Any = None, phase: Phase | None = None) -> torch.Tensor:
    """Forward/backward of this rank's micro-batches of one step (net: recipe.Student, teacher: recipe.Teacher;
    DDP reduces after the last) -> [loss, kl, ce, stream distance] sums (float64, on the device). A teacher cache
    (`lookup(blocks)`) gives the top-k KL + tail; `phase` (default the paper's) may ask for the teacher's streams."""
    phase = Phase(cfg.delay) if phase is None else phase
    streams = phase.streams > 0
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    for a, b in enumerate(batches):
        top = None if cache is None else tuple(t.to(device, non_blocking=True) for t in cache.lookup(b))
        b = b.to(device)
        ids, tgt = b[:, :-1], b[:, 1:]
        h_t = t_streams = None
        if top is None or streams:
            with torch.no_grad(), strategy.autocast():
                h_t, t_streams = teacher(ids, streams=True) if streams else (teacher(ids), None)
        with strategy.no_sync(last=a == len(batches) - 1):
            with strategy.autocast():
                loss, kl, ce, dist = net(ids, h_t if top is None else None, tgt, cfg.ce_weight, top,
                                         streams=t_streams, logits_weight=phase.logits, streams_weight=phase.streams)
            (loss / (cfg.micro_batch * cfg.grad_accum * cfg.seq_len)).backward()
        sums += torch.stack([loss.detach(), kl, ce, dist]).double()
        del loss  # its spent graph, alive through the next forward, grows glibc's heap (SmolLM2: 0.36 GiB)
    return sums


@torch.no_grad()
def _evaluate(student, teacher, ev: torch.Tensor, cfg: DistillConfig, d: Dist, strategy: Strategy) -> dict[str, Any]:
    """Each rank scores every world-th block; the sums are added across ranks. In lockstep (sharded)
    every forward is a collective, so each rank makes as many as the busiest rank, scoring a
    repeated block it does not count when it runs out."""
    mb = cfg.eval_micro_batch or cfg.micro_batch
    mine = ev[d.rank::d.world]
    calls = math.ceil(math.ceil(ev.shape[0] / d.world) / mb) if strategy.lockstep else math.ceil(mine.shape[0] / mb)
    sums = torch.zeros(4, dtype=torch.float64)  # kl, ce, top-1 agreements, positions
    was = student.training
    student.eval()
    try:
        for c in range(calls):
            b = mine[c * mb:(c + 1) * mb]
            counted = b.shape[0] > 0
            b = (b if counted else ev[:1]).to(d.device)
            ids, tgt = b[:, :-1], b[:, 1:]
            with strategy.autocast():
                scores = student(ids, teacher(ids), tgt, 0.0, evaluate=True)
            if counted:
                sums += torch.cat([scores.cpu(), torch.tensor([tgt.numel()], dtype=torch.float64)])
    finally:
        student.train(was)
        strategy.after_eval(student)
    return summarise(d.sum(sums), True)


@dataclass
class _Run:
    """What the phases of one rank's run share: its inputs (setup), its models and optimizer
    (build), where the loop is (resume, checkpoint)."""

    cfg: DistillConfig  # resolved: what config.json records
    d: Dist
    strategy: Strategy
    dir: Path
    config: dict[str, Any]  # config.json
    plan: memory.MemoryPlan
    peaks: memory.PhasePeaks
    ckpt: Any  # the teacher's checkpoint
    layout: Any  # core.layout.Layout, or None: contiguous
    train_data: BlockStream  # [blocks, seq_len + 1], a step's window at a time
    ev: torch.Tensor  # [eval blocks, seq_len + 1]
    cache: TeacherCache | None
    hashes: TeacherHashes | None = None  # rank 0: the card's sha256 of the teacher, hashed meanwhile
    teacher: Any = None  # recipe.Teacher
    net0: Any = None  # recipe.Student; net: it as the strategy wraps it (DDP, compiled)
    net: Any = None
    named: list = field(default_factory=list)
    opt: Any = None
    sched: Any = None
    metrics: rundir.Metrics | rundir.NoMetrics = field(default_factory=rundir.NoMetrics)
    start: int = 0  # steps done before this process (a resumed run)
    wall0: float = 0.0  # training seconds before this process
    t0: float = 0.0
    saved: int = 0  # the step of the last checkpoint on disk
    last_ckpt: float = 0.0

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.micro_batch * self.cfg.grad_accum * self.d.world * self.cfg.seq_len

    def wall(self) -> float:  # training seconds, summed over resumes
        return self.wall0 + time.perf_counter() - self.t0


def train(cfg: DistillConfig, d: Dist) -> Path:
    """One rank's run, in phases: setup (inputs, run directory, models, resume), then each step's
    update, evaluation and checkpoint, then the student saved (final/) and the run marked done."""
    r = _setup(cfg, d)
    if r is None:  # already finished
        return Path(cfg.out)
    with r.peaks.phase("training"):
        if r.start == 0:
            r.metrics.append(_eval_row(r, 0))
        bar = _progress(r.cfg, d, r.start)
        r.last_ckpt, r.saved = time.perf_counter(), r.start
        for step in range(r.start, r.cfg.steps):
            row = _step(r, step)
            r.metrics.append(row)
            done = step + 1
            if done % r.cfg.eval_every == 0 or done == r.cfg.steps:
                erow = _eval_row(r, done)
                r.metrics.append(erow)
                _stop_if_diverged(done, "evaluation KL", erow["eval_kl"], r.saved)  # before its checkpoint
                bar.set_postfix_str(f"kl {row['kl']:.4f} eval_kl {erow['eval_kl']:.4f} ppl {erow['eval_ppl']:.2f}")
            else:
                bar.set_postfix_str(f"kl {row['kl']:.4f} ce {row['ce']:.3f} lr {row['lr']:.2e}")
            bar.update(1)
            _checkpoint(r, done)
        bar.close()
        r.metrics.close()
    with r.peaks.phase("saving"):
        _save_student(r)
    memory.record(r.dir / rundir.MEMORY, r.plan, r.peaks, d)
    if d.main:
        rundir.finish(r.dir, r.cfg.steps)
    d.barrier()
    return r.dir


# -- setup --------------------------------------------------------------------------------------
def _setup(cfg: DistillConfig, d: Dist) -> _Run | None:
    """The run's inputs read and checked, its directory made or resumed, its models built and
    restored: the run ready for its first step, or None when it finished already."""
    precision = resolve_precision(cfg.precision, d.device)
    hf_config, layout = load_hf_config(cfg.teacher), as_layout(cfg.layout)  # each read once, passed along
    check_seq_len(hf_config, cfg.seq_len)
    cfg = dataclasses.replace(resolve(cfg, hf_config, layout), precision=precision)
    layout = layout_as_run(layout, cfg)
    plan = memory.plan_for(cfg, d.world, d.device, hf_config=hf_config)  # config.json records what ran
    memory.refuse_unless_fits(plan)  # every rank alike, before anything is loaded
    if torch.device(d.device).type == "cpu":
        return_freed_memory()  # so that the resident set is what the tensors hold (core/memory.py)
    peaks = memory.PhasePeaks(d.device)
    strategy = strategy_for(cfg, d, precision)
    with peaks.phase("setup"):
        r = _inputs(cfg, d, strategy, plan, peaks, hf_config, layout)
        if not _open_run_dir(r):
            return None
        _build(r)
        state = strategy.restore(r.dir, r.net0, r.named, r.opt)
        if state is not None:  # before the metrics are rewound to it: a foreign checkpoint changes nothing
            rundir.check_state(strategy.checkpoint_path(r.dir), state, r.config, cfg.steps)
    _resume(r, state)
    return r


def _inputs(cfg: DistillConfig, d: Dist, strategy: Strategy, plan: memory.MemoryPlan,
            peaks: memory.PhasePeaks, hf_config: Any, layout: Any) -> _Run:
    """The teacher's checkpoint, the training and evaluation blocks, the teacher cache and the
    config.json they make, each refused (on every rank alike) before anything is written."""
    ckpt = open_checkpoint(cfg.teacher, hf_config)  # the weights' headers, once the plan fits
    tok = ckpt.tokenizer(cfg.tokenizer)
    train_data, train_src = train_blocks_for(cfg, d.world, tok, ckpt)
    ev, eval_src = eval_blocks_for(ckpt, cfg.eval_text, cfg.eval_dataset, cfg.eval_blocks, cfg.seq_len,
                                   tok, cfg.text_field, named=cfg.tokenizer)
    cache = None
    if cfg.teacher_cache is not None:
        cache = TeacherCache(cfg.teacher_cache)
        cache.check(cfg.teacher, train_data, cfg.tokenizer)  # before anything is written
    config = run_config(cfg, ckpt.shape, layout, d.world, d.device, train_data, train_src, ev, eval_src, cache)
    return _Run(cfg, d, strategy, Path(cfg.out), config, plan, peaks, ckpt, layout, train_data, ev, cache)


def _open_run_dir(r: _Run) -> bool:
    """RUN made (or its run of these settings resumed, or started over with --force) by rank 0;
    False when it finished already."""
    d, run = r.d, r.dir
    # every rank refuses alike; runs from before --fsdp (--precision) existed were not sharded (the default)
    resuming = rundir.check_run(run, r.config, compared_keys(), r.cfg.force,
                                added={"fsdp": False, "precision": r.cfg.precision, **BEFORE_ADAPTERS})
    r.config[inputs.KEY] = inputs.run_inputs(run, resuming, r.cfg.teacher, r.cfg.layout, d.main,  # trusted if checked
                                             r.cfg.tokenizer, r.ckpt.hf_config)
    d.barrier()
    if d.main:
        if not resuming:
            r.config[ID] = rundir.start_over(run)  # the run's record holds its directory's id
            rundir.write_config(run, r.config)
        rundir.clean_temporaries(run)
        clean(run)
    if resuming:  # every rank: a checkpoint is bound to this id (rundir.check_state)
        r.config[ID] = rundir.run_id(run)
    d.barrier()
    if not rundir.is_done(run):
        return True
    if d.main:
        rundir.check_finished(run)
        rundir.remove_checkpoint(run)  # in case a kill came between DONE and its removal
        print(f"{run}: already finished ({rundir.DONE} present)", file=sys.stderr)
    return False


def _build(r: _Run) -> None:
    """The teacher and the student where the strategy keeps them, and the student's optimizer."""
    if r.d.main:  # the card's sha256 of the teacher's weights, hashed while the student trains (card.py)
        r.hashes = TeacherHashes(r.cfg.teacher, r.dir, inputs.hashes(r.config[inputs.KEY] or {}))
    r.teacher, r.net0 = r.strategy.build(r.cfg, r.ckpt, r.layout)
    r.net0.model.source_path = Path(r.cfg.teacher)
    r.named, r.opt, r.sched = _optimizer(r.cfg, r.net0.model)


def _resume(r: _Run, state: dict[str, Any] | None) -> None:
    """Where the loop starts: after the checkpoint's step (its scheduler, RNG and metrics rows
    back), else at step 0; the student wrapped for training."""
    if state is not None:
        r.sched.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        r.start, r.wall0 = state["step"], state["wall"]
        if r.d.main:
            print(f"resuming {r.dir} after step {r.start} of {r.cfg.steps}", file=sys.stderr)
    r.metrics = rundir.metrics_for(r.dir, r.d.main, r.cfg.tensorboard, r.start)
    r.metrics.truncate(state["metrics_bytes"] if state is not None else 0)
    r.d.barrier()
    r.net0.model.gradient_checkpointing = r.cfg.grad_checkpointing
    r.net = r.strategy.wrap(r.net0, r.cfg, r.cfg.steps - r.start)
    r.t0 = time.perf_counter()


# -- a step, its evaluation and its checkpoint --------------------------------------------------
def _step(r: _Run, step: int) -> dict[str, Any]:
    """Optimizer step `step` (0-based) on this rank's micro-batches of the global batch; its train row."""
    cfg, d = r.cfg, r.d
    lr = r.sched.get_last_lr()[0]
    r.opt.zero_grad(set_to_none=True)
    G = cfg.micro_batch * cfg.grad_accum * d.world
    starts = [step * G + (a * d.world + d.rank) * cfg.micro_batch for a in range(cfg.grad_accum)]
    micro = r.train_data.windows(starts, cfg.micro_batch)  # this rank's micro-batches, each made when used
    phase = recipe_for(cfg.recipe).phase(step, cfg.steps, cfg.delay)
    with r.net0.model.delayed(phase.delay):
        sums = accumulate(r.net, r.strategy, r.teacher, micro, cfg, d.device, r.cache, phase)
    params = [p for _, p in r.named]
    grad_norm = full_norm(torch.nn.utils.clip_grad_norm_(params, cfg.clip if cfg.clip > 0 else math.inf))
    sums = d.sum(sums) / (G * cfg.seq_len)
    done = step + 1
    loss = float(sums[0])  # one host sync (on CUDA) for both uses
    _stop_if_diverged(done, "loss", loss, r.saved)
    _stop_if_diverged(done, "gradient norm", grad_norm, r.saved)
    r.opt.step()
    r.sched.step()
    trained = {} if cfg.recipe == DEFAULT_RECIPE else {"delay": phase.delay, "stream": float(sums[3])}
    return {"kind": "train", "step": done, "tokens": done * r.tokens_per_step, "loss": loss, "kl": float(sums[1]),
            "ce": float(sums[2]), "lr": lr, "grad_norm": grad_norm, "wall": r.wall(), **trained}


def _eval_row(r: _Run, step: int) -> dict[str, Any]:
    e = _evaluate(r.net0, r.teacher, r.ev, r.cfg, r.d, r.strategy)
    return {"kind": "eval", "step": step, "tokens": step * r.tokens_per_step, "eval_kl": e["kl"],
            "eval_ppl": e["ppl"], "eval_top1": e["top1"], "wall": r.wall()}


def _checkpoint(r: _Run, done: int) -> None:
    """A checkpoint after step `done` when one is due (every checkpoint_every steps, every
    checkpoint_minutes, and at the end): it covers every metrics row written before it."""
    cfg = r.cfg
    due = done % cfg.checkpoint_every == 0 or time.perf_counter() - r.last_ckpt > 60 * cfg.checkpoint_minutes
    if r.strategy.checkpoint_due(due) or done == cfg.steps:
        extra = {"step": done, "wall": r.wall(), "metrics_bytes": r.metrics.size(), "rng": rng_state(),
                 "scheduler": r.sched.state_dict(), "config": r.config}
        r.strategy.save(r.dir, done, r.net0, r.named, r.opt, extra)
        r.last_ckpt, r.saved = time.perf_counter(), done


def _stop_if_diverged(step: int, what: str, value: float, saved: int) -> None:
    """A non-finite loss or gradient norm ends the run before its update, a non-finite evaluation
    before its checkpoint (the weights already diverged), every rank alike (the values are
    reduced across ranks). `saved`: the step of the last checkpoint, which stays as it is."""
    if math.isfinite(value):
        return
    kept = f"the checkpoint after step {saved} is kept" if saved else "no checkpoint was written yet"
    raise UserError(f"step {step}: the {what} is {value} (the run diverged; try a lower --lr); {kept}, "
                    "no student was written")


def _progress(cfg: DistillConfig, d: Dist, start: int):
    if d.world > 1:  # tqdm's default lock is a multiprocessing semaphore, leaked when a rank is terminated
        tqdm.set_lock(threading.RLock())
    return tqdm(total=cfg.steps, initial=start, desc="distill", unit="step", dynamic_ncols=True,
                disable=not (cfg.progress and d.main))


def _save_student(r: _Run) -> None:
    """final/, atomically, written by rank 0 (the student in the model_type "dtp" format, adapters merged,
    its model card from the run's records); under --fsdp every rank gathers each tensor in turn."""
    cfg, student, dtype = r.cfg, r.net0.model, save_dtype(r.cfg, r.ckpt)
    source = Path(cfg.tokenizer or cfg.teacher)

    def write(weights: Weights) -> None:
        with replacing(r.dir / rundir.FINAL, "distill") as tmp:  # sealed: what --force may remove
            card = student_card(r.dir, {"family": family_config(student.hf_config).model_type,
                                        **student.dtp_block()}, r.hashes, dtype_name(dtype))
            student.save_pretrained(tmp, source, weights, dtype, cfg.max_shard_size, card=card)
            provenance = {k: r.config[k] for k in ("teacher", "layout", "layout_kind", "layout_sha256", "steps",
                                                    "seed", "train_data", "eval_data")}
            (tmp / "distill.json").write_text(dumps(provenance, indent=1) + "\n")

    def follow(weights: Weights) -> None:  # another rank of a sharded save: each tensor in rank 0's order
        student.save_pretrained(r.dir / rundir.FINAL, source, weights, dtype, cfg.max_shard_size, write=False)

    r.strategy.save_student(student, dtype, write, follow)
    if getattr(student, "adapters", None) is not None:  # RUN/adapters/: the adapters alone, gathered on every rank
        base = {k: r.config[k] for k in ("teacher", "layout", "layout_sha256")}
        adapters.save(r.dir / rundir.ADAPTERS, student, r.strategy.full, r.d.main, base)
