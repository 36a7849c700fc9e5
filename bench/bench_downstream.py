"""What `dtpshard eval --tasks` costs: the default task set on SmolLM2-135M-Instruct, the dense
model and a DTP student (L = 3, δ = 1, the published optimised layout applied at load: the same
forward a distilled student runs), wall time, choices and tokens a second, in one run.

    python bench/bench_downstream.py [--limit N] [--tasks default] [--threads 2] [--json]

Tokens are those the forward passes read: each item's context once (into its KV cache) and each
choice's own tokens after it (downstream/lm.py). The 1-minute load average is printed before and
after: a number taken beside other work is slower by about the load over the cores.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtpshard.core.settings import DTPFlags
from dtpshard.downstream import lm as lm_module
from dtpshard.downstream.evaluate import load_for_tasks, score_items
from dtpshard.downstream.tasks import DEFAULT, resolve
from dtpshard.studies.smollm2 import smollm2_checkpoint

LAYOUT = Path(__file__).resolve().parents[1] / "docs/results/smollm2-l3-d1/layouts/optimised.json"


REAL = lm_module.continuation_scores


def counted() -> dict[str, int]:
    """Count what continuation_scores feeds its forwards (choices, and tokens as it groups them)."""
    seen = {"choices": 0, "tokens": 0}
    real = REAL

    def wrapper(model, pairs, max_length, *a, **kw):
        groups, rows = lm_module.shared_contexts(pairs, max_length)  # the forwards' own grouping
        seen["tokens"] += sum(len(c) for c in groups) + sum(len(after) for after, _ in rows)
        seen["choices"] += len(pairs)
        return real(model, pairs, max_length, *a, **kw)

    lm_module.continuation_scores = wrapper
    return seen


def arm(name: str, flags: DTPFlags, layout: Path | None, tasks: list[str], limit: int | None) -> dict:
    model = smollm2_checkpoint()
    net, tok, length = load_for_tasks(model, flags, layout, "cpu", None)
    seen = counted()
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    items = score_items(lm_module.language_model(net, tok, length), tasks, limit)
    seconds = time.perf_counter() - t0
    lm_module.continuation_scores = REAL
    return {"arm": name, "seconds": seconds, "items": sum(len(v) for v in items.values()), **seen,
            "tokens_per_s": seen["tokens"] / seconds, "choices_per_s": seen["choices"] / seconds,
            "load_before": load, "load_after": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", nargs="+", default=["default"])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tasks = resolve(a.tasks)
    rows = [arm("dense", DTPFlags(devices=1, delay=0), None, tasks, a.limit),
            arm("student L=3 δ=1", DTPFlags(devices=3, delay=1), LAYOUT, tasks, a.limit)]
    host = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {a.threads} threads"
    if a.json:
        print(json.dumps({"host": host, "tasks": tasks, "limit": a.limit, "rows": rows,
                          "student_over_dense": rows[1]["seconds"] / rows[0]["seconds"]}))
        return
    print(f"{host}; tasks {', '.join(tasks)}; {'every item' if a.limit is None else f'first {a.limit} items'}")
    for r in rows:
        print(f"{r['arm']:<16} {r['seconds']:8.1f} s  {r['items']:6d} items  {r['choices_per_s']:7.1f} choices/s  "
              f"{r['tokens_per_s']:8.0f} tokens/s  (load {r['load_before']:.2f} -> {r['load_after']:.2f})")
    print(f"student / dense time: {rows[1]['seconds'] / rows[0]['seconds']:.2f}")
    print(f"DEFAULT is {', '.join(DEFAULT)}")


if __name__ == "__main__":
    main()
