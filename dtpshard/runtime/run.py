"""`dtpshard run`: greedy generation with the model run as DTP across processes.

The command checks everything a user can get wrong before any rank starts (`plan_run`), then
either starts L local ranks (`--nproc L`, core.launch.launch_local) or, under torchrun, is one rank
itself. A rank (`serve_rank`) never goes back through the command: it joins the process group,
loads its shard (runtime/ranks.py) and generates; rank 0 prints.

Start: `torchrun --nproc-per-node L -m dtpshard run MODEL --prompt TEXT --delay D`, or
`dtpshard run MODEL ... --nproc L`, which spawns L local gloo processes itself (the command:
dtpshard/commands/generate.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dtpshard.core.devices import DTYPES, pick_device
from dtpshard.core.errors import UserError
from dtpshard.core.io import dumps
from dtpshard.core.launch import (
    RankExit,
    RankFailure,
    launch_local,
    process_group,
    root_cause,
    set_threads,
    world_from_env,
)
from dtpshard.core.launch_checks import RANK_BYTES, check_nproc, check_timeout
from dtpshard.core.settings import DTPSettings, resolve_dtp, warn_if_other_settings
from dtpshard.model.decode import generate_ids
from dtpshard.model.generate import prompt_ids
from dtpshard.runtime.graphs import GraphDecoder
from dtpshard.runtime.ranks import RankModel, check_world


@dataclass(frozen=True)
class RunJob:
    """Everything a rank needs, resolved and checked by the command before any rank starts."""

    model: Path
    prompt: str
    settings: DTPSettings  # devices = the world size
    layout: Path | None
    max_new_tokens: int
    timeout: float
    latency: float  # seconds added to every transfer (link emulation)
    dtype: str
    device: str  # "cpu" or "cuda" (each rank takes cuda:LOCAL_RANK)
    threads: int
    tokenizer: Path | None
    json: bool
    cuda_graphs: bool


def plan_run(model: Path, prompt: str, world: int, *, delay: float | None, stage3: str | None, layout: Path | None,
             max_new_tokens: int, timeout: float, latency_ms: float, dtype: str, device: str, threads: int,
             tokenizer: Path | None, json: bool, cuda_graphs: bool) -> RunJob:
    """The checked job for `world` ranks: δ and stage3 from the flags, else a student's record,
    else the layout's, else the defaults (core.settings.resolve_dtp)."""
    check_timeout(timeout)
    if device.startswith("cuda:"):
        raise UserError(f"--device {device}: each rank uses cuda:LOCAL_RANK; give --device cuda")
    device = pick_device(device)
    if cuda_graphs and device != "cuda":
        raise UserError("--cuda-graphs: only with --device cuda")
    if device == "cuda" and latency_ms:
        raise UserError("latency_ms emulates a link with host-side waits: only with device=cpu")
    if latency_ms / 1000 >= timeout:
        raise UserError(f"--latency-ms {latency_ms:g}: every transfer would outlast --timeout {timeout:g} s")
    ckpt, lay = check_world(model, world, layout)
    if world > 1 and "RANK" not in os.environ:  # --nproc: the ranks this machine runs, each with its shard
        check_nproc(world, RANK_BYTES + ckpt.shape.shard(world).params() * DTYPES[dtype].itemsize)
    settings = resolve_dtp(ckpt.shape, devices=world, delay=delay, stage3=stage3, record=ckpt.defaults, layout=lay,
                           where=f"layout {layout}")
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank plans: one says it
        warn_if_other_settings(model, ckpt.record, settings, ckpt.shape.modules)
    prompt_ids(ckpt, prompt, tokenizer, max_new_tokens)
    return RunJob(Path(model), prompt, settings, layout, max_new_tokens, timeout, latency_ms / 1000, dtype, device,
                  threads, tokenizer, json, cuda_graphs)


def serve_rank(job: RunJob) -> int:
    """One rank of the run (torchrun's environment, or launch_local's): join, load, generate; rank 0
    prints the text (or one JSON object)."""
    _, world = world_from_env()
    ckpt, lay = check_world(job.model, world, job.layout)  # before any collective
    tok, ids = prompt_ids(ckpt, job.prompt, job.tokenizer, job.max_new_tokens)
    set_threads(job.threads)
    dev = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if job.device == "cuda" else "cpu"
    s = job.settings
    with process_group(job.timeout, "nccl" if job.device == "cuda" else "gloo") as (rank, world):
        net = RankModel(ckpt, rank, s, lay, DTYPES[job.dtype], job.timeout, job.latency, dev)
        decoder = net
        if job.cuda_graphs:
            decoder = GraphDecoder(net, ids.shape[0], ids.shape[1] + job.max_new_tokens)
        out = generate_ids(decoder, ids.to(dev), job.max_new_tokens, eos_id=tok.eos_token_id, config=ckpt.hf_config)
        if rank == 0:
            new = out[0, ids.shape[1]:]
            completion = tok.decode(new, skip_special_tokens=True)
            if job.json:
                print(dumps({"model": str(job.model), "devices": world, "delay": s.delay, "stage3": s.stage3,
                                   "prompt": job.prompt, "completion": completion, "text": job.prompt + completion,
                                   "prompt_ids": ids[0].tolist(), "new_token_ids": new.tolist()}), flush=True)
            else:
                print(job.prompt + completion, flush=True)
    return 0


def run(job: RunJob, nproc: int) -> int:
    """The run: this process as one rank (nproc 1: under torchrun, or alone), or `nproc` local ranks
    started here; a rank's failure is one RankFailure naming it."""
    if nproc == 1:
        return serve_rank(job)
    exits = launch_local(nproc, serve_rank, (job,), grace=job.timeout, who="dtpshard run")
    if any(e.said or e.traceback for e in exits):  # a rank raised: say that one (ranks that lost a
        # collective have already said so themselves)
        raise RankFailure(root_cause([e if e.said or e.traceback else RankExit(e.rank, 0) for e in exits]))
    bad = [f"rank {e.rank} exit {e.code}" for e in exits if e.code and not e.stopped]
    if bad:
        raise RankFailure(f"the run failed ({', '.join(bad)})")
    return 0
