"""The report's PNG figures (matplotlib, Agg backend: no display needed), each written atomically.

- curves.png: KL and perplexity against step; per layout the seed mean bold and single seeds
  faint; random layouts grey.
- j_vs_kl.png: KL against the co-located score J untrained (step 0), mid-training and at the end,
  one point per layout, with the least-squares line, Pearson r and Spearman ρ; one y range for all.
- proxies.png: the trained layouts' KL at the end against J under each affinity proxy.
- up_edge.png: per layer, the co-located fraction of the up edge for each layout.
- head_start.png (when the experiment's [report] table gives steps): the KL gap over contiguous's
  KL and the multiplier at every evaluation (studies/compare.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dtpshard.core.io import atomic_path
from dtpshard.studies.adapters import draw_adapters
from dtpshard.studies.compare import head_start, rolling_median
from dtpshard.studies.delayed import draw_delayed
from dtpshard.studies.recipes import draw_recipes
from dtpshard.studies.seeds import MIN_LAYOUTS, seeded_random
from dtpshard.studies.shared import draw_shared
from dtpshard.studies.stats import correlate, mean_curve, rank_correlate
from dtpshard.studies.study import FIGURES, layout_kl, mid_step
from dtpshard.studies.study import distinct as distinct_layouts

if TYPE_CHECKING:
    from dtpshard.studies.study import LayoutInfo, Study

GREY = "#9a9a9a"
COLOURS = {"optimised": "#1f5fbf", "contiguous": "#d62728", "anti": "#7b3fa0", "heads-only": "#ff7f0e",
           "neurons-only": "#2ca02c"}
EXTRA = ["#17becf", "#8c564b", "#e377c2", "#bcbd22", "#393b79", "#637939"]
ORDER = ["optimised", "contiguous", "neurons-only", "heads-only", "anti"]


def colour(info: LayoutInfo, extra: dict[str, str]) -> str:
    if info.kind == "random":
        return GREY
    if info.kind in COLOURS:
        return COLOURS[info.kind]
    return extra.setdefault(info.kind, EXTRA[len(extra) % len(EXTRA)])


def _sorted(study: Study, distinct: bool = False) -> list[LayoutInfo]:
    """Random layouts first (drawn underneath), then the families in a fixed order; `distinct`:
    without layouts identical to another (one point per function in a correlation)."""
    rank = {k: i for i, k in enumerate(ORDER)}
    infos = distinct_layouts(study) if distinct else list(study.layouts.values())
    return sorted(infos, key=lambda i: (i.kind != "random", rank.get(i.kind, len(ORDER)), i.name))


def _save(fig, path: Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=130, bbox_inches="tight")
    return path


def draw_curves(study: Study, path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    trained = [i for i in _sorted(study) if i.runs]
    if not trained:
        return None
    extra: dict[str, str] = {}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    random_labelled = False
    for info in trained:
        c = colour(info, extra)
        rnd = info.kind == "random"
        for ax, attr in zip(axes, ("kl", "ppl")):
            curves = [getattr(r, attr) for r in info.runs]
            if len(curves) > 1:
                for cv in curves:
                    ax.plot(cv.steps, cv.values, color=c, lw=0.8, alpha=0.3)
            m = mean_curve(curves)
            label = None
            if ax is axes[0]:
                label = ("random" if not random_labelled else None) if rnd else info.name
            ax.plot(m.steps, m.values, color=c, lw=1.2 if rnd else 2.4, alpha=0.7 if rnd else 1.0,
                    label=label, zorder=1 if rnd else 3, marker=None if rnd else "o", ms=3)
        random_labelled |= rnd
    axes[0].set_ylabel("KL(dense ‖ student), nats / token")
    axes[1].set_ylabel("perplexity")
    for ax in axes:  # an untrained DTP student can start 10-100x above where it ends: log scale then
        ys = [y for line in ax.get_lines() for y in line.get_ydata()]
        if ys and min(ys) > 0 and max(ys) / min(ys) > 8:
            ax.set_yscale("log")
    log_steps = bool(study.config and study.config.report.log_steps)
    for ax, title in zip(axes, ("KL to the dense model", "perplexity")):
        if log_steps:  # step 0 has no place on a log axis: the curves start at the first evaluation after it
            ax.set_xscale("log")
            ax.set_xlim(left=min((s for r in study.runs for s in r.kl.steps if s > 0), default=1) * 0.9)
        ax.set_xlabel("optimizer step" + (" (log scale)" if log_steps else ""))
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, frameon=False)
    c = study.config
    fig.suptitle(f"distillation, L = {c.devices if c else '?'}, δ = {c.delay if c else '?'}",
                 fontsize=11)
    fig.tight_layout()
    out = _save(fig, path)
    plt.close(fig)
    return out


def draw_j_vs_kl(study: Study, path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    infos = [i for i in _sorted(study, distinct=True) if i.J is not None]
    if not infos:
        return None
    panels = [("untrained (step 0)", 0)]
    for step in (mid_step(study), study.steps) if study.steps > 0 else ():
        if any(layout_kl(i, step) is not None for i in infos):  # an unfinished study: no empty panels
            panels.append((f"step {step}", step))
    extra: dict[str, str] = {}
    # one y range for every panel, so training's shrinking of the KL is seen across them
    fig, axes = plt.subplots(1, len(panels), figsize=(4.3 * len(panels), 4), squeeze=False, sharex=True, sharey=True)
    for ax, (title, step) in zip(axes[0], panels):
        pts = [(i, layout_kl(i, step)) for i in infos]
        pts = [(i, y) for i, y in pts if y is not None]
        seen: set[str] = set()
        for i, y in pts:
            seeds = [r.kl.at(step) for r in i.runs]
            seeds = [v for v in seeds if v is not None]
            if len(seeds) > 1:  # several seeds: each faint, the mean ringed
                ax.scatter([i.J] * len(seeds), seeds, color=colour(i, extra), s=14, alpha=0.35, zorder=2)
                ax.scatter(i.J, y, facecolor="none", edgecolor="black", s=110, linewidth=0.8, zorder=2)
            lab = ("random" if i.kind == "random" else i.name)
            ax.scatter(i.J, y, color=colour(i, extra), s=36 if i.kind == "random" else 55, zorder=3,
                       label=None if lab in seen else lab, edgecolor="white", linewidth=0.6)
            seen.add(lab)
        fit = correlate([i.J for i, _ in pts], [y for _, y in pts])
        if fit.slope is not None and fit.n >= 3:  # a line through two points says nothing
            xs = [min(i.J for i, _ in pts), max(i.J for i, _ in pts)]
            ax.plot(xs, [fit.slope * x + fit.intercept for x in xs], color="black", lw=1, ls="--", zorder=2)
        rank = rank_correlate([i.J for i, _ in pts], [y for _, y in pts])
        r = "r n/a" if fit.r is None else f"Pearson r = {fit.r:+.2f}" + \
            ("" if rank.rho is None else f", Spearman ρ = {rank.rho:+.2f}")
        ax.set_title(f"{title}\n{r} ({fit.n} layouts)", fontsize=10)
        ax.set_xlabel("co-located score J")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("KL(dense ‖ student), nats / token")
    ys = [y for ax in axes[0] for c in ax.collections for y in c.get_offsets()[:, 1]]
    if ys and min(ys) > 0 and max(ys) / min(ys) > 4:  # untrained KL is far above trained: log keeps both readable
        axes[0][0].set_yscale("log")
    _legend(fig, axes[0], several_seeds=any(len(i.runs) > 1 for i in infos),
            line=any(ax.get_lines() for ax in axes[0]))
    out = _save(fig, path)
    plt.close(fig)
    return out


def _legend(fig, axes, several_seeds: bool, line: bool = True) -> None:
    """One legend for every panel (the untrained panel has layouts the others lack), with the
    markers explained: a filled dot per layout, faint dots for single seeds, rings for seed means."""
    from matplotlib.lines import Line2D

    handles: dict[str, object] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    handles["filled dot: one layout (seed mean where trained)"] = Line2D([], [], ls="", marker="o", color="#555555")
    if several_seeds:
        handles["faint dot: one training seed"] = Line2D([], [], ls="", marker="o", color="#555555", alpha=0.35, ms=4)
        handles["ring: the mean of several seeds"] = Line2D([], [], ls="", marker="o", mfc="none", mec="black", ms=10)
    if line:
        handles["dashed: least-squares line"] = Line2D([], [], ls="--", color="black", lw=1)
    fig.tight_layout()
    # below the panels (the saved image grows to hold it), as wide as they are
    fig.legend(list(handles.values()), list(handles), loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=max(1, min(len(handles), 2 * len(axes) - 1)), fontsize=8, frameon=False)


def draw_proxies(study: Study, path: Path) -> Path | None:
    """The trained layouts' seed-mean KL at the end against J under each proxy, one panel each."""
    import matplotlib.pyplot as plt

    end = study.steps
    pts = [(i, layout_kl(i, end)) for i in _sorted(study, distinct=True) if i.runs]
    pts = [(i, y) for i, y in pts if y is not None]
    proxies = [p for p in study.proxies if any(i.proxy_J.get(p) is not None for i, _ in pts)]
    if len(proxies) < 2 or len(pts) < 3:
        return None
    extra: dict[str, str] = {}
    fig, axes = plt.subplots(1, len(proxies), figsize=(4 * len(proxies), 4), squeeze=False, sharey=True)
    for ax, proxy in zip(axes[0], proxies):
        seen: set[str] = set()
        xy = [(i, i.proxy_J[proxy], y) for i, y in pts if i.proxy_J.get(proxy) is not None]
        for i, x, y in xy:
            lab = "random" if i.kind == "random" else i.name
            ax.scatter(x, y, color=colour(i, extra), s=36 if i.kind == "random" else 55, zorder=3,
                       label=None if lab in seen else lab, edgecolor="white", linewidth=0.6)
            seen.add(lab)
        fit = correlate([x for _, x, _ in xy], [y for _, _, y in xy])
        if fit.slope is not None and fit.n >= 3:
            xs = [min(x for _, x, _ in xy), max(x for _, x, _ in xy)]
            ax.plot(xs, [fit.slope * x + fit.intercept for x in xs], color="black", lw=1, ls="--", zorder=2)
        rank = rank_correlate([x for _, x, _ in xy], [y for _, _, y in xy])
        rho = "" if rank.rho is None else f", ρ = {rank.rho:+.2f}"
        ax.set_title(f"{proxy}\nPearson r = {fit.r:+.2f}{rho} ({fit.n} layouts)" if fit.r is not None else proxy,
                     fontsize=10)
        ax.set_xlabel(f"J under {proxy}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"KL at step {end} (seed mean), nats / token")
    _legend(fig, axes[0], several_seeds=False, line=any(ax.get_lines() for ax in axes[0]))
    out = _save(fig, path)
    plt.close(fig)
    return out


def draw_up_edge(study: Study, path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    infos = [i for i in _sorted(study) if any(u is not None for u in i.up)]
    if not infos:
        return None
    extra: dict[str, str] = {}
    fig, ax = plt.subplots(figsize=(9, 3.8))
    random_labelled = False
    for info in infos:
        rnd = info.kind == "random"
        xs = [k for k, u in enumerate(info.up) if u is not None]
        ys = [u for u in info.up if u is not None]
        ax.plot(xs, ys, color=colour(info, extra), lw=1 if rnd else 2, alpha=0.6 if rnd else 1,
                marker=None if rnd else "o", ms=3, label=(None if random_labelled else "random") if rnd else info.name)
        random_labelled |= rnd
    devices = study.config.devices if study.config else None
    if devices is not None:
        ax.axhline(1 / devices, color="black", lw=0.8, ls=":", label=f"1/L = {1 / devices:.2f}")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel("co-located fraction of the up edge")
    ax.set_title("heads of layer i → neurons of layer i: affinity kept on one device")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    out = _save(fig, path)
    plt.close(fig)
    return out


def draw_head_start(study: Study, path: Path) -> Path | None:
    """The gap as a fraction of contiguous's KL, and the multiplier with its rolling median of five,
    at every evaluation (only for an experiment whose [report] table asks for the head start)."""
    import matplotlib.pyplot as plt

    if not (study.config and study.config.report.steps):
        return None
    rows = head_start(study)
    if not rows:
        return None
    steps = [r.step for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(steps, [100 * r.fraction for r in rows], color=COLOURS["optimised"], marker="o", ms=3)
    axes[0].set_ylabel("gap / contiguous KL (%)")
    axes[0].set_title("KL gap, contiguous − optimised")
    axes[0].axhline(0, color=GREY, lw=0.8)
    mult = [r.multiplier for r in rows]
    axes[1].plot(steps, [m if m is not None else float("nan") for m in mult], color=COLOURS["optimised"], lw=0.8,
                 alpha=0.5, marker="o", ms=3, label="at each evaluation")
    axes[1].plot(steps, [m if m is not None else float("nan") for m in rolling_median(mult)],
                 color=COLOURS["optimised"], lw=2.2, label="rolling median of five")
    axes[1].axhline(1, color=GREY, lw=0.8)
    axes[1].set_ylabel("multiplier (steps saved, ×)")
    axes[1].set_title("contiguous's step / optimised's matching step")
    axes[1].legend(fontsize=8, frameon=False)
    for ax in axes:
        ax.set_xscale("log" if study.config.report.log_steps else "linear")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = _save(fig, path)
    plt.close(fig)
    return out


def draw_seeds(study: Study, path: Path) -> Path | None:
    """Each of those random layouts' final KL per seed against its J, the seed mean ringed."""
    import matplotlib.pyplot as plt

    seeded = seeded_random(study)
    if len(seeded) < MIN_LAYOUTS:
        return None
    fig, ax = plt.subplots(figsize=(6, 4.2))
    markers = "o^sDv<>"
    for info, kls in seeded:
        ax.plot([info.J, info.J], [min(kls), max(kls)], color="grey", lw=1, zorder=1)
        for s, v in enumerate(kls):
            ax.scatter(info.J, v, marker=markers[s % len(markers)], color=f"C{s}", s=30, zorder=3,
                       label=f"seed {s}" if info is seeded[0][0] else None)
        ax.scatter(info.J, sum(kls) / len(kls), facecolor="none", edgecolor="black", s=110, lw=0.9, zorder=2,
                   label="seed mean" if info is seeded[0][0] else None)
    ax.set_xlabel("co-located score J")
    ax.set_ylabel(f"KL at step {study.steps}, nats / token")
    ax.set_title(f"{len(seeded)} random layouts, each trained with several seeds", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    out = _save(fig, path)
    plt.close(fig)
    return out


def draw_all(study: Study, figures: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    figures.mkdir(parents=True, exist_ok=True)
    out = {}
    for key, fn in zip(FIGURES, (draw_curves, draw_j_vs_kl, draw_proxies, draw_up_edge, draw_head_start, draw_seeds,
                                 draw_adapters, draw_recipes, draw_shared, draw_delayed), strict=True):
        p = fn(study, figures / f"{key}.png")
        if p is not None:
            out[key] = p
    return out
