"""Exact balanced assignment (docs/design.md §3): the optimiser's block update.

Maximise Σ_u gain[u, dev(u)] over the assignments of U units to L devices, U/L units each: a
transportation problem with L sinks, solved exactly by cycle cancelling on the L-device
residual graph, started from the device prices (LP duals) found by Gauss-Seidel when the
given start is far from the optimum. numpy only: at the 70B shape (U = 28672, L = 8) a dense
[U, U] linear assignment would not fit in memory, and L is small.
"""
from __future__ import annotations

import numpy as np

PRICE_AFTER = 4  # cycles cancelled from the given start before trying the price start


def _positive_cycle(best: np.ndarray, tol: float) -> tuple[list[int] | None, np.ndarray]:
    """A cycle of devices d0 -> d1 -> ... -> d0 whose best single moves gain > 0, or None,
    with the Bellman-Ford distances.

    Bellman-Ford for longest paths from a virtual source joined to every device. Any cycle
    in the predecessor graph is a positive cycle, so we stop at the first one we see; if
    L + 1 passes relax nothing, no positive cycle exists (the optimality certificate), and
    then dist[e] >= dist[d] + best[d, e] - tol: dist are optimal device prices (LP duals).
    """
    n = len(best)
    dist = np.zeros(n)
    pred = np.full(n, -1)
    for _ in range(n + 1):
        cand = dist[:, None] + best  # cand[d, e]: reach e through d
        src = cand.argmax(axis=0)
        val = cand[src, np.arange(n)]
        better = val > dist + tol
        if not better.any():
            return None, dist
        dist[better] = val[better]
        pred[better] = src[better]
        for start in np.flatnonzero(better):
            seen: dict[int, int] = {}
            v, k = int(start), 0
            while v >= 0 and v not in seen:
                seen[v] = k
                v, k = int(pred[v]), k + 1
            if v >= 0:  # walked back into a cycle: read it forwards
                cyc = [v]
                u = int(pred[v])
                while u != v:
                    cyc.append(u)
                    u = int(pred[u])
                return cyc[::-1], dist
    raise AssertionError("Bellman-Ford kept relaxing without a predecessor cycle")


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first (ties by index, as a stable sort)."""
    if k >= len(values):
        return np.argsort(-values, kind="stable")
    idx = np.argpartition(-values, k - 1)[:k]
    return idx[np.argsort(-values[idx], kind="stable")]


def _rowwise_argmax(rows: np.ndarray) -> np.ndarray:
    """argmax over the L rows of an [L, U] array (first on ties), in L passes over U, which is
    faster than numpy's own argmax along a short axis (docs/benchmarks.md, "the optimiser")."""
    top = rows.max(axis=0)
    arg = np.full(rows.shape[1], len(rows) - 1)
    for d in range(len(rows) - 2, -1, -1):
        arg = np.where(rows[d] == top, d, arg)
    return arg


def price_start(gain: np.ndarray, per: int, rounds: int = 8) -> np.ndarray:
    """A near-optimal balanced assignment from device prices p (the LP dual); not certified.

    Given p, sending every unit to its argmax of gain - p is optimal for the device counts it
    produces, so prices that balance the counts solve the problem. Gauss-Seidel on the dual:
    set p_d so that exactly `per` units prefer d, device after device, until the counts
    balance (4-6 rounds from p = 0 on the 70B-shaped benchmark; the last solve's prices are no
    better a start, as the neighbours' devices get relabelled in between). Whatever is still
    unbalanced (ties, or `rounds` ran out) goes to the short devices by the best released
    units; `assign` then makes the result exact.
    """
    n_units, devices = gain.shape
    rows = np.ascontiguousarray(gain.T)
    p, step = np.zeros(devices), np.full(devices, np.inf)
    reduced = rows.copy()
    after = np.full((devices + 1, n_units), -np.inf)
    for _ in range(rounds):
        # rows after d are untouched until step d of this round, so their maxima hold
        for d in range(devices - 1, -1, -1):
            np.maximum(after[d + 1], reduced[d], out=after[d])
        before = np.full(n_units, -np.inf)
        for d in range(devices):
            lead = rows[d] - np.maximum(before, after[d + 1])  # u prefers d iff lead[u] > p_d
            near = lead[lead > p[d] - 2 * step[d]]  # prices settle: select among the few near p_d
            if len(near) <= per:
                near = lead
            part = np.partition(near, len(near) - per)
            new = 0.5 * (part[len(near) - per] + part[:len(near) - per].max())
            step[d], p[d] = abs(new - p[d]), new
            reduced[d] = rows[d] - p[d]
            np.maximum(before, reduced[d], out=before)
        dev = _rowwise_argmax(reduced)
        counts = np.bincount(dev, minlength=devices)
        if (counts == per).all():
            return dev
    reduced = reduced.T
    for d in np.flatnonzero(counts > per):  # release the weakest extras of every long device
        on = np.flatnonzero(dev == d)
        margin = reduced[on, d] - np.delete(reduced[on], d, axis=1).max(axis=1)
        dev[on[np.argsort(margin, kind="stable")[:counts[d] - per]]] = -1
    for e in np.flatnonzero(counts < per):  # short devices take the best released units
        free = np.flatnonzero(dev < 0)
        dev[free[_top(reduced[free, e], per - int(counts[e]))]] = e
    return dev


def balanced_assignment(gain: np.ndarray, devices: int, start: np.ndarray | None = None) -> np.ndarray:
    """Exact maximiser of Σ_u gain[u, dev(u)] subject to U/L units on every device."""
    return assign(gain, devices, start)[0]


def assign(gain: np.ndarray, devices: int, start: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`balanced_assignment` and its certificate: (dev, p) with p optimal device prices.

    The problem is a min-cost flow (units -> devices). A balanced assignment is optimal iff
    its residual graph has no positive cycle; every such cycle alternates devices and units,
    so it suffices to look at the L-node graph whose edge d -> e carries the best gain of
    moving one unit from d to e. While a positive cycle exists, we push the largest batch of
    units around it that still gains (the per-edge gains, sorted, are non-increasing, so the
    batch stops at the first non-positive marginal sum). Moves along a simple cycle keep the
    balance and touch distinct units, and the objective is separable, so the gain is exact.
    Terminates (strict gain, finitely many assignments) with the certificate above, up to
    rounding (`tol` is 1e-12 of the largest |gain|). The returned prices p put every unit on
    an argmax of gain - p to within tol: LP duality's certificate of the same optimum.

    An optimal `start` is kept. Cancelling from a start far from the optimum is slow (a cold
    70B block: ~140 cycles), so after PRICE_AFTER cycles the `price_start` replaces the
    current assignment when it is better, which leaves a few cycles. A balanced assignment is
    held as an [L, U/L] table (device d holds members[d]); a cycle move refills the slots it
    empties, so only those rows of `delta` are recomputed and only each batch's top gains
    are sorted.
    """
    gain = np.asarray(gain, dtype=np.float64)
    n_units, n_dev = gain.shape
    if n_dev != devices or n_units % devices:
        raise ValueError(f"gain {gain.shape} cannot be split evenly over {devices} devices")
    per = n_units // devices
    dev = (np.arange(n_units) // per) if start is None else np.array(start, dtype=np.int64)
    if (np.bincount(dev, minlength=devices) != per).any():
        raise ValueError("start assignment is not balanced")
    scale = float(np.abs(gain).max()) if gain.size else 0.0
    if devices == 1 or scale == 0.0:
        return dev, np.zeros(devices)
    tol = 1e-12 * scale
    here, rows = np.arange(devices), np.arange(n_units)

    def table(dev: np.ndarray):
        small = dev.astype(np.int16) if devices < 2 ** 15 else dev  # 16-bit keys: a radix sort
        members = np.argsort(small, kind="stable").reshape(devices, per)
        # delta[d, e, s]: gain of moving the unit in slot s of device d to device e
        delta = gain[members].transpose(0, 2, 1) - gain[members, here[:, None]][:, None, :]
        return members, delta, delta.max(axis=2)

    def devices_of(members: np.ndarray) -> np.ndarray:
        out = np.empty(n_units, dtype=np.int64)
        out[members] = here[:, None]
        return out

    members, delta, best = table(dev)
    cycles = 0
    while True:
        graph = best.copy()
        np.fill_diagonal(graph, -np.inf)
        cycle, dist = _positive_cycle(graph, tol)
        if cycle is None:
            return devices_of(members), dist
        cycles += 1
        if cycles == PRICE_AFTER and per > 1:
            priced = price_start(gain, per)
            if gain[rows, priced].sum() > gain[rows, devices_of(members)].sum() + tol:
                members, delta, best = table(priced)
                continue
        hops = list(zip(cycle, cycle[1:] + cycle[:1]))
        k = min(per, 32)
        while True:  # widen the sorted prefix until the batch ends inside it
            slots = [_top(delta[d, e], k) for d, e in hops]
            marginal = np.sum([delta[d, e, s] for (d, e), s in zip(hops, slots)], axis=0)
            stop = marginal <= tol
            if stop.any() or k == per:
                break
            k = min(per, 4 * k)
        batch = int(np.argmax(stop)) if stop.any() else per
        if batch == 0:  # the cycle's gain is below rounding: optimal to within tol
            return devices_of(members), dist
        movers = [members[d, s[:batch]] for (d, _), s in zip(hops, slots)]
        for i, ((d, _), s) in enumerate(zip(hops, slots)):
            incoming = movers[i - 1]  # the previous hop ends at d
            members[d, s[:batch]] = incoming
            delta[d][:, s[:batch]] = (gain[incoming] - gain[incoming, d][:, None]).T
            best[d] = delta[d].max(axis=1)
