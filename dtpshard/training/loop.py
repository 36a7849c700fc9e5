"""The distillation loop: one process, or one rank of a data-parallel group (ddp.Dist), its models
replicated or sharded as its strategy says (strategy.py); the loop never asks which.

Order of work per optimizer step k (1-based): train row → eval row (every eval_every steps and
at the end) → checkpoint (every checkpoint_every steps, every checkpoint_minutes, and at the
end). A checkpoint therefore covers every metrics row written before it. A step whose loss or
gradient norm is not finite stops the run before its update: the last checkpoint stays, no
final/ is written.

Global data order: step s takes training blocks [s·G, (s+1)·G), G = micro × accum × ranks;
micro-batch a of rank r is rows s·G + (a·ranks + r)·micro ... + micro. Each micro-batch's summed
loss is divided by micro × accum × seq_len, and DDP averages over ranks, so the gradient is the
mean over the global batch whatever the split. Sharded, each micro-batch's gradients are
reduce-scattered as soon as its backward ends, so no rank ever holds a whole gradient.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dtpshard.core.errors import UserError
from dtpshard.core.io import atomic_dir, atomic_write_text, dumps
from dtpshard.core.layout import as_layout
from dtpshard.core.memory import return_freed_memory
from dtpshard.core.shape import family_config, shape_from_hf_config
from dtpshard.model.checkpoint import load_hf_config, open_checkpoint
from dtpshard.model.shards import parse_size
from dtpshard.training import memory, rundir
from dtpshard.training.card import TeacherHashes, student_card
from dtpshard.training.ddp import Dist
from dtpshard.training.evaluate import eval_blocks_for, summarise
from dtpshard.training.fsdp import clean, full_norm
from dtpshard.training.precision import resolve_precision
from dtpshard.training.recipe import (
    DistillConfig,
    compared_keys,
    lr_factor,
    resolve,
    rng_state,
    run_config,
    save_dtype,
    set_rng_state,
    train_blocks_for,
)
from dtpshard.training.strategy import Replicated, strategy_for
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


def accumulate(net, strategy: Replicated, teacher, batches: list[torch.Tensor], cfg: DistillConfig, device: str,
               cache: Any = None) -> torch.Tensor:
    """Forward/backward of this rank's micro-batches [micro, seq_len + 1] of one optimizer step
    (net: a recipe.Student, teacher: a recipe.Teacher; gradients accumulate, DDP reduces after
    the last one). Returns [loss, kl, ce] sums (float64, on the device: no host sync per
    micro-batch). With a teacher cache (anything with `lookup(blocks)`, teacher_cache.TeacherCache)
    the teacher is not run: the loss is the top-k KL + tail."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for a, b in enumerate(batches):
        top = None if cache is None else tuple(t.to(device, non_blocking=True) for t in cache.lookup(b))
        b = b.to(device)
        ids, tgt = b[:, :-1], b[:, 1:]
        h_t = None
        if top is None:
            with torch.no_grad(), strategy.autocast():
                h_t = teacher(ids)
        with strategy.no_sync(last=a == len(batches) - 1):
            with strategy.autocast():
                loss, kl, ce = net(ids, h_t, tgt, cfg.ce_weight, top)
            (loss / (cfg.micro_batch * cfg.grad_accum * cfg.seq_len)).backward()
        sums += torch.stack([loss.detach(), kl, ce]).double()
    return sums


@torch.no_grad()
def _evaluate(student, teacher, ev: torch.Tensor, cfg: DistillConfig, d: Dist, strategy: Replicated) -> dict[str, Any]:
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


def plan_for(cfg: DistillConfig, world: int, device: str, local: int | None = None,
             hf_config: Any = None) -> memory.MemoryPlan:
    """The memory plan of this run per process, from config.json alone (cfg resolved; `ckpt`: the
    teacher when it is open already); `local` processes share this machine's RAM (default:
    torchrun's LOCAL_WORLD_SIZE)."""
    hf_config = load_hf_config(cfg.teacher) if hf_config is None else hf_config
    precision = resolve_precision(cfg.precision, device)
    setup = memory.Setup(world, cfg.fsdp and world > 1, precision, cfg.grad_checkpointing, cfg.micro_batch,
                         cfg.seq_len, torch.device(device).type)
    given = None if cfg.plan_memory is None else parse_size(cfg.plan_memory, "--plan-memory")
    return memory.plan_memory(shape_from_hf_config(hf_config), hf_config, setup, settings=cfg.dtp,
                              available=memory.available_bytes(device, local or memory.local_ranks(), given),
                              runtime=memory.process_bytes(device))


def train(cfg: DistillConfig, d: Dist) -> Path:
    precision = resolve_precision(cfg.precision, d.device)
    hf_config, layout = load_hf_config(cfg.teacher), as_layout(cfg.layout)  # each read once, passed along
    cfg = dataclasses.replace(resolve(cfg, shape_from_hf_config(hf_config), layout), precision=precision)
    run = Path(cfg.out)  # config.json records what ran
    plan = plan_for(cfg, d.world, d.device, hf_config=hf_config)
    memory.refuse_unless_fits(plan)  # every rank alike, before anything is loaded
    if torch.device(d.device).type == "cpu":
        return_freed_memory()  # so that the resident set is what the tensors hold (core/memory.py)
    peaks = memory.PhasePeaks(d.device)
    strategy = strategy_for(cfg, d, precision)
    with peaks.phase("setup"):
        ckpt = open_checkpoint(cfg.teacher, hf_config)  # the weights' headers, once the plan fits
        tok = ckpt.tokenizer(cfg.tokenizer)
        train_data, train_src = train_blocks_for(cfg, d.world, tok, ckpt)
        ev, eval_src = eval_blocks_for(ckpt, cfg.eval_text, cfg.eval_dataset, cfg.eval_blocks, cfg.seq_len,
                                       tok, cfg.text_field)
        cache = None
        if cfg.teacher_cache is not None:
            cache = TeacherCache(cfg.teacher_cache)
            cache.check(cfg.teacher, train_data, cfg.tokenizer)  # before anything is written
        config = run_config(cfg, ckpt.shape, layout, d.world, d.device, train_data, train_src, ev, eval_src, cache)
        # every rank refuses alike; runs from before --fsdp (--precision) existed were not sharded (the default)
        resuming = rundir.check_run(run, config, compared_keys(), cfg.force,
                                    added={"fsdp": False, "precision": precision})
        d.barrier()
        if d.main:
            if not resuming:
                rundir.start_over(run)
                rundir.write_config(run, config)
            rundir.clean_temporaries(run)
            clean(run)
        d.barrier()
        if rundir.is_done(run):
            if d.main:
                rundir.remove_checkpoint(run)  # in case a kill came between DONE and its removal
                print(f"{run}: already finished ({rundir.DONE} present)", file=sys.stderr)
            return run
        # the card's sha256 of the teacher's weights, hashed while the student trains (card.py)
        hashes = TeacherHashes(cfg.teacher, run) if d.main else None
        teacher, net0 = strategy.build(cfg, ckpt, layout)
        student = net0.model
        student.source_path = Path(cfg.teacher)
        named, opt, sched = _optimizer(cfg, student)
        state = strategy.restore(run, net0, named, opt)
    start, wall0 = 0, 0.0
    if state is not None:
        sched.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        start, wall0 = state["step"], state["wall"]
        if d.main:
            print(f"resuming {run} after step {start} of {cfg.steps}", file=sys.stderr)
    metrics = rundir.Metrics(run, cfg.tensorboard if d.main else None, start)
    if d.main:
        metrics.truncate(state["metrics_bytes"] if state is not None else 0)
    d.barrier()

    student.gradient_checkpointing = cfg.grad_checkpointing
    net = strategy.wrap(net0, cfg, cfg.steps - start)
    t0 = time.perf_counter()
    wall = lambda: wall0 + time.perf_counter() - t0  # noqa: E731 - training seconds, summed over resumes
    G, T = cfg.micro_batch * cfg.grad_accum * d.world, cfg.seq_len

    def eval_row(step: int) -> dict[str, Any]:
        r = _evaluate(net0, teacher, ev, cfg, d, strategy)
        return {"kind": "eval", "step": step, "tokens": step * G * T, "eval_kl": r["kl"], "eval_ppl": r["ppl"],
                "eval_top1": r["top1"], "wall": wall()}

    with peaks.phase("training"):
        if start == 0:
            row = eval_row(0)
            if d.main:
                metrics.append(row)
        bar = _progress(cfg, d, start)
        last_ckpt, saved = time.perf_counter(), start  # saved: the step of the last checkpoint on disk
        for step in range(start, cfg.steps):
            lr = sched.get_last_lr()[0]
            opt.zero_grad(set_to_none=True)
            rows = [step * G + (a * d.world + d.rank) * cfg.micro_batch for a in range(cfg.grad_accum)]
            sums = accumulate(net, strategy, teacher, [train_data[r:r + cfg.micro_batch] for r in rows], cfg,
                              d.device, cache)
            params = [p for _, p in named]
            grad_norm = full_norm(torch.nn.utils.clip_grad_norm_(params, cfg.clip if cfg.clip > 0 else math.inf))
            sums = d.sum(sums) / (G * T)
            done = step + 1
            loss = float(sums[0])  # one host sync (on CUDA) for both uses
            _stop_if_diverged(done, "loss", loss, saved)
            _stop_if_diverged(done, "gradient norm", grad_norm, saved)
            opt.step()
            sched.step()
            row = {"kind": "train", "step": done, "tokens": done * G * T, "loss": loss,
                   "kl": float(sums[1]), "ce": float(sums[2]), "lr": lr, "grad_norm": grad_norm, "wall": wall()}
            if d.main:
                metrics.append(row)
            if done % cfg.eval_every == 0 or done == cfg.steps:
                erow = eval_row(done)
                if d.main:
                    metrics.append(erow)
                _stop_if_diverged(done, "evaluation KL", erow["eval_kl"], saved)  # before its checkpoint
                bar.set_postfix_str(f"kl {row['kl']:.4f} eval_kl {erow['eval_kl']:.4f} ppl {erow['eval_ppl']:.2f}")
            else:
                bar.set_postfix_str(f"kl {row['kl']:.4f} ce {row['ce']:.3f} lr {lr:.2e}")
            bar.update(1)
            due = done % cfg.checkpoint_every == 0 or time.perf_counter() - last_ckpt > 60 * cfg.checkpoint_minutes
            if strategy.checkpoint_due(due) or done == cfg.steps:
                extra = {"step": done, "wall": wall(), "metrics_bytes": metrics.size(), "rng": rng_state(),
                         "scheduler": sched.state_dict(), "config": config}
                strategy.save(run, done, net0, named, opt, extra)
                last_ckpt, saved = time.perf_counter(), done
        bar.close()
        metrics.close()
    with peaks.phase("saving"):
        _save_student(run, student, strategy, cfg, config, save_dtype(cfg, ckpt), hashes)
    _record_memory(run, plan, peaks, d)
    if d.main:
        _mark_done(run, cfg)
    d.barrier()
    return run


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


def _save_student(run: Path, student: torch.nn.Module, strategy: Replicated, cfg: DistillConfig,
                  config: dict[str, Any], dtype: torch.dtype, hashes: TeacherHashes | None = None) -> None:
    """final/, atomically, written by rank 0 (the student in the model_type "dtp" format, its model
    card from the run's records); under --fsdp every rank gathers each tensor in turn."""
    weights = strategy.weights(student, dtype)
    source = Path(cfg.tokenizer or cfg.teacher)
    if not strategy.d.main:
        student.save_pretrained(Path("."), source, weights, dtype, cfg.max_shard_size, write=False)
        return
    with atomic_dir(run / rundir.FINAL, force=True) as tmp:
        card = student_card(run, {"family": family_config(student.hf_config).model_type, **student.dtp_block()},
                            hashes)
        student.save_pretrained(tmp, source, weights, dtype, cfg.max_shard_size, card=card)
        provenance = {k: config[k] for k in ("teacher", "layout", "layout_kind", "layout_sha256", "steps", "seed",
                                              "train_data", "eval_data")}
        (tmp / "distill.json").write_text(dumps(provenance, indent=1) + "\n")


def _record_memory(run: Path, plan: memory.MemoryPlan, peaks: memory.PhasePeaks, d: Dist) -> None:
    """RUN/memory.json: the plan per process and every rank's measured peak per phase."""
    phases = ("setup", "training", "saving")
    mine = torch.tensor([float(peaks.peaks.get(p, -1)) for p in phases], dtype=torch.float64)
    every = torch.zeros(d.world, len(phases), dtype=torch.float64)
    every[d.rank] = mine
    every = d.sum(every)  # each rank fills its own row
    if not d.main:
        return
    measured = {p: [None if v < 0 else int(v) for v in every[:, i].tolist()] for i, p in enumerate(phases)}
    peak = max((v for vals in measured.values() for v in vals if v is not None), default=None)
    record = {"plan": plan.to_json(), "measured": measured, "unit": "bytes",
              "how": "peak resident set per phase (VmHWM)" if plan.setup.device_type == "cpu"
              else "peak allocated by torch per phase, plus the CUDA runtime",
              "measured_over_planned": None if peak is None else peak / plan.total}
    atomic_write_text(run / rundir.MEMORY, dumps(record, indent=1) + "\n")


def _mark_done(run: Path, cfg: DistillConfig) -> None:
    """DONE, then drop the checkpoint: a kill anywhere here is resumable."""
    rows = rundir.read_metrics(run)
    last_eval = next((r for r in reversed(rows) if r["kind"] == "eval"), {})
    rundir.mark_done(run, {"steps": cfg.steps, "eval_kl": last_eval.get("eval_kl"),
                           "eval_ppl": last_eval.get("eval_ppl")})
    rundir.remove_checkpoint(run)
