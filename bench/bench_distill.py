"""Benchmark: seconds per optimizer step of `distill` against plain dense fine-tuning, same run.

Model: Qwen3-0.6B's widths (D 1024, 16 query / 8 KV heads, head_dim 128, N 3072, qk-norm, tied
embeddings) with 4 layers and, to fit this CPU, a vocabulary of --vocab (default 8192, not 151936;
the chunked loss makes the head cost linear in V either way). Random weights; one batch of
--micro-batch × --grad-accum sequences of --seq-len tokens, reused by every arm.

Arms (each: zero_grad, forward/backward of every micro-batch, clip 1.0, AdamW step; embedding and
LM head frozen in all of them, as in distillation):
- dense fine-tune, transformers: Qwen3ForCausalLM, CE only (the baseline of the ratio)
- dense fine-tune, DTPModel L=1 δ=0: CE only through the chunked loss
- distill: the DTP student (L, δ) plus the frozen teacher's forward, KL + 0.1·CE (distill_loop.accumulate)
- distill, cached teacher: the same student trained from a teacher cache (top-k KL + tail + 0.1·CE; the
  cache is built before timing, in a temporary directory, and read from disk every step as in a run)
- with --compile, the cached arm again with the student compiled (`distill --compile on`)
- with --recipes, the cached arm under each distinct step of every recipe (training/recipes.py): the
  stream-matching steps run the teacher for its streams, the curriculum's fractional δ lands two
  modules' sums; then a table of each recipe's mean cost of a step over a --steps run, against the
  paper recipe's (the cached arm), the cost the recipe goals are stated in; with --json also as one
  JSON line of rows {recipe, seconds, ratio}, which a recipe study reads as its cost.json
--shape smollm2 times SmolLM2-135M's shapes instead (D 576, 9 / 3 heads, N 1536, 30 layers, its vocabulary
49152, tied), with L = 3: the recipe study's model.
Arms are interleaved per repeat so machine load hits them alike; the median is reported. On CUDA
every arm runs in bf16-mixed (as `distill --precision auto` does), on a CPU in fp32.
Usage: python bench/bench_distill.py [--seq-len 256] [--repeats 3] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtpshard.model.dtp import DTPModel
from dtpshard.training.ddp import Dist
from dtpshard.training.loop import accumulate
from dtpshard.training.losses import kl_ce_sums
from dtpshard.training.precision import autocast_for, resolve_precision
from dtpshard.training.recipe import FROZEN, DistillConfig, Student, Teacher
from dtpshard.training.recipes import Phase
from dtpshard.training.strategy import Replicated


def qwen3_config(vocab: int, layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=vocab, tie_word_embeddings=True,
                       max_position_embeddings=4096, use_sliding_window=False)


def smollm2_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                       max_position_embeddings=2048, rope_theta=100000.0, rms_norm_eps=1e-5)


def optimizer(model: torch.nn.Module, freeze: set[str]) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_(name not in freeze)
        if p.requires_grad:
            params.append(p)
    return torch.optim.AdamW(params, lr=5e-5, betas=(0.9, 0.95), weight_decay=0.0), params


def timed(step, dev: str) -> float:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    step()
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--delay", type=float, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--grad-checkpointing", action="store_true")
    ap.add_argument("--k", type=int, default=64, help="teacher-cache top k")
    ap.add_argument("--compile", action="store_true", help="add the compiled cached arm")
    ap.add_argument("--recipes", action="store_true", help="add every recipe's steps and their mean cost")
    ap.add_argument("--steps", type=int, default=50, help="--recipes: the run length each recipe's phases follow")
    ap.add_argument("--shape", choices=("qwen3", "smollm2"), default="qwen3")
    ap.add_argument("--json", action="store_true", help="--recipes: end with each recipe's cost as one JSON line "
                    "(a study's cost.json: studies/recipes.py)")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    dev = a.device
    torch.manual_seed(0)
    config = qwen3_config(a.vocab, a.layers) if a.shape == "qwen3" else smollm2_config(a.layers)
    a.vocab = config.vocab_size
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.02) if p.ndim > 1 else p.fill_(1.0)
    hf = hf.to(dev).train()
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    teacher = DTPModel.from_state_dict(hf.config, sd, devices=1, delay=0).to(dev).requires_grad_(False).eval()
    dense = DTPModel.from_state_dict(hf.config, {k: v.clone() for k, v in sd.items()}, devices=1, delay=0).to(dev)
    student = DTPModel.from_state_dict(hf.config, {k: v.clone() for k, v in sd.items()}, devices=a.devices,
                                       delay=a.delay).to(dev)
    student.gradient_checkpointing = dense.gradient_checkpointing = a.grad_checkpointing
    precision = resolve_precision("auto", dev)  # bf16-mixed on CUDA, fp32 on a CPU, as distill
    cfg = DistillConfig(teacher=Path("."), out=Path("."), seq_len=a.seq_len, micro_batch=a.micro_batch,
                        grad_accum=a.grad_accum, precision=precision)
    strategy = Replicated(Dist(device=dev), precision)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, a.vocab, (a.micro_batch, a.seq_len + 1), generator=g) for _ in range(a.grad_accum)]
    norm = a.micro_batch * a.grad_accum * a.seq_len
    frozen = set(FROZEN)

    opt_hf, p_hf = optimizer(hf, frozen)
    opt_dense, p_dense = optimizer(dense, frozen)
    opt_st, p_st = optimizer(student, frozen)
    net, teacher_net = Student(student), Teacher(teacher)

    def hf_step():
        opt_hf.zero_grad(set_to_none=True)
        for b in batches:
            b = b.to(dev)
            with autocast_for(dev, precision):
                loss = hf(b[:, :-1], labels=b[:, :-1].clone()).loss  # shifts the labels itself
            (loss / a.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(p_hf, 1.0)
        opt_hf.step()

    def dense_step():
        opt_dense.zero_grad(set_to_none=True)
        for b in batches:
            b = b.to(dev)
            with autocast_for(dev, precision):
                loss, _, _ = kl_ce_sums(dense.hidden(b[:, :-1]), dense.lm_head_weight, None, None, b[:, 1:], 1.0)
            (loss / norm).backward()
        torch.nn.utils.clip_grad_norm_(p_dense, 1.0)
        opt_dense.step()

    def distill_step():
        opt_st.zero_grad(set_to_none=True)
        accumulate(net, strategy, teacher_net, batches, cfg, dev)
        torch.nn.utils.clip_grad_norm_(p_st, 1.0)
        opt_st.step()

    import tempfile

    from dtpshard.training.teacher_cache import TeacherCache, build_cache

    tmp = tempfile.TemporaryDirectory()
    hf.save_pretrained(tmp.name + "/teacher")
    cache = TeacherCache(build_cache(Path(tmp.name) / "teacher", torch.cat(batches), Path(tmp.name) / "cache", a.k,
                                     device=dev, progress=False))
    opt_c, p_c = optimizer(student, frozen)  # the same student: only the step's work matters here

    def cached_step(n=net, phase=None):
        opt_c.zero_grad(set_to_none=True)
        with student.delayed(a.delay if phase is None else phase.delay):
            accumulate(n, strategy, teacher_net, batches, cfg, dev, cache, phase)  # the teacher: for streams only
        torch.nn.utils.clip_grad_norm_(p_c, 1.0)
        opt_c.step()

    arms = {"dense fine-tune, transformers (CE)": hf_step, "dense fine-tune, DTPModel L=1 (CE)": dense_step,
            f"distill L={a.devices} δ={a.delay:g} (KL+0.1·CE, teacher fwd)": distill_step,
            f"distill L={a.devices} δ={a.delay:g}, teacher cache k={a.k}": cached_step}
    if a.compile:
        from dtpshard.model.compiled import compile_module

        compiled = compile_module(Student(student))
        arms["  the same, student compiled"] = lambda: cached_step(compiled)
    phases = {}  # each distinct step of every recipe, timed once
    if a.recipes:
        from dtpshard.training.recipes import RECIPES

        for r in RECIPES.values():
            for s in range(a.steps):
                ph = r.phase(s, a.steps, a.delay)
                if ph != Phase(a.delay) and ph not in phases.values():
                    key = f"  step: δ={ph.delay:g}, logits ×{ph.logits:g}, streams ×{ph.streams:g}"
                    phases[key] = ph
                    arms[key] = lambda ph=ph: cached_step(net, ph)
    times: dict[str, list[float]] = {k: [] for k in arms}
    for k, step in arms.items():  # warm-up: allocator, optimizer state, autotuning, compile
        t = time.perf_counter()
        step()
        if "compiled" in k:
            print(f"compile (first step): {time.perf_counter() - t:.0f} s", file=sys.stderr)
    for _ in range(a.repeats):
        for k, step in arms.items():
            times[k].append(timed(step, dev))
    n_params = sum(p.numel() for p in p_st)
    widths = "Qwen3-0.6B widths" if a.shape == "qwen3" else "SmolLM2-135M widths"
    print(f"{widths}, {a.layers} layers, vocab {a.vocab}, L = {a.devices}, δ = {a.delay:g}, "
          f"{n_params / 1e6:.1f} M trained parameters; batch {a.micro_batch}×{a.grad_accum}×{a.seq_len} tokens; "
          f"device {dev}, "
          f"{torch.get_num_threads()} threads, median of {a.repeats}, arms interleaved; load {os.getloadavg()[0]:.2f}")
    if dev.startswith("cuda"):
        print(f"peak CUDA memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB (all three models and optimizers)")
    base = statistics.median(times[next(iter(arms))])
    print(f"| {'arm':<52} | s/step | ratio |")
    print(f"|{'-' * 54}|--------|-------|")
    for k, ts in times.items():
        m = statistics.median(ts)
        print(f"| {k:<52} | {m:6.2f} | {m / base:5.2f} |")
    if phases:
        from dtpshard.training.recipes import RECIPES

        cached = statistics.median(times[f"distill L={a.devices} δ={a.delay:g}, teacher cache k={a.k}"])
        cost = {ph: statistics.median(times[k]) for k, ph in phases.items()}
        print(f"\nmean cost of a step over a {a.steps}-step run, each recipe against the paper's (the cached arm):")
        print("| recipe | s/step | × paper |")
        print("|---|---:|---:|")
        rows = []
        for name, r in RECIPES.items():
            each = [cost.get(r.phase(s, a.steps, a.delay), cached) for s in range(a.steps)]
            m = sum(each) / len(each)
            print(f"| {name} | {m:.2f} | {m / cached:.2f} |")
            rows.append({"recipe": name, "seconds": m, "ratio": m / cached})
        if a.json:
            print(json.dumps(rows))


if __name__ == "__main__":
    main()
