"""The layout optimiser (docs/design.md §3): block coordinate ascent on the co-located score J.

With every other module fixed, J is linear in the device assignment of one module m: putting
unit u on device d is worth gain[u, d], the sum of u's normalised affinities to the units on d
of every module m shares an edge with (any δ, so several modules). A block update is therefore
a balanced assignment (U/L units per device) maximising Σ_u gain[u, dev(u)]: a transportation
problem, solved exactly by cycle cancelling on the L-device residual graph (see
layouts/assignment.py). Each accepted update is a block optimum, so J never decreases.

A shared layout (docs/design.md §6) fixes each layer's shared neurons before the ascent (chosen by
affinity mass, `choose_shared`); they sit on every device (SHARED), and only the sharded ones are
assigned, (N - n)/L per device.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dtpshard.affinity.file import Affinity
from dtpshard.core.errors import UserError
from dtpshard.core.layout import SHARED, Layout
from dtpshard.core.shape import UnitShape, check_delay, check_devices
from dtpshard.core.vocab import KV_SEARCHES, OPTIMISING_KINDS, KvSearch
from dtpshard.layouts.assignment import balanced_assignment
from dtpshard.layouts.score import (
    Edge,
    Edges,
    blas_threads,
    layout_devices,
    normalised_edges,
    one_hot,
    perm_from_devices,
    score_devices,
)

MAX_PARTITIONS = 200_000  # the exhaustive KV search is the paper's 2520 for G=8, L=4


# -- the KV side's exhaustive search --------------------------------------------------------
@functools.lru_cache(maxsize=8)
def labelled_partitions(n_units: int, devices: int) -> np.ndarray:
    """Every balanced assignment of n_units to labelled devices, as a [P, n_units] array."""
    per = n_units // devices
    count = math.factorial(n_units) // math.factorial(per) ** devices
    if count > MAX_PARTITIONS:
        raise UserError(f"exhaustive KV search over {count} labelled partitions of {n_units} groups "
                        f"on {devices} devices is too large (limit {MAX_PARTITIONS}); use the exact assignment")
    out: list[list[int]] = []

    def rec(prefix: list[int], left: list[int]) -> None:
        if len(prefix) == n_units:
            out.append(list(prefix))
            return
        for d in range(devices):
            if left[d]:
                left[d] -= 1
                prefix.append(d)
                rec(prefix, left)
                prefix.pop()
                left[d] += 1

    rec([], [per] * devices)
    parts = np.asarray(out, dtype=np.int64).reshape(-1, n_units)
    parts.flags.writeable = False  # cached and shared between calls
    return parts


def exhaustive_assignment(gain: np.ndarray, devices: int, start: np.ndarray | None = None) -> np.ndarray:
    """The paper's KV search: try every labelled balanced partition, keep the best.

    `start` is kept unless something beats it by more than rounding, as in the exact solver.
    """
    parts = labelled_partitions(gain.shape[0], devices)
    values = gain[np.arange(gain.shape[0]), parts].sum(axis=1)
    pick = parts[int(values.argmax())]
    if start is not None:
        tol = 1e-12 * max(float(np.abs(gain).max()), 1e-300) * gain.shape[0]
        if values.max() <= gain[np.arange(gain.shape[0]), start].sum() + tol:
            return np.array(start, dtype=np.int64)
    return pick.copy()


# -- block coordinate ascent ------------------------------------------------------------------
@dataclass
class Problem:
    """Normalised edges, and for each module the edges it is an end of (which end, partner)."""
    model: UnitShape
    devices: int
    delay: float
    edges: Edges
    partners: dict[int, list[tuple[bool, int, Edge]]] = field(default_factory=dict)
    shared: list[np.ndarray] | None = None  # per layer, the shared neurons (docs/design.md §6), fixed
    # (edge, end) -> (partner devices, product): see `_mass`
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, affinity: Affinity, devices: int, delay: float,
              shared: list[np.ndarray] | None = None, delayed: tuple[int, ...] | None = None) -> Problem:
        """`delayed`: only these modules' edges (a plain module changes nothing a layout could place)."""
        check_devices(affinity.model, devices, where="affinity model", shared=0 if shared is None else len(shared[0]))
        edges = normalised_edges(affinity, delay, delayed)
        partners: dict[int, list[tuple[bool, int, Edge]]] = {}
        for (a, b), e in edges.items():  # both ends see the edge: a through rows, b through columns
            partners.setdefault(a, []).append((True, b, e))
            partners.setdefault(b, []).append((False, a, e))
        return cls(affinity.model, devices, delay, edges, partners, shared)

    @property
    def modules(self) -> int:
        return self.model.modules

    def _mass(self, e: Edge, is_source: bool, partner_dev: np.ndarray) -> np.ndarray:
        """e.towards(partner_dev) (is_source) or e.back(partner_dev), kept between calls.

        Reading a whole N x N edge (δ ≥ 2) for every block update is what costs; in later
        sweeps few units move, so we update the cached product through the moved units only
        (a few rows or columns), and recompute it whole when many moved.
        """
        key = (id(e), is_source)
        hit = self._cache.get(key)
        if hit is not None:
            old, prod = hit
            moved = np.flatnonzero(old != partner_dev)
            if len(moved) == 0:
                return prod
            if 8 * len(moved) < len(partner_dev):
                change = one_hot(partner_dev[moved], self.devices) - one_hot(old[moved], self.devices)
                prod = prod.copy()
                step = max(1, 2 ** 25 // len(prod))  # gathered columns in chunks of <= 256 MB
                for lo in range(0, len(moved), step):
                    cols = moved[lo:lo + step]
                    part = e.scores[:, cols] if is_source else e.scores[cols, :].T
                    prod += e.weight * (part @ change[lo:lo + step])
                self._cache[key] = (partner_dev.copy(), prod)
                return prod
        prod = e.towards(partner_dev, self.devices) if is_source else e.back(partner_dev, self.devices)
        self._cache[key] = (partner_dev.copy(), prod)
        return prod

    def block_gain(self, devs: list[np.ndarray], m: int) -> np.ndarray:
        """gain[u, d]: J gained by unit u of module m being on device d, all else fixed."""
        g = np.zeros((self.model.units(m), self.devices))
        for is_source, other, e in self.partners.get(m, []):
            g += self._mass(e, is_source, devs[other])
        return g

    def contiguous(self) -> list[np.ndarray]:
        """Each module's units on devices in order; a layer's shared neurons SHARED, the rest in order."""
        out = []
        for m in range(self.modules):
            units = self.model.units(m)
            dev = np.full(units, SHARED)
            own = np.ones(units, dtype=bool)
            if m % 2 and self.shared is not None:
                own[self.shared[m // 2]] = False
            dev[own] = np.arange(int(own.sum())) // (int(own.sum()) // self.devices)
            out.append(dev)
        return out

    def j(self, devs: list[np.ndarray]) -> float:
        """J through the cached products (the final score is recomputed from scratch)."""
        return float(sum(self._mass(e, True, devs[b])[np.arange(len(devs[a])), devs[a]].sum()
                         for (a, b), e in self.edges.items()))


def ascend(problem: Problem, devs: list[np.ndarray], blocks: list[int], maximise: bool = True,
           kv_search: KvSearch = "assignment", max_sweeps: int = 20, min_gain: float = 1e-9):
    """Sweep the blocks until a sweep changes J by less than min_gain or max_sweeps is reached.

    Returns (devs, J history per sweep, starting with the start's J). With maximise=False
    every block minimises instead (the anti-optimised layout), by maximising -gain.
    """
    devs = [d.copy() for d in devs]
    sign = 1.0 if maximise else -1.0
    with blas_threads(problem.edges):
        history = [problem.j(devs)]
        for _ in range(max_sweeps):
            for m in blocks:
                gain = sign * problem.block_gain(devs, m)
                if m % 2 == 0 and kv_search == "exhaustive":
                    devs[m] = exhaustive_assignment(gain, problem.devices, start=devs[m])
                else:  # the sharded units only: a shared neuron stays on every device
                    own = np.flatnonzero(devs[m] != SHARED)
                    devs[m][own] = balanced_assignment(gain[own], problem.devices, start=devs[m][own])
            history.append(problem.j(devs))
            if sign * (history[-1] - history[-2]) < min_gain:
                break
    return devs, history


def evenly_spaced_layers(n_layers: int, k: int) -> list[int]:
    """The paper's k-layer ablation: layers round(j·n/k) for j < k (always layer 0)."""
    if not 1 <= k <= n_layers:
        raise UserError(f"--layers {k}: must be between 1 and the number of layers ({n_layers})")
    return sorted({int(round(j * n_layers / k)) for j in range(k)})


def family_blocks(kind: str, n_layers: int, layers: list[int] | None = None) -> list[int]:
    """Modules a family optimises; the rest stay contiguous. Neurons first in each sweep:
    the paper starts from contiguous heads and places neurons against them."""
    chosen = list(range(n_layers)) if layers is None else layers
    ffn = [2 * i + 1 for i in chosen] if kind != "heads-only" else []
    kv = [2 * i for i in chosen] if kind != "neurons-only" else []
    return ffn + kv


def _random_start(problem: Problem, blocks: list[int], rng: np.random.Generator) -> list[np.ndarray]:
    devs = problem.contiguous()
    for m in blocks:
        own = devs[m] != SHARED
        devs[m][own] = rng.permutation(devs[m][own])
    return devs


def to_layout(problem: Problem, devs: list[np.ndarray], kind: str, seed: int | None = None,
              shared_by: str | None = None) -> Layout:
    layout = Layout.from_module_perms(problem.model, problem.devices, problem.delay, kind,
                                      [perm_from_devices(d, problem.devices) for d in devs], seed=seed,
                                      shared=0 if problem.shared is None else len(problem.shared[0]))
    return layout.with_shared(layout.shared, shared_by)


def choose_shared(affinity: Affinity, count: int, by: str) -> list[np.ndarray]:
    """Each layer's `count` shared neurons (docs/design.md §6), the highest by affinity mass: "fo"
    the up edge's column mass (how much the layer's heads feed each neuron), "dn" the down edge's
    row mass (how much the next layer's q/k/v read from each), fo on the last layer, which has no
    down edge. Ties keep the lower index. Sorted, as a layout stores them."""
    out = []
    for i in range(affinity.model.layers):
        down = (2 * i + 1, 2 * i + 2)
        if by == "dn" and down in affinity.edges:
            mass = np.asarray(affinity.edges[down], dtype=np.float64).sum(1)
        else:
            up = (2 * i, 2 * i + 1)
            if up not in affinity.edges:
                raise UserError(f"--shared-by {by}: the affinity file has no up edge of layer {i} to rank neurons by")
            mass = np.asarray(affinity.edges[up], dtype=np.float64).sum(0)
        out.append(np.sort(np.argsort(-mass, kind="stable")[:count]))
    return out


def optimise_layout(affinity: Affinity, devices: int, delay: float, kind: str = "optimised",
                    layers: int | None = None, restarts: int = 1, seed: int = 0,
                    kv_search: KvSearch = "assignment", max_sweeps: int = 20,
                    shared: list[np.ndarray] | None = None, shared_by: str | None = None,
                    delayed: tuple[int, ...] | None = None, start: Layout | None = None) -> Layout:
    """A layout of optimising family `kind`, scored, the best of `restarts` starts (contiguous and
    random layouts are made, and scored, by dtpshard.layouts.make.make_layout).

    The first start is contiguous (the paper's); later ones are random permutations of the
    optimised blocks, seeded by `seed`. `layers` = k restricts optimisation to k evenly spaced
    layers. The layout's `score` records J, its parts, the random expectation and the time.
    `delayed`: the modules the layout is for (None: all); J counts only their edges, and a module in
    no edge keeps its start. `start`: a layout the first start is instead (a partial student's
    layout refines the full one's, layouts/delayed.py).
    """
    if kind not in OPTIMISING_KINDS:
        raise UserError(f"kind {kind!r}: optimise_layout makes one of {', '.join(OPTIMISING_KINDS)}")
    if restarts < 1:
        raise UserError(f"--restarts {restarts}: must be at least 1")
    if kv_search not in KV_SEARCHES:
        raise UserError(f"--kv-search {kv_search!r}: one of assignment, exhaustive")
    if max_sweeps < 1:
        raise UserError(f"--max-sweeps {max_sweeps}: must be at least 1")
    check_delay(affinity.model, delay)
    t0 = time.perf_counter()
    problem = Problem.build(affinity, devices, delay, shared, delayed)
    n = problem.model.layers
    chosen = evenly_spaced_layers(n, layers) if layers is not None else None
    if kv_search == "exhaustive" and kind in ("optimised", "anti", "heads-only"):
        labelled_partitions(problem.model.kv_groups, devices)  # refuse a too-large search up front
    blocks = family_blocks(kind, n, chosen)
    maximise = kind != "anti"
    rng = np.random.default_rng(seed)
    best = None
    for r in range(restarts):
        if r == 0:
            first = problem.contiguous() if start is None else [d.copy() for d in layout_devices(start)]
        else:
            first = _random_start(problem, blocks, rng)
        devs_r, hist_r = ascend(problem, first, blocks, maximise, kv_search, max_sweeps)
        if best is None or (hist_r[-1] > best[1][-1] if maximise else hist_r[-1] < best[1][-1]):
            best = (devs_r, hist_r, r)
    devs, history, best_restart = best
    layout = to_layout(problem, devs, kind if chosen is None else f"{kind}-layers-{layers}",
                       seed=seed if restarts > 1 else None, shared_by=shared_by)
    layout.delayed = delayed
    layout.score = score_record(problem, devs, kind, time.perf_counter() - t0, history, restarts, best_restart,
                                kv_search, chosen)
    return layout


def score_record(problem: Problem, devs: Any, kind: str, seconds: float, history: list[float], restarts: int,
                 best_restart: int | None, kv_search: str, chosen: list[int] | None) -> dict[str, Any]:
    """A layout file's `score`: J, its parts, the random expectation and how it was found."""
    n = problem.model.layers
    score = score_devices(problem.edges, devs, problem.devices, n)
    return {
        "J": score["J"], "n_edges": score["n_edges"], "random_expectation": score["random_expectation"],
        "ratio_to_random": score["ratio_to_random"], "seconds": seconds, "kind": kind,
        "sweeps": max(len(history) - 1, 0), "history": history, "restarts": restarts,
        "best_restart": best_restart, "kv_search": kv_search,
        "optimised_layers": chosen if chosen is not None else (list(range(n)) if history else []),
        "layers": score["layers"], "edges": score["edges"],  # a report's co-located fraction per edge kind
    }
