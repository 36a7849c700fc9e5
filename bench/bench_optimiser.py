"""Benchmark of the layout optimiser (issue 5) on synthetic affinity tensors of real model shapes.

Shapes: Qwen3-0.6B (28 layers, 8 KV groups, 3072 neurons) and Danube3-500M (16, 8, 4096), L = 4,
δ = 1. The scores are structured like real affinities: every module has latent unit factors, an
edge's scores are exp(low rank + noise) times per-unit heavy-tailed (log-normal) scales, so
there is structure to find and a few units dominate. One restart, timed end to end (normalising
the edges, the sweeps, the final scoring). Usage: python bench/bench_optimiser.py [--delay 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtpshard.affinity.file import Affinity, edges_for_delay, units
from dtpshard.core.layout import Layout
from dtpshard.layouts.optimise import optimise_layout
from dtpshard.layouts.score import colocated_score

SHAPES = {
    "Qwen3-0.6B": {"layers": 28, "kv_groups": 8, "heads_per_group": 2, "neurons": 3072},
    "Danube3-500M": {"layers": 16, "kv_groups": 8, "heads_per_group": 2, "neurons": 4096},
}


def synthetic_affinity(model: dict[str, int], delay: float = 1, seed: int = 0, rank: int = 4,
                       strength: float = 1.5, noise: float = 0.5) -> Affinity:
    """Heavy-tailed, low rank plus noise scores for every edge δ needs."""
    rng = np.random.default_rng(seed)
    modules = 2 * model["layers"]
    factors = [rng.standard_normal((units(model, m), rank)) for m in range(modules)]
    scales = [rng.lognormal(0.0, 1.0, units(model, m)) for m in range(modules)]
    edges = {}
    for a, b in edges_for_delay(modules, delay):
        logits = strength * factors[a] @ factors[b].T / np.sqrt(rank)
        logits += noise * rng.standard_normal(logits.shape)
        edges[(a, b)] = (np.exp(logits) * scales[a][:, None] * scales[b][None, :]).astype(np.float32)
    return Affinity(dict(model), delay, {k: v.astype(np.float64) for k, v in edges.items()},
                    tokens=0, options={"synthetic": True}, source="bench")


def run(name: str, model: dict[str, int], devices: int, delay: float, n_random: int) -> dict:
    aff = synthetic_affinity(model, delay)
    t = time.perf_counter()
    opt = optimise_layout(aff, devices, delay, "optimised")
    seconds = time.perf_counter() - t
    contiguous = colocated_score(aff, Layout.contiguous(model, devices, delay))["J"]
    randoms = [colocated_score(aff, Layout.random(model, devices, delay, seed=s))["J"] for s in range(n_random)]
    return {"shape": name, "seconds": seconds, "sweeps": opt.score["sweeps"], "J_opt": opt.score["J"],
            "J_contig": contiguous, "J_random": float(np.mean(randoms)),
            "expectation": opt.score["random_expectation"], "n_edges": opt.score["n_edges"]}


def verify_blocks(name: str, model: dict[str, int], devices: int, delay: float, n_blocks: int) -> None:
    """Exactness at full scale: cold-started block solves against scipy's LSA on replicated slots."""
    from scipy.optimize import linear_sum_assignment

    from dtpshard.layouts.optimise import Problem, balanced_assignment

    problem = Problem.build(synthetic_affinity(model, delay), devices, delay)
    devs = [np.random.default_rng(m).permutation(d) for m, d in enumerate(problem.contiguous())]
    for m in range(1, 2 * n_blocks, 2):  # neuron blocks of the first layers, random neighbours
        gain = problem.block_gain(devs, m)
        t = time.perf_counter()
        dev = balanced_assignment(gain, devices)
        ours = time.perf_counter() - t
        t = time.perf_counter()
        slots = np.repeat(gain, gain.shape[0] // devices, axis=1)
        rows, cols = linear_sum_assignment(slots, maximize=True)
        lsa = time.perf_counter() - t
        a, b = gain[np.arange(len(dev)), dev].sum(), slots[rows, cols].sum()
        print(f"# verify {name} module {m}: ours {a:.15f} ({ours * 1e3:.1f} ms), LSA {b:.15f} "
              f"({lsa * 1e3:.0f} ms), diff {a - b:.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--delay", type=float, default=1)
    p.add_argument("--random", type=int, default=20, help="random layouts to average")
    p.add_argument("--verify", type=int, default=0, help="check this many neuron blocks against scipy LSA")
    args = p.parse_args()
    for name, model in SHAPES.items():
        if args.verify:
            verify_blocks(name, model, args.devices, args.delay, args.verify)
    print(f"# {os.cpu_count()} CPUs, L = {args.devices}, delay = {args.delay}, one restart")
    print("| shape | edges | seconds | sweeps | J optimised | J contiguous | mean J random "
          "| random expectation | optimised / contiguous |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, model in SHAPES.items():
        r = run(name, model, args.devices, args.delay, args.random)
        print(f"| {r['shape']} | {r['n_edges']} | {r['seconds']:.2f} | {r['sweeps']} | {r['J_opt']:.3f} "
              f"| {r['J_contig']:.3f} | {r['J_random']:.3f} | {r['expectation']:.3f} "
              f"| {r['J_opt'] / r['J_contig']:.3f} |")


if __name__ == "__main__":
    main()
