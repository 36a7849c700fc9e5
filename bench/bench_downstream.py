"""What `dtpshard eval --tasks` costs: the default task set on SmolLM2-135M-Instruct, the dense
model and a DTP student (L = 3, δ = 1, the published optimised layout applied at load: the same
forward a distilled student runs), wall time, choices and tokens a second, in one run.

    python bench/bench_downstream.py [--limit N] [--tasks default] [--threads 2]
                                     [--precision fp32 bf16-mixed] [--json] [--items FILE]

Tokens are those the forward passes read: each item's context once (into its KV cache) and each
choice's own tokens after it (downstream/lm.py). The 1-minute load average is printed before and
after: a number taken beside other work is slower by about the load over the cores. With two
precisions, each model's choices under the second are compared with the first's, item by item.
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
from dtpshard.downstream.evaluate import accuracy, load_for_tasks, primary, score_items
from dtpshard.downstream.tasks import DEFAULT, resolve
from dtpshard.studies.smollm2 import smollm2_checkpoint
from dtpshard.training.precision import autocast_for, param_dtype

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


def arm(name: str, flags: DTPFlags, layout: Path | None, tasks: list[str], limit: int | None,
        precision: str) -> dict:
    model = smollm2_checkpoint()
    net, tok, length = load_for_tasks(model, flags, layout, "cpu", None, param_dtype(precision, frozen=True))
    seen = counted()
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    items = score_items(lm_module.language_model(net, tok, length, autocast=lambda: autocast_for("cpu", precision)),
                        tasks, limit)
    seconds = time.perf_counter() - t0
    lm_module.continuation_scores = REAL
    pooled = [r[primary(t)] for t in tasks for r in items[t]]
    weights = str(next(net.parameters()).dtype).removeprefix("torch.")
    return {"arm": name, "precision": precision, "weights": weights, "seconds": seconds, "items": len(pooled), **seen,
            "tokens_per_s": seen["tokens"] / seconds, "choices_per_s": seen["choices"] / seconds,
            "accuracy": {t: accuracy(items[t]) for t in tasks}, "pooled": sum(pooled) / len(pooled),
            "load_before": load, "load_after": os.getloadavg()[0], "_items": items}


def matmul_rate(precision: str, tokens: int = 1024, repeat: int = 20) -> float:
    """GFLOP/s of one [tokens, 576] x [576, 1536] matmul (SmolLM2-135M's FFN) under `precision`: the
    host's ceiling for a forward that is almost all matmuls of that width."""
    x, w = torch.randn(tokens, 576), torch.randn(1536, 576)
    with torch.no_grad(), autocast_for("cpu", precision):
        for _ in range(3):
            x @ w.T
        t0 = time.perf_counter()
        for _ in range(repeat):
            x @ w.T
    return 2 * tokens * 576 * 1536 * repeat / (time.perf_counter() - t0) / 1e9


def agreement(a: dict, b: dict, tasks: list[str]) -> dict:
    """b's choices against a's, item by item (each task's primary metric's choice)."""
    pick = {t: "choice_norm" if primary(t) == "acc_norm" else "choice" for t in tasks}
    same = [x[pick[t]] == y[pick[t]] for t in tasks for x, y in zip(a["_items"][t], b["_items"][t])]
    return {"models": a["arm"], "precisions": [a["precision"], b["precision"]], "items": len(same),
            "differ": 1 - sum(same) / len(same), "points": 100 * (b["pooled"] - a["pooled"]),
            "time_ratio": b["seconds"] / a["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", nargs="+", default=["default"])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16-mixed"])
    ap.add_argument("--models", nargs="+", default=["dense", "student"], choices=["dense", "student"])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--items", type=Path, help="write every model's per-item rows here (JSON), to compare later")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tasks = resolve(a.tasks)
    models = {"dense": ("dense", DTPFlags(devices=1, delay=0), None),
              "student": ("student L=3 δ=1", DTPFlags(devices=3, delay=1), LAYOUT)}
    rates = {p: matmul_rate(p) for p in a.precision}
    rows = [arm(*models[m], tasks, a.limit, p) for p in a.precision for m in a.models]
    same = [agreement(x, y, tasks) for x in rows for y in rows
            if x["arm"] == y["arm"] and x["precision"] == a.precision[0] != y["precision"]]
    ratio = {p: {r["arm"]: r["seconds"] for r in rows if r["precision"] == p} for p in a.precision}
    if a.items:
        a.items.write_text(json.dumps({f"{r['arm']} {r['precision']}": r["_items"] for r in rows}) + "\n")
    host = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {a.threads} threads"
    if a.json:
        print(json.dumps({"host": host, "tasks": tasks, "limit": a.limit, "agreement": same, "matmul_gflops": rates,
                          "rows": [{k: v for k, v in r.items() if k != "_items"} for r in rows]}))
        return
    print(f"{host}; tasks {', '.join(tasks)}; {'every item' if a.limit is None else f'first {a.limit} items'}")
    for r in rows:
        print(f"{r['arm']:<16} {r['precision']:<10} {r['weights']:<8} {r['seconds']:8.1f} s  {r['items']:6d} items  "
              f"{r['choices_per_s']:7.1f} choices/s  {r['tokens_per_s']:8.0f} tokens/s  "
              f"pooled {100 * r['pooled']:.2f}  "
              f"(load {r['load_before']:.2f} -> {r['load_after']:.2f})")
    for p, rate in rates.items():
        print(f"{p}: a [1024, 576] x [576, 1536] matmul runs at {rate:.0f} GFLOP/s here")
    for p, t in ratio.items():
        if len(t) == 2:
            print(f"student / dense time, {p}: {t[models['student'][0]] / t['dense']:.2f}")
    for g in same:
        print(f"{g['models']}: {g['precisions'][1]} takes {g['time_ratio']:.2f} of {g['precisions'][0]}'s time, "
              f"chooses otherwise on {100 * g['differ']:.1f}% of {g['items']} items; pooled accuracy "
              f"{g['points']:+.2f} points")
    print(f"DEFAULT is {', '.join(DEFAULT)}")


if __name__ == "__main__":
    main()
