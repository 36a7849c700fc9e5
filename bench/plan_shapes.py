"""The memory plan of `distill` (training/memory.py) for the Llama-3-8B and Llama-3-70B shapes on
8 processes of 80 GB (or --memory) each: what each process holds, and what would make a run fit,
for full distillation and for adapters of rank 64 (`--adapters 64`).

Nothing is loaded: the plan reads config.json alone, so the two configs are written here (their
published shapes, no weights). Student L = 4, δ = 1, micro-batch 4 × 1024 tokens (the paper's)
unless a row says 1. "weights": the teacher and the student (full), or the one frozen copy both
share (adapters); "trained": what AdamW updates (the student, or the adapters) in fp32.
Usage: python bench/plan_shapes.py [--world 8] [--memory 80GB] [--adapters-only]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {  # the published configs' shapes
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "Llama-3-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
}
SHARDED = ["--fsdp", "--precision", "bf16-mixed", "--grad-checkpointing"]
ARMS = {"--fsdp, bf16-mixed": ["--fsdp", "--precision", "bf16-mixed"],
        "+ --grad-checkpointing": SHARDED,
        "+ --micro-batch 1": [*SHARDED, "--micro-batch", "1"],
        "--adapters 64 + --fsdp, bf16-mixed, --grad-checkpointing": [*SHARDED, "--adapters", "64"],
        "+ --micro-batch 1 (adapters)": [*SHARDED, "--adapters", "64", "--micro-batch", "1"]}


def main() -> None:
    from transformers import LlamaConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--memory", default="80GB")
    ap.add_argument("--adapters-only", action="store_true", help="only the rows with --adapters")
    a = ap.parse_args()
    GiB = 1 << 30
    print(f"| model | setup ({a.world} x {a.memory}) | weights | trained | gradients | AdamW | activations | "
          "communication | total | fits | what would make it fit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in SHAPES.items():
            path = Path(tmp) / name
            LlamaConfig(**shape, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                        max_position_embeddings=8192, rope_theta=500000.0).save_pretrained(str(path))
            for arm, flags in ARMS.items():
                if a.adapters_only and "--adapters" not in flags:
                    continue
                cmd = [sys.executable, "-m", "dtpshard", "distill", str(path), "--out", str(Path(tmp) / "run"),
                       "--plan", "--json", "--plan-world", str(a.world), "--plan-memory", a.memory,
                       "--device", "cpu", "--devices", "4", "--delay", "1", "--seq-len", "1024", *flags]
                done = subprocess.run(cmd, capture_output=True, text=True)
                plan = json.loads(done.stdout)
                p = {k: v / GiB for k, v in plan["parts"].items()}
                weights = p["weights"] if "weights" in p else p["teacher"] + p["student"]
                trained = p["adapters"] if "adapters" in p else p["student"]
                print(f"| {name} | {arm} | {weights:.1f} | {trained:.1f} | {p['gradients']:.1f} | "
                      f"{p['optimizer']:.1f} | {p['activations']:.1f} | {p.get('communication', 0):.1f} | "
                      f"{plan['total'] / GiB:.1f} GiB | {'yes' if plan['fits'] else 'no'} | "
                      f"{'; '.join(plan['advice']) or '-'} |")


if __name__ == "__main__":
    main()
