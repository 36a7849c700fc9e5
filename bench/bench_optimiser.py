"""Benchmark of the layout optimiser (issues 5, 12) on synthetic affinity tensors of real model shapes.

Shapes: Qwen3-0.6B (28 layers, 8 KV groups, 3072 neurons) and Danube3-500M (16, 8, 4096) at L =
--devices (4), Llama-3-70B (80, 8, 28672) at L = 8 (target: one restart within 30 s on 2 cores).
The scores are structured like real affinities: every module has latent unit factors, an
edge's scores are exp(low rank + noise) times per-unit heavy-tailed (log-normal) scales, so
there is structure to find and a few units dominate. One restart, timed end to end (normalising
the edges, the sweeps, the final scoring), wall and CPU seconds (the CPU figure is steadier on a
shared machine). J is compared with contiguous and with the mean of --random seeded random
layouts, both scored in the same run, and with the random expectation n_edges / L. A shape whose
affinity does not fit in memory (70B at δ = 2: 79 edges of 28672² scores) is reported and skipped.
Usage: python bench/bench_optimiser.py [--delay 2] [--shapes Llama-3-70B] [--verify 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtpshard.affinity.file import Affinity, edges_for_delay
from dtpshard.core.layout import Layout
from dtpshard.core.shape import UnitShape
from dtpshard.layouts.optimise import optimise_layout
from dtpshard.layouts.score import colocated_score

SHAPES = {
    "Qwen3-0.6B": UnitShape(28, 8, 2, 3072),
    "Danube3-500M": UnitShape(16, 8, 2, 4096),
    "Llama-3-70B": UnitShape(80, 8, 8, 28672),
}
DEVICES = {"Llama-3-70B": 8}  # the others take --devices


def affinity_bytes(model: dict[str, int], delay: float) -> int:
    """Memory of the float64 edges plus one edge's float64 temporaries while it is generated."""
    sizes = [model.units(a) * model.units(b) for a, b in edges_for_delay(2 * model.layers, delay)]
    return 8 * sum(sizes) + 3 * 8 * max(sizes, default=0)


def synthetic_affinity(model: dict[str, int], delay: float = 1, seed: int = 0, rank: int = 4,
                       strength: float = 1.5, noise: float = 0.5) -> Affinity:
    """Heavy-tailed, low rank plus noise scores for every edge δ needs."""
    rng = np.random.default_rng(seed)
    modules = 2 * model.layers
    factors = [rng.standard_normal((model.units(m), rank)) for m in range(modules)]
    scales = [rng.lognormal(0.0, 1.0, model.units(m)) for m in range(modules)]
    edges = {}
    for a, b in edges_for_delay(modules, delay):
        logits = strength * factors[a] @ factors[b].T / np.sqrt(rank)
        logits += noise * rng.standard_normal(logits.shape)
        # float32 like an affinity file, held as float64 like Affinity.load; one edge at a time
        edges[(a, b)] = (np.exp(logits) * scales[a][:, None] * scales[b][None, :]).astype(np.float32).astype(np.float64)
    return Affinity(model, delay, edges, tokens=0, options={"synthetic": True}, source="bench")


def run(name: str, model: dict[str, int], devices: int, delay: float, n_random: int) -> dict:
    aff = synthetic_affinity(model, delay)
    t, c = time.perf_counter(), time.process_time()
    opt = optimise_layout(aff, devices, delay, "optimised")
    seconds, cpu = time.perf_counter() - t, time.process_time() - c
    contiguous = colocated_score(aff, Layout.contiguous(model, devices, delay))["J"]
    randoms = [colocated_score(aff, Layout.random(model, devices, delay, seed=s))["J"] for s in range(n_random)]
    return {"shape": name, "devices": devices, "seconds": seconds, "cpu": cpu, "sweeps": opt.score["sweeps"],
            "J_opt": opt.score["J"], "J_contig": contiguous, "J_random": float(np.mean(randoms)),
            "expectation": opt.score["random_expectation"], "n_edges": opt.score["n_edges"]}


def verify_blocks(name: str, model: dict[str, int], devices: int, delay: float, n_blocks: int) -> None:
    """Exactness at full scale: cold-started block solves against their LP dual certificate and,
    where the [U, U] matrix fits (U <= 8192), scipy's LSA on replicated slots."""
    from scipy.optimize import linear_sum_assignment

    from dtpshard.layouts.assignment import assign
    from dtpshard.layouts.optimise import Problem

    problem = Problem.build(synthetic_affinity(model, delay), devices, delay)
    devs = [np.random.default_rng(m).permutation(d) for m, d in enumerate(problem.contiguous())]
    for m in range(1, 2 * n_blocks, 2):  # neuron blocks of the first layers, random neighbours
        gain = problem.block_gain(devs, m)
        t = time.perf_counter()
        dev, prices = assign(gain, devices)
        ours = time.perf_counter() - t
        a = gain[np.arange(len(dev)), dev].sum()
        dual = (gain - prices).max(axis=1).sum() + len(dev) // devices * prices.sum()
        line = f"# verify {name} module {m}: ours {a:.15f} ({ours * 1e3:.1f} ms), dual gap {dual - a:.2e}"
        if gain.shape[0] <= 8192:
            t = time.perf_counter()
            slots = np.repeat(gain, gain.shape[0] // devices, axis=1)
            rows, cols = linear_sum_assignment(slots, maximize=True)
            lsa = time.perf_counter() - t
            b = slots[rows, cols].sum()
            line += f", LSA {b:.15f} ({lsa * 1e3:.0f} ms), diff {a - b:.2e}"
        print(line, flush=True)


def main() -> None:
    from dtpshard.core.errors import UserError
    from dtpshard.core.memory import check_fits

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4, help="L for the shapes other than Llama-3-70B (L = 8)")
    p.add_argument("--delay", type=float, default=1)
    p.add_argument("--random", type=int, default=20, help="random layouts to average")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--verify", type=int, default=0, help="check this many neuron blocks (dual certificate, LSA)")
    args = p.parse_args()
    fits = {}
    for name in args.shapes:
        try:
            check_fits(affinity_bytes(SHAPES[name], args.delay), f"{name}'s affinity at delay {args.delay}")
            fits[name] = True
        except UserError as e:
            print(f"# skipped: {e}")
            fits[name] = False
    for name in args.shapes:
        if args.verify and fits[name]:
            verify_blocks(name, SHAPES[name], DEVICES.get(name, args.devices), args.delay, args.verify)
    print(f"# {os.cpu_count()} CPUs, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}, delay = {args.delay}, "
          f"one restart, {args.random} random layouts")
    print("| shape | L | edges | seconds | CPU s | sweeps | J optimised | J contiguous | mean J random "
          "| random expectation | optimised / contiguous | optimised / mean random |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        if not fits[name]:
            continue
        r = run(name, SHAPES[name], DEVICES.get(name, args.devices), args.delay, args.random)
        print(f"| {r['shape']} | {r['devices']} | {r['n_edges']} | {r['seconds']:.2f} | {r['cpu']:.2f} | {r['sweeps']} "
              f"| {r['J_opt']:.3f} | {r['J_contig']:.3f} | {r['J_random']:.3f} | {r['expectation']:.3f} "
              f"| {r['J_opt'] / r['J_contig']:.3f} | {r['J_opt'] / r['J_random']:.3f} |", flush=True)
    print(f"# load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
