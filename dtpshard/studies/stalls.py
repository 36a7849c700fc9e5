"""Layouts that stall: which runs training left far above the rest, whether J saw it coming, J
against the trained KL without them, and whether a stall belongs to the layout or to its training.

The rule (written in the report): a run stalls when its KL at the last step is more than
STALL_KEPT of its KL at step 0, i.e. training removed less than half of the untrained student's
KL. A layout stalls when one of its runs does. Whether J predicted a stall: the stalled layout's J
is below that of every layout that trained normally. Whether the stall is the layout's or its
training's: a layout trained with several seeds that stalls with every one of them stalls by its
layout; one that stalls with some seeds only, by its training; with one seed it cannot be told.
"""
from __future__ import annotations

from dataclasses import dataclass

from dtpshard.studies.stats import bootstrap_pearson, correlate, mean_sd, rank_correlate
from dtpshard.studies.study import EDGE_KINDS, LayoutInfo, Run, Study, distinct, layout_kl, mid_step

STALL_KEPT = 0.5


def kept(run: Run, steps: int) -> float | None:
    """The share of its step-0 KL a run still has at the last step (None: not evaluated at both)."""
    start, end = run.kl.at(0), run.kl.at(steps)
    return None if start is None or end is None or start <= 0 else end / start


def stalls(run: Run, steps: int) -> bool:
    k = kept(run, steps)
    return k is not None and k > STALL_KEPT


@dataclass(frozen=True)
class Stall:
    layout: LayoutInfo
    stalled: list[Run]  # its runs that stall
    judged: list[Run]  # its runs evaluated at step 0 and at the end
    j_rank: int  # of its J among the trained layouts, 1 = highest
    kl_rank: int  # of its seed-mean KL at the end, 1 = lowest
    lower_normal: list[str]  # layouts that trained normally with a lower J than its

    @property
    def verdict(self) -> str:
        n, k, name = len(self.judged), len(self.stalled), self.layout.name
        if n < 2:
            return f"{name} was trained with one seed: its layout and its training cannot be told apart."
        if k == n:
            return f"{name} stalls with all {n} of its training seeds: a property of its layout."
        return (f"{name} stalls with {k} of its {n} training seeds: a property of its training (the seed), not of its "
                "layout alone.")


def _trained(study: Study) -> list[tuple[LayoutInfo, float]]:
    pts = [(i, layout_kl(i, study.steps)) for i in distinct(study) if i.J is not None]
    return [(i, y) for i, y in pts if y is not None]


def find_stalls(study: Study) -> list[Stall]:
    trained = _trained(study)
    by_j = sorted(trained, key=lambda t: -t[0].J)
    by_kl = sorted(trained, key=lambda t: t[1])
    stalled = {i.name for i, _ in trained if any(stalls(r, study.steps) for r in i.runs)}
    out = []
    for info, _ in by_j:
        if info.name not in stalled:
            continue
        judged = [r for r in info.runs if kept(r, study.steps) is not None]
        lower = [i.name for i, _ in trained if i.name not in stalled and i.J < info.J]
        out.append(Stall(info, [r for r in judged if stalls(r, study.steps)], judged,
                         [i.name for i, _ in by_j].index(info.name) + 1,
                         [i.name for i, _ in by_kl].index(info.name) + 1, lower))
    return out


def _correlation(infos: list[LayoutInfo], step: int, label: str) -> str:
    xs, ys = [i.J for i in infos], [layout_kl(i, step) for i in infos]
    fit, ci, rank = correlate(xs, ys), bootstrap_pearson(xs, ys), rank_correlate(xs, ys)
    if fit.r is None:
        return f"- KL {label} against J over {fit.n} layouts: n/a (fewer than 3 layouts)"
    rho = "" if rank.rho is None else f"; Spearman ρ = {rank.rho:+.3f} (p = {rank.p:.2g})"
    return (f"- KL {label} against J over {fit.n} layouts: Pearson r = {fit.r:+.3f} (p = {fit.p:.2g}"
            + (f", bootstrap 95% CI {ci.format()})" if ci else ")") + rho)


def _rank(value: float, others: list[float]) -> int:  # 1 = highest
    return 1 + sum(v > value for v in others)


def layout_vs_group(study: Study, info: LayoutInfo) -> list[str]:
    """A stalled layout's J, zero-shot KL and co-located fraction per edge kind against the other
    layouts of its group (the other random layouts, say); [] when it has no such company."""
    peers = [i for i in distinct(study) if i.kind == info.kind and i.name != info.name]
    if len(peers) < 2:
        return []
    kinds = [k for k in EDGE_KINDS if k in info.edge_fractions]
    cols: list[tuple[str, float | None, list[float]]] = [
        ("J", info.J, [i.J for i in peers if i.J is not None]),
        ("zero-shot KL", info.zero_kl, [i.zero_kl for i in peers if i.zero_kl is not None]),
        *((f"{k} co-located", info.edge_fractions[k], [i.edge_fractions[k] for i in peers if k in i.edge_fractions])
          for k in kinds)]
    cols = [c for c in cols if c[1] is not None and c[2]]
    digits = {"J": 4, "zero-shot KL": 4}

    def f(v: float, name: str) -> str:
        return f"{v:.{digits.get(name, 4)}f}"

    out = [f"| {info.kind} layout | " + " | ".join(c[0] for c in cols) + " |", "|---|" + "---|" * len(cols),
           f"| {info.name} | " + " | ".join(f(v, n) for n, v, _ in cols) + " |"]
    stats = [mean_sd(vs) for _, _, vs in cols]
    out.append(f"| the other {len(peers)}: mean ± sd | " + " | ".join(s.format(4) for s in stats) + " |")
    out.append(f"| the other {len(peers)}: min–max | "
               + " | ".join(f"{f(min(vs), n)}–{f(max(vs), n)}" for n, _, vs in cols) + " |")
    z = [("–" if s.sd in (None, 0) else f"{(v - s.mean) / s.sd:+.2f}") for (_, v, _), s in zip(cols, stats)]
    out.append(f"| {info.name}: (value − mean) / sd | " + " | ".join(z) + " |")
    out.append(f"| {info.name}: rank of {len(peers) + 1} (1 = highest) | "
               + " | ".join(str(_rank(v, vs)) for _, v, vs in cols) + " |")
    return out


def stall_lines(study: Study) -> list[str]:
    trained = _trained(study)
    if len(trained) < 3:
        return []
    found = find_stalls(study)
    end = study.steps
    out = ["## Layouts that stall", "",
           f"The rule: a run stalls when its KL at step {end} is more than {STALL_KEPT:.0%} of its KL at step 0 "
           "(training removed less than half of the untrained student's KL); a layout stalls when one of its runs "
           "does. J predicted a stall when the stalled layout's J is below that of every layout that trained "
           f"normally. Ranks are among the {len(trained)} trained distinct layouts.", ""]
    if not found:
        out += ["No run stalls.", ""]
    else:
        out += [f"| layout | kind | stalled runs | KL@0 → KL@{end} (kept) | J | J rank (1 = highest) | "
                f"KL@{end} rank (1 = lowest) | J predicted it |", "|---|---|---|---|---|---|---|---|"]
        for s in found:
            runs = "; ".join(f"{r.name} {r.kl.at(0):.3f} → {r.kl.at(end):.3f} ({kept(r, end):.0%})" for r in s.judged)
            n = len(s.lower_normal)
            pred = "yes" if not n else (f"no ({n} layout{'s' * (n > 1)} that trained normally "
                                        f"{'have' if n > 1 else 'has'} a lower J: {', '.join(s.lower_normal)})")
            out.append(f"| {s.layout.name} | {s.layout.kind} | {len(s.stalled)} of {len(s.judged)} | {runs} | "
                       f"{s.layout.J:.4f} | {s.j_rank} | {s.kl_rank} | {pred} |")
        out.append("")
    excluded = {s.layout.name for s in found} | {i.name for i, _ in trained if i.kind == "anti"}
    if excluded:
        rest = [i for i, _ in trained if i.name not in excluded]
        out += [f"J against the trained KL without {', '.join(sorted(excluded))}:", "",
                _correlation(rest, mid_step(study), f"step {mid_step(study)}"),
                _correlation(rest, end, f"step {end}"), ""]
    for s in found:
        table = layout_vs_group(study, s.layout)
        if not table and len(s.judged) < 2:  # neither a second seed nor other layouts of its kind to tell
            continue
        out += [f"### {s.layout.name}: its layout or its training?", "", s.verdict]
        if table:
            out += ["Its layout against the other layouts of its group (co-located fraction: the mean over the edges "
                    "of a kind of the share of an edge's normalised affinity whose two units share a device):", "",
                    *table]
        out.append("")
    return out
