"""Where a training step's time goes: torch.profiler self CPU time by kind of op, for transformers'
dense model and DTPModel (L = 4, δ = 1), eager and compiled, on the model and tokens of
bench/bench_model.py. Backs docs/benchmarks.md's account of what separates DTP from the dense model.

    python bench/profile_model.py [--vocab 8192] [--tokens 1024] [--seq 512]

One profiled step per arm after two warm-up steps (and the compile), each arm in its own process.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

KINDS = (("matmul", ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")),
         ("attention", ("scaled_dot_product",)),
         ("grad accumulation", ("AccumulateGrad",)))


def kind_of(name: str) -> str:
    for kind, needles in KINDS:
        if any(name == n or (not n.startswith("aten::") and n in name) for n in needles):
            return kind
    return "elementwise and other"


def profile_arm(arm: str, vocab: int, tokens: int, seq: int) -> dict:
    from torch.profiler import profile
    from transformers import AutoModelForCausalLM

    from bench_model import qwen3_config
    from dtpshard.model.dtp import DTPModel

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(qwen3_config(vocab), attn_implementation="sdpa")
    model = hf if arm.startswith("hf-dense") else DTPModel.from_hf(hf, devices=4, delay=1)
    model.train()
    if arm.endswith("+c"):
        from dtpshard.model.compiled import compile_module

        model = compile_module(model)
    ids = torch.randint(0, vocab, (tokens // seq, seq))

    def step():
        out = model(ids)
        (out.logits if hasattr(out, "logits") else out).float().logsumexp(-1).mean().backward()

    step(), step()
    with profile() as prof:
        step()
    seconds = {kind: 0.0 for kind, _ in KINDS} | {"elementwise and other": 0.0}
    for e in prof.key_averages():
        # AccumulateGrad's own time is its add/copy children's: count those under it, not as elementwise
        seconds[kind_of(e.key)] += (e.cpu_time_total if e.key == "torch::autograd::AccumulateGrad"
                                    else e.self_cpu_time_total) / 1e6
    accumulate_children = sum(e.self_cpu_time_total for e in prof.key_averages()
                              if e.key in ("aten::add_", "aten::copy_")) / 1e6
    seconds["elementwise and other"] -= min(accumulate_children, seconds["grad accumulation"])
    return {"arm": arm, **seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--arms", nargs="+", default=["hf-dense", "dtp-L4", "dtp-L4+c"])
    ap.add_argument("--arm")
    a = ap.parse_args()
    if a.arm:
        torch.set_num_threads(2)
        print(json.dumps(profile_arm(a.arm, a.vocab, a.tokens, a.seq)))
        return
    rows = []
    for arm in a.arms:
        out = subprocess.run([sys.executable, __file__, "--arm", arm, "--vocab", str(a.vocab), "--tokens",
                              str(a.tokens), "--seq", str(a.seq)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    kinds = [k for k in rows[0] if k != "arm"]
    print(f"self CPU seconds of one fwd+bwd step, Qwen3-0.6B widths, 4 layers, vocab {a.vocab}, {a.tokens} "
          "tokens, 2 threads (ratio: over the first arm)")
    print("| arm | " + " | ".join(kinds) + " | total | ratio |")
    print("|---" * (len(kinds) + 3) + "|")
    base = sum(rows[0][k] for k in kinds)
    for r in rows:
        total = sum(r[k] for k in kinds)
        print(f"| {r['arm']} | " + " | ".join(f"{r[k]:.3f}" for k in kinds) + f" | {total:.3f} | {total / base:.3f} |")


if __name__ == "__main__":
    main()
