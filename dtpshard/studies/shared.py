"""The report's section on shared neurons (arms with `shared`, docs/design.md §6): what replicating
a slice of every FFN buys in KL against what it costs at decode.

Quality comes from the study's runs: each shared arm's step matching against the arm of the same
kind without sharing, and the optimised layout's head start over contiguous with and without
sharing. Cost comes from bench/bench_vllm.py --shared ... --json, its last line saved beside the
study as decode.json (the bench's own random model: decode cost depends on the shapes and the
fraction, not on which neurons are shared); without it the section says how to add it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError
from dtpshard.core.io import atomic_path
from dtpshard.core.reading import read_json
from dtpshard.studies.adapters import fmt_seeds
from dtpshard.studies.stats import Curve, is_number, is_rate, is_step, mean_curve, mean_sd, step_matching
from dtpshard.studies.study import Study

DECODE = "decode.json"  # bench/bench_vllm.py --json's rows, copied in by hand (not an experiment's output)


@dataclass
class SharedArm:
    layout: str
    kind: str  # the layout kind without the shared suffix: optimised, contiguous, ...
    fraction: float
    kl: Curve
    runs: int
    kl_end: list[float]


def bench_arm(fraction: float) -> str:
    """bench/bench_vllm.py's arm of a fraction (its shared_arm): dtp for 0, dtp_shared10 for 10%."""
    return "dtp" if not fraction else f"dtp_shared{100 * fraction:.4g}".replace(".", "_")


def arms(study: Study) -> list[SharedArm]:
    """Every trained layout of a study with shared arms (none without), by kind then fraction."""
    cfg = study.config
    if cfg is None or not any(s.shared for arm in cfg.arms for s in arm.layouts):
        return []
    end = float(study.steps)
    out = []
    for spec in (s for arm in cfg.arms for s in arm.layouts):
        info = study.layouts.get(spec.name)
        if info is None or not info.runs or any(a.layout == spec.name for a in out):
            continue
        ends = [v for v in (r.kl.at(end) for r in info.runs) if v is not None]
        out.append(SharedArm(spec.name, spec.kind, spec.shared, mean_curve([r.kl for r in info.runs]),
                             len(info.runs), ends))
    if not any(a.fraction for a in out):  # shared arms planned, none trained yet: nothing to compare
        return []
    return sorted(out, key=lambda a: (a.kind != "optimised", a.kind, a.fraction))


def decode_rows(study: Study) -> list[dict[str, Any]]:
    path = study.directory / DECODE
    if not path.is_file():
        return []
    rows = read_json(path, "bench/bench_vllm.py's JSON rows", 1 << 20)

    need = ("batch", "latency_ms", "tp_tok_s")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and _decode_row(r) for r in rows):
        raise UserError(f"{path}: not bench/bench_vllm.py's JSON rows (a list of rows with {', '.join(need)}: a "
                        "batch an integer >= 1, a latency finite and >= 0, every *_tok_s, *_rank_weights and "
                        "dtp_per_tp finite and > 0, a delayed share from 0 to 1)")
    return rows


def _decode_row(r: dict[str, Any]) -> bool:
    """One decode.json row, each number checked as what it measures (studies/stats.py)."""
    rates = [v for k, v in r.items() if k.endswith(("_tok_s", "_rank_weights")) or k == "dtp_per_tp"]
    delayed = r.get("delayed")
    return (is_step(r.get("batch")) and r["batch"] >= 1 and is_number(r.get("latency_ms")) and r["latency_ms"] >= 0
            and is_rate(r.get("tp_tok_s")) and all(map(is_rate, rates))
            and (delayed is None or is_number(delayed) and 0 <= delayed <= 1))


def shared_lines(study: Study, figures: dict[str, str]) -> list[str]:
    """The section, or nothing for an experiment without shared arms."""
    all_arms = arms(study)
    if not all_arms:
        return []
    end = float(study.steps)
    zero = {a.kind: a for a in all_arms if a.fraction == 0}
    out = ["## Shared neurons: what they buy", "",
           "Each layer's shared neurons are computed whole on every device and added at once (docs/design.md §6); "
           "the rest of the layout is made over the sharded neurons only. Step matching against the same kind "
           f"without sharing: the first step at which the arm's seed-mean curve reaches that arm's mean KL at step "
           f"{end:g} (× > 1: sharing saves steps).", "",
           f"| layout | shared | seeds | KL @ {end:g} | step reaching the unshared KL @ {end:g} (×) |",
           "|---|---:|---:|---:|---:|"]
    for a in all_arms:
        base = zero.get(a.kind)
        m = step_matching(a.kl, base.kl, end) if base is not None and a.fraction else None
        out.append(f"| {a.layout} | {a.fraction:.0%} | {a.runs} | {fmt_seeds(a.kl_end)} | "
                   f"{'–' if m is None else m.format()} |")
    out.append("")
    by = {(a.kind, a.fraction): a for a in all_arms}
    heads = []
    for f in sorted({a.fraction for a in all_arms}):
        opt, cont = by.get(("optimised", f)), by.get(("contiguous", f))
        if opt and cont:
            m = step_matching(opt.kl, cont.kl, end)
            heads.append(f"{f:.0%} shared: optimised reaches contiguous's step-{end:g} KL at step "
                         f"{'–' if m is None else m.format()}")
    if heads:
        out += ["The optimised layout's head start over contiguous: " + "; ".join(heads) + ".", ""]
    rows = decode_rows(study)
    if not rows:
        out += [f"No decode measurement: save the last line of `python bench/bench_vllm.py --tp L --batch 1 8 "
                f"--latency-ms 0 --shared {' '.join(f'{f:g}' for f in sorted({a.fraction for a in all_arms} - {0}))} "
                f"--json` as {DECODE} here and run `dtpshard report` again.", ""]
        return out
    fractions = sorted({a.fraction for a in all_arms})
    cols = [f for f in fractions if all(f"{bench_arm(f)}_tok_s" in r for r in rows)]  # rows may differ in keys
    out += ["What it costs at decode (bench/bench_vllm.py's random model in vLLM, its own shapes; decode tokens/s "
            f"and the ratio to the unshared student, from {DECODE}):", "",
            "| batch | latency ms | TP | " + " | ".join(f"{f:.0%} shared" for f in cols) + " |",
            "|---:|---:|---:|" + "---:|" * len(cols)]
    for r in rows:
        dtp = r.get("dtp_tok_s")
        cells = [f"{r[bench_arm(f) + '_tok_s']:.1f}" + ("" if not f or not dtp else
                                                       f" ({r[bench_arm(f) + '_tok_s'] / dtp:.3f}×)") for f in cols]
        out.append(f"| {r['batch']} | {r['latency_ms']:g} | {r['tp_tok_s']:.1f} | " + " | ".join(cells) + " |")
    weights = [f"{f:.0%} {rows[0][bench_arm(f) + '_rank_weights'] / 1e6:.1f} M" for f in cols
               if all(f"{bench_arm(f)}_rank_weights" in r for r in rows)]
    out += ["", "Weights a rank holds: " + ", ".join(weights) + "." if weights else "", ""]
    if "shared" in figures:
        out += [f"![KL at the last step against decode tokens/s]({figures['shared']})", "",
                f"One point per fraction of the optimised layout (seed mean ± sd of KL at step {end:g}); the dashed "
                "line is TP's decode rate (TP computes the dense function: KL 0).", ""]
    return out


def draw_shared(study: Study, path: Path) -> Path | None:
    """KL at the last step against decode tokens/s, one panel per batch at latency 0."""
    all_arms = [a for a in arms(study) if a.kind == "optimised" and a.kl_end]
    rows = [r for r in decode_rows(study) if r.get("latency_ms") == 0]
    if not all_arms or not rows:
        return None
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.8), squeeze=False)
    for ax, r in zip(axes[0], rows):
        for a in all_arms:
            key = f"{bench_arm(a.fraction)}_tok_s"
            if key not in r:
                continue
            m = mean_sd(a.kl_end)
            ax.errorbar(r[key], m.mean, yerr=m.sd or 0, fmt="o", capsize=3, color="C0" if a.fraction else "black")
            ax.annotate(f"{a.fraction:.0%}", (r[key], m.mean), textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.axvline(r["tp_tok_s"], color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"batch {r['batch']}, latency 0")
        ax.set_xlabel("decode tokens/s (vLLM)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"KL at step {study.steps}")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=130, bbox_inches="tight")
    plt.close(fig)
    return path
