"""The co-located score J of a layout (docs/design.md §3) and `dtpshard score`.

Every edge matrix is normalised to total mass 1 (Ŝ = S / ΣS), so each edge counts the same
whatever the scale of its raw scores, and J = Σ_edges Σ_{(u, v) on the same device} Ŝ[u, v].
A layout that ignores the affinity gets n_edges / L in expectation; the maximum is n_edges.

Internally a layout is held as `devs`: for every module m (2i attention, 2i+1 FFN of layer i)
the device of each original unit, SHARED (-1) for a shared neuron: every device holds it, so it
is co-located with every unit of each edge it is an end of (docs/design.md §6). The optimiser
works on that form and J is linear in each module's one-hot device matrix, which is what makes
its block updates exact.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from dtpshard.affinity.file import Affinity
from dtpshard.core.errors import UserError
from dtpshard.core.layout import SHARED, Layout


@dataclass(frozen=True)
class Edge:
    """One edge's raw scores S [units(a), units(b)] and weight 1/ΣS, so Ŝ = weight · S.

    Ŝ is never materialised: at δ ≥ 2 an FFN -> FFN edge is N x N and a normalised copy
    of every edge would double the memory of a large affinity file.
    """
    scores: np.ndarray
    weight: float

    def towards(self, dev_b: np.ndarray, devices: int) -> np.ndarray:
        """[units(a), L]: Ŝ mass from each source unit to the target units on each device."""
        return self.weight * (self.scores @ one_hot(dev_b, devices))

    def back(self, dev_a: np.ndarray, devices: int) -> np.ndarray:
        """[units(b), L]: Ŝ mass into each target unit from the source units on each device."""
        return self.weight * (self.scores.T @ one_hot(dev_a, devices))  # a view: BLAS transposes

    def colocated(self, dev_a: np.ndarray, dev_b: np.ndarray, devices: int) -> float:
        """Σ Ŝ[u, v] over pairs whose source u and target v sit on the same device (or either is shared)."""
        per_device = self.towards(dev_b, devices)
        own = dev_a != SHARED
        placed = float(per_device[np.flatnonzero(own), dev_a[own]].sum())
        return placed if own.all() else placed + self.weight * float(self.scores[~own].sum())


Edges = dict[tuple[int, int], Edge]


def normalised_edges(affinity: Affinity, delay: float, delayed: tuple[int, ...] | None = None) -> Edges:
    """Ŝ for every edge δ needs (of the `delayed` modules; None: all); one line if an edge is
    missing or has no mass to normalise."""
    out: Edges = {}
    for a, b in affinity.require_edges(delay, delayed):
        s = np.asarray(affinity.edges[(a, b)], dtype=np.float64)
        want = (affinity.model.units(a), affinity.model.units(b))
        if s.shape != want:
            raise UserError(f"affinity edge.{a}.{b} has shape {list(s.shape)}, expected {list(want)}")
        # reductions, not elementwise masks (an N x N bool is 0.8 GB at 70B, δ = 2): a finite
        # sum has no NaN or inf in it, and only an overflowing one needs the elementwise test
        total = float(s.sum())
        if not np.isfinite(total) and not np.isfinite(s).all():
            raise UserError(f"affinity edge.{a}.{b} contains NaN or infinite values")
        if s.size and s.min() < 0:
            raise UserError(f"affinity edge.{a}.{b} has negative scores")
        if not total > 0:
            raise UserError(f"affinity edge.{a}.{b} has total mass 0 and cannot be normalised")
        out[(a, b)] = Edge(s, 1.0 / total)
    return out


def one_hot(dev: np.ndarray, devices: int) -> np.ndarray:
    """[units, L] float matrix with a 1 at each unit's device; a shared unit's row is all ones."""
    m = np.zeros((len(dev), devices))
    own = dev != SHARED
    m[np.flatnonzero(own), dev[own]] = 1.0
    m[~own] = 1.0
    return m


def layout_devices(layout: Layout) -> list[np.ndarray]:
    """devs[m]: the device of each original unit of module m."""
    return [layout.device(m) for m in range(2 * layout.layers)]


def perm_from_devices(dev: np.ndarray, devices: int) -> np.ndarray:
    """The permutation that puts device d's units in positions [d·U'/L, (d+1)·U'/L) of the U'
    sharded ones, and the shared units last.

    A stable sort keeps the original order inside each device, so an unchanged module
    (contiguous devices) gets back exactly the identity permutation.
    """
    key = np.where(dev == SHARED, devices, dev)  # shared last
    counts = np.bincount(key, minlength=devices + 1)[:devices]
    if (counts != counts.sum() // devices).any():
        raise ValueError(f"unbalanced device assignment: {counts.tolist()}")
    return np.argsort(key, kind="stable")


def j_of_devices(edges: Edges, devs: list[np.ndarray], devices: int) -> float:
    return float(sum(e.colocated(devs[a], devs[b], devices) for (a, b), e in edges.items()))


def blas_threads(edges: Edges) -> AbstractContextManager:
    """A context: one BLAS thread when every edge has a KV side (δ = 1), BLAS's own otherwise.

    Products of 8 x N scores with one-hot matrices are too small to share between threads,
    and on a loaded machine OpenBLAS's spinning threads take the cores the optimiser needs
    (docs/benchmarks.md, "the optimiser"); N x N edges (δ >= 2) do gain from threads.
    """
    skinny = all(min(e.scores.shape) <= 256 for e in edges.values())
    return threadpool_limits(limits=1 if skinny else None, user_api="blas")


def score_devices(edges: Edges, devs: list[np.ndarray], devices: int, layers: int) -> dict:
    """J with its parts: every edge's co-located fraction and, per layer, the up and down edge."""
    with blas_threads(edges):
        per_edge = {(a, b): e.colocated(devs[a], devs[b], devices) for (a, b), e in edges.items()}
    n_edges = len(per_edge)
    j = float(sum(per_edge.values()))
    per_layer = [{"layer": i,
                  "up": per_edge.get((2 * i, 2 * i + 1)),  # heads of layer i -> its neurons
                  "down": per_edge.get((2 * i + 1, 2 * i + 2))}  # neurons of i -> KV groups of i+1
                 for i in range(layers)]
    expectation = n_edges / devices
    return {
        "J": j,
        "n_edges": n_edges,
        "random_expectation": expectation,
        "max": float(n_edges),
        "ratio_to_random": j / expectation if n_edges else None,
        "devices": devices,
        "edges": [{"src": a, "dst": b, "colocated": v} for (a, b), v in sorted(per_edge.items())],
        "layers": per_layer,
    }


def colocated_score(affinity: Affinity, layout: Layout, where: str = "layout",
                    other: str = "the affinity file") -> dict:
    """J of `layout` under `affinity` at the layout's delay (refuses a mismatched model shape)."""
    layout.check_model(affinity.model, where=where, other=other)
    edges = normalised_edges(affinity, layout.delay, layout.delayed)
    out = score_devices(edges, layout_devices(layout), layout.devices, layout.layers)
    out["delay"] = layout.delay
    out["kind"] = layout.kind
    return out


def format_score(score: dict) -> str:
    lines = [f"J = {score['J']:.6f} over {score['n_edges']} edges (delay {score['delay']}, "
             f"L = {score['devices']}); random expectation {score['random_expectation']:.4f}, "
             f"max {score['max']:.0f}"]
    if score["n_edges"]:
        lines.append(f"J / random expectation = {score['ratio_to_random']:.4f}")
        lines.append("layer      up    down")
        for row in score["layers"]:
            up = "-" if row["up"] is None else f"{row['up']:.4f}"
            down = "-" if row["down"] is None else f"{row['down']:.4f}"
            lines.append(f"{row['layer']:5d}  {up:>6}  {down:>6}")
    return "\n".join(lines)


def score_file(affinity: Path, layout: Path) -> dict:
    """`dtpshard score`: J of the layout file under the affinity file, with its parts."""
    chosen = Layout.load(layout)
    return colocated_score(Affinity.load(affinity, delay=chosen.delay), chosen, where=f"layout {layout}",
                           other=f"the affinity file {affinity}")
