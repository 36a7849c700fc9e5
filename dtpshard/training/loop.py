"""The distillation loop: one process, or one rank of a data-parallel group (ddp.Dist), its
model replicated (DDP) or sharded (--fsdp, fsdp.py).

Order of work per optimizer step k (1-based): train row → eval row (every eval_every steps and
at the end) → checkpoint (every checkpoint_every steps, every checkpoint_minutes, and at the
end). A checkpoint therefore covers every metrics row written before it.

Global data order: step s takes training blocks [s·G, (s+1)·G), G = micro × accum × ranks;
micro-batch a of rank r is rows s·G + (a·ranks + r)·micro ... + micro. Each micro-batch's summed
loss is divided by micro × accum × seq_len, and DDP averages over ranks, so the gradient is the
mean over the global batch whatever the split. Sharded, each micro-batch's gradients are
reduce-scattered as soon as its backward ends, so no rank ever holds a whole gradient.
"""
from __future__ import annotations

import json
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from dtpshard.training import fsdp, rundir
from dtpshard.training.recipe import (DistillConfig, build_models, compared_keys, lr_factor, resolve, rng_state,
                                      run_config, set_rng_state, train_blocks_for)
from dtpshard.training.ddp import Dist
from dtpshard.core.errors import UserError
from dtpshard.training.evaluate import autocast_for, eval_blocks_for, summarise


def _optimizer(cfg: DistillConfig, student: torch.nn.Module):
    named = [(n, p) for n, p in student.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]  # norms: never decayed
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=1e-8,
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: lr_factor(i, cfg.steps, cfg.warmup, cfg.min_lr_ratio))
    return named, opt, sched


def accumulate(net, ddp, teacher, batches: list[torch.Tensor], cfg: DistillConfig, device: str,
               cache: Any = None) -> torch.Tensor:
    """Forward/backward of this rank's micro-batches [micro, seq_len + 1] of one optimizer step
    (net: a distill.Student, teacher: a distill.Teacher; gradients accumulate, DDP reduces after
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
            with torch.no_grad(), autocast_for(device, cfg.autocast):
                h_t = teacher(ids)
        sync = ddp.no_sync() if ddp is not None and a < len(batches) - 1 else nullcontext()
        with sync:
            with autocast_for(device, cfg.autocast):
                loss, kl, ce = net(ids, h_t, tgt, cfg.ce_weight, top)
            (loss / (cfg.micro_batch * cfg.grad_accum * cfg.seq_len)).backward()
        sums += torch.stack([loss.detach(), kl, ce]).double()
    return sums


@torch.no_grad()
def _evaluate(student, teacher, ev: torch.Tensor, cfg: DistillConfig, d: Dist, lockstep: bool) -> dict[str, Any]:
    """Each rank scores every world-th block; the sums are added across ranks. lockstep (sharded):
    every forward is a collective, so each rank makes as many as the busiest rank, scoring a
    repeated block it does not count when it runs out."""
    mb = cfg.eval_micro_batch or cfg.micro_batch
    mine = ev[d.rank::d.world]
    calls = math.ceil(math.ceil(ev.shape[0] / d.world) / mb) if lockstep else math.ceil(mine.shape[0] / mb)
    sums = torch.zeros(3, dtype=torch.float64)
    was = student.training
    student.eval()
    try:
        for c in range(calls):
            b = mine[c * mb:(c + 1) * mb]
            counted = b.shape[0] > 0
            b = (b if counted else ev[:1]).to(d.device)
            ids, tgt = b[:, :-1], b[:, 1:]
            with autocast_for(d.device, cfg.autocast):
                _, kl, ce = student(ids, teacher(ids), tgt, 0.0)
            if counted:
                sums += torch.tensor([kl.item(), ce.item(), tgt.numel()], dtype=torch.float64)
    finally:
        student.train(was)
        if lockstep:  # FSDP keeps a root's weights gathered after forward (for the backward, none here):
            student.reshard()  # free them, and give named_parameters() the sharded ones back
    return summarise(d.sum(sums), True)


def train(cfg: DistillConfig, d: Dist) -> Path:
    from dtpshard.model.checkpoint import load_tokenizer

    cfg = resolve(cfg)
    run = Path(cfg.out)
    sharded = cfg.fsdp and d.world > 1  # one process holds everything whatever the flag
    if sharded:
        mesh = fsdp.mesh_for(d.device, d.world)
        teacher, net0, layout = build_models(cfg, d.device, lambda net, frozen: fsdp.shard(net, mesh, frozen))
    else:
        teacher, net0, layout = build_models(cfg, d.device)
    student = net0.model
    tok = load_tokenizer(cfg.tokenizer or cfg.teacher)
    train_data, train_src = train_blocks_for(cfg, d.world, tok)
    ev, eval_src = eval_blocks_for(cfg.teacher, cfg.eval_text, cfg.eval_dataset, cfg.eval_blocks, cfg.seq_len, tok,
                                   cfg.text_field)
    cache = None
    if cfg.teacher_cache is not None:
        from dtpshard.training.teacher_cache import TeacherCache

        cache = TeacherCache(cfg.teacher_cache)
        cache.check(cfg.teacher, train_data, cfg.tokenizer)  # before anything is written
    config = run_config(cfg, student.shape, layout, d.world, d.device, train_data, train_src, ev, eval_src, cache)
    # every rank refuses alike; runs from before --fsdp existed were not sharded
    resuming = rundir.check_run(run, config, compared_keys(), cfg.force, added={"fsdp": False})
    d.barrier()
    if d.main:
        if not resuming:
            rundir.start_over(run)
            rundir.write_config(run, config)
        rundir.clean_temporaries(run)
        fsdp.clean(run)
    d.barrier()
    if rundir.is_done(run):
        if d.main:
            rundir.remove_checkpoint(run)  # in case a kill came between DONE and its removal
            print(f"{run}: already finished ({rundir.DONE} present)", file=sys.stderr)
        return run

    named, opt, sched = _optimizer(cfg, student)
    if sharded:
        state = fsdp.load(run, net0, opt)  # the shards in place; `state` holds the rest
    else:
        state = rundir.load_checkpoint(run)
        if state is not None:
            missing = [n for n, _ in named if n not in state["student"]]
            if missing:
                raise UserError(f"{run / rundir.CHECKPOINT}: has no tensor {missing[0]!r}; use --force to start over")
            with torch.no_grad():
                for n, p in named:
                    p.copy_(state["student"][n])
            opt.load_state_dict(state["optimizer"])
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
    net: torch.nn.Module = net0
    ddp = None
    if d.world > 1 and not sharded:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = ddp = DDP(net0, device_ids=[d.local_rank] if d.device.startswith("cuda") else None)
    from dtpshard.model.compiled import compile_module, want_compile

    if not sharded and want_compile(cfg.compile, d.device, cfg.steps - start):
        net = compile_module(net)
    t0 = time.perf_counter()
    wall = lambda: wall0 + time.perf_counter() - t0  # noqa: E731 - training seconds, summed over resumes
    G, T = cfg.micro_batch * cfg.grad_accum * d.world, cfg.seq_len

    def eval_row(step: int) -> dict[str, Any]:
        r = _evaluate(net0, teacher, ev, cfg, d, sharded)
        return {"kind": "eval", "step": step, "tokens": step * G * T, "eval_kl": r["kl"], "eval_ppl": r["ppl"],
                "wall": wall()}

    if start == 0:
        row = eval_row(0)
        if d.main:
            metrics.append(row)
    bar = _progress(cfg, d, start)
    last_ckpt = time.perf_counter()
    for step in range(start, cfg.steps):
        lr = sched.get_last_lr()[0]
        opt.zero_grad(set_to_none=True)
        rows = [step * G + (a * d.world + d.rank) * cfg.micro_batch for a in range(cfg.grad_accum)]
        sums = accumulate(net, ddp, teacher, [train_data[r:r + cfg.micro_batch] for r in rows], cfg, d.device,
                          cache)
        params = [p for _, p in named]
        grad_norm = fsdp.full_norm(torch.nn.utils.clip_grad_norm_(params, cfg.clip if cfg.clip > 0 else math.inf))
        opt.step()
        sched.step()
        sums = d.sum(sums) / (G * T)
        done = step + 1
        row = {"kind": "train", "step": done, "tokens": done * G * T, "loss": float(sums[0]), "kl": float(sums[1]),
               "ce": float(sums[2]), "lr": lr, "grad_norm": grad_norm, "wall": wall()}
        if d.main:
            metrics.append(row)
        if done % cfg.eval_every == 0 or done == cfg.steps:
            erow = eval_row(done)
            if d.main:
                metrics.append(erow)
            bar.set_postfix_str(f"kl {row['kl']:.4f} eval_kl {erow['eval_kl']:.4f} ppl {erow['eval_ppl']:.2f}")
        else:
            bar.set_postfix_str(f"kl {row['kl']:.4f} ce {row['ce']:.3f} lr {lr:.2e}")
        bar.update(1)
        due = done % cfg.checkpoint_every == 0 or time.perf_counter() - last_ckpt > 60 * cfg.checkpoint_minutes
        if sharded:  # saving is collective: rank 0's clock decides for all
            due = bool(d.sum(torch.tensor([float(due and d.main)]))[0] > 0)
        if due or done == cfg.steps:
            extra = {"step": done, "wall": wall(), "metrics_bytes": metrics.size(), "rng": rng_state(),
                     "scheduler": sched.state_dict(), "config": config}
            if sharded:
                fsdp.save(run, done, net0, opt, extra, d.main, d.barrier)
            elif d.main:
                extra.update({"student": {n: p.detach() for n, p in named}, "optimizer": opt.state_dict()})
                rundir.save_checkpoint(run, extra)
            last_ckpt = time.perf_counter()
    bar.close()
    metrics.close()
    full = fsdp.gather(net0) if sharded else None  # collective
    if d.main:
        _finish(run, student, cfg, config, full)
    d.barrier()
    return run


def _progress(cfg: DistillConfig, d: Dist, start: int):
    import threading

    from tqdm import tqdm

    if d.world > 1:  # tqdm's default lock is a multiprocessing semaphore, leaked when a rank is terminated
        tqdm.set_lock(threading.RLock())
    return tqdm(total=cfg.steps, initial=start, desc="distill", unit="step", dynamic_ncols=True,
                disable=not (cfg.progress and d.main))


def _finish(run: Path, student: torch.nn.Module, cfg: DistillConfig, config: dict[str, Any],
            state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """final/ (atomically), then DONE, then drop the checkpoint: a kill anywhere here is resumable.
    state_dict: the gathered weights of a sharded student."""
    from dtpshard.core.io import atomic_dir

    with atomic_dir(run / rundir.FINAL, force=True) as tmp:
        student.save_pretrained(tmp, source=Path(cfg.tokenizer or cfg.teacher), state_dict=state_dict)
        provenance = {k: config[k] for k in ("teacher", "layout", "layout_kind", "layout_sha256", "steps", "seed",
                                              "train_data", "eval_data")}
        (tmp / "distill.json").write_text(json.dumps(provenance, indent=1) + "\n")
    rows = rundir.read_metrics(run)
    last_eval = next((r for r in reversed(rows) if r["kind"] == "eval"), {})
    rundir.mark_done(run, {"steps": cfg.steps, "eval_kl": last_eval.get("eval_kl"),
                           "eval_ppl": last_eval.get("eval_ppl")})
    rundir.remove_checkpoint(run)
