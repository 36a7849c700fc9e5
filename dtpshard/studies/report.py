"""`dtpshard report DIR`: the Markdown report of an experiment directory, with PNG figures.

Reads what `dtpshard experiment` writes (see experiment.py and study.py): config.json,
layouts/*.json (J and its per-layer parts), zeroshot.json (step-0 KL per layout), scores.json (J
under each proxy), timings.json, provenance.json and runs/NAME-sSEED/metrics.jsonl (and the first
run's config.json, for the data sources).
Works on a partial experiment too (unfinished runs are marked and used up to their last
evaluation). Writes DIR/report.md and DIR/figures/*.png, each atomically.

Numbers follow docs/design.md §5: a group is a layout kind (the random layouts form one group);
its KL and perplexity are the mean ± sample sd over every run of the group (seeds, or random
layouts), read off the evaluation curves at the middle and at the end of training by linear
interpolation. Step matching compares the optimised and contiguous groups' mean KL curves.
"""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError
from dtpshard.core.guard import check_outputs
from dtpshard.core.io import atomic_write_text
from dtpshard.core.owned import MARK, is_ours
from dtpshard.studies import provenance as p
from dtpshard.studies.adapters import adapter_lines
from dtpshard.studies.compare import optional_sections
from dtpshard.studies.delayed import delayed_lines
from dtpshard.studies.dominance import dominance_lines
from dtpshard.studies.downstream import report_lines
from dtpshard.studies.figures import draw_all
from dtpshard.studies.recipes import recipe_lines
from dtpshard.studies.seeds import seed_lines
from dtpshard.studies.shared import shared_lines
from dtpshard.studies.stalls import stall_lines
from dtpshard.studies.stats import (
    bootstrap_pearson,
    bootstrap_pearson_difference,
    correlate,
    mean_curve,
    mean_sd,
    pair_matching,
    rank_correlate,
    step_matching,
)
from dtpshard.studies.study import LayoutInfo, Study, distinct, groups, layout_kl, load_study, mid_step
from dtpshard.training.settings import Recipe


# -- tables ------------------------------------------------------------------------------------
def _fmt(v: float | None, digits: int = 3) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def _opt_cont(study: Study) -> tuple[list, list] | None:
    """The optimised and contiguous groups' KL curves (every run), or None without both groups."""
    g = groups(study)
    if not (g.get("optimised") and g.get("contiguous")):
        return None
    return [r.kl for i in g["optimised"] for r in i.runs], [r.kl for i in g["contiguous"] for r in i.runs]


def results_table(study: Study) -> str:
    mid, end = mid_step(study), study.steps
    g = groups(study)
    curves = _opt_cont(study)
    match = None if curves is None else step_matching(mean_curve(curves[0]), mean_curve(curves[1]), end)
    top1 = any(len(r.top1.steps) for r in study.runs)  # runs evaluated before top-1 was recorded have none
    lines = [f"| layout | layouts | runs | KL@0 | KL@{mid} | KL@{end} | KL@{end} min–max | ppl@{end} | "
             + (f"top-1@{end} | " if top1 else "") + f"step matching contiguous@{end} |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if top1 else "")]
    for name, infos in g.items():
        runs = [r for i in infos for r in i.runs]
        if not runs:
            continue

        def at(column: str, step: int, runs: list = runs) -> list:
            return [r.__dict__[column].at(step) for r in runs]

        sm = {"optimised": match.format() if match else "–", "contiguous": f"{end}"}.get(name, "")
        ends = [v for v in at("kl", end) if v is not None]
        spread = f"{min(ends):.3f}–{max(ends):.3f}" if len(ends) > 1 else "–"
        top1_cell = f"{mean_sd(at('top1', end)).format()} | " if top1 else ""
        lines.append(f"| {name} | {len(infos)} | {len(runs)} | {mean_sd(at('kl', 0)).format()} | "
                     f"{mean_sd(at('kl', mid)).format()} | {mean_sd(at('kl', end)).format()} | {spread} | "
                     f"{mean_sd(at('ppl', end)).format(2)} | {top1_cell}{sm} |")
    return "\n".join(lines)


def layout_table(study: Study) -> str:
    mid, end = mid_step(study), study.steps
    others = study.proxies[1:]  # J under the other proxies, where scored
    lines = [f"| layout | kind | J | J / random | {''.join(f'J {p} | ' for p in others)}zero-shot KL | zero-shot ppl | "
             f"runs | KL@{mid} | KL@{end} | ppl@{end} |", "|" + "---|" * (10 + len(others))]
    for info in sorted(study.layouts.values(), key=lambda i: -(i.J or 0)):
        ppl = [r.ppl.at(end) for r in info.runs]
        ppl = [v for v in ppl if v is not None]
        unfinished = sum(not r.done for r in info.runs)
        runs = f"{len(info.runs)}" + (f" ({unfinished} running)" if unfinished else "")
        extra = "".join(f"{_fmt(info.proxy_J.get(p), 4)} | " for p in others)
        kind = info.kind + (f" (= {info.same_as})" if info.same_as else "")
        lines.append(f"| {info.name} | {kind} | {_fmt(info.J, 4)} | {_fmt(info.ratio)} | {extra}"
                     f"{_fmt(info.zero_kl, 4)} | {_fmt(info.zero_ppl, 2)} | {runs} | {_fmt(layout_kl(info, mid), 4)} | "
                     f"{_fmt(layout_kl(info, end), 4)} | {_fmt(sum(ppl) / len(ppl) if ppl else None, 2)} |")
    return "\n".join(lines)


def step_matching_lines(study: Study) -> list[str]:
    """The multiplier of the mean curves at the middle and the end, with its range over seed pairs."""
    curves = _opt_cont(study)
    if curves is None:
        return []
    opt, cont = curves
    opt_mean, cont_mean = mean_curve(opt), mean_curve(cont)
    out = []
    for step in (mid_step(study), study.steps):
        m = step_matching(opt_mean, cont_mean, step)
        if m is None or not len(opt_mean.steps):  # a group with no evaluation yet: nothing to match
            continue
        pairs = pair_matching(opt, cont, step)
        reach = (f"reaches it at step {m.format()}" if m.reached is not None else
                 f"never reaches it (its curve ends at step {int(opt_mean.steps[-1])})")
        out.append(f"- contiguous's mean KL at step {step} ({m.target:.3f}): optimised's mean curve {reach}; "
                   f"single seeds: {pairs.format()}")
    return out


def _trained(study: Study, step: int) -> list[tuple[LayoutInfo, float]]:
    pts = [(i, layout_kl(i, step)) for i in distinct(study) if i.runs]
    return [(i, y) for i, y in pts if y is not None]


def proxy_rows(study: Study) -> list[dict]:
    """Per proxy: Pearson r (p, bootstrap 95% interval over layouts) of J against the trained
    layouts' seed-mean KL at the end, and r against the zero-shot KL of every layout."""
    rows = []
    end = _trained(study, study.steps)
    y = [v for _, v in end]
    infos = distinct(study)
    for proxy in study.proxies:
        xs = [i.proxy_J.get(proxy) for i, _ in end]
        fit = correlate(xs, y)
        ci = bootstrap_pearson(xs, y)
        zero = correlate([i.proxy_J.get(proxy) for i in infos], [i.zero_kl for i in infos])
        row = {"proxy": proxy, "fit": fit, "ci": ci, "zero": zero, "diff": None, "delta": None,
               "rank": rank_correlate(xs, y)}
        if proxy != study.proxies[0]:  # against the first proxy, on the layouts scored under both
            first = [i.proxy_J.get(study.proxies[0]) for i, _ in end]
            both = [(a, b, c) for a, b, c in zip(xs, first, y) if a is not None and b is not None]
            if len(both) >= 3:
                a, b, c = zip(*both)
                mine, theirs = correlate(a, c), correlate(b, c)
                if mine.r is not None and theirs.r is not None:
                    row["delta"] = mine.r - theirs.r
                    row["diff"] = bootstrap_pearson_difference(a, b, c)
        rows.append(row)
    return rows


def proxy_table(study: Study) -> list[str]:
    rows = [r for r in proxy_rows(study) if r["fit"].n or r["zero"].n]
    if not rows:
        return []

    def r_(f: Any) -> str:
        return "–" if f.r is None else f"{f.r:+.3f}"

    def p_(f: Any) -> str:
        return "–" if f.p is None else f"{f.p:.2g}"

    first = study.proxies[0]
    lines = [f"| proxy | r (J, KL@{study.steps}) | p | bootstrap 95% CI | r − r({first}), paired 95% CI | "
             "Spearman ρ | p | trained layouts | r (J, zero-shot KL) | p | layouts |", "|" + "---|" * 11]
    for row in rows:
        f, z, d = row["fit"], row["zero"], row["diff"]
        diff = "–" if row["delta"] is None else f"{row['delta']:+.3f} " + (d.format(3) if d else "(no interval)")
        rk = row["rank"]
        rho = "–" if rk.rho is None else f"{rk.rho:+.3f}"
        lines.append(f"| {row['proxy']} | {r_(f)} | {p_(f)} | {row['ci'].format() if row['ci'] else '–'} | {diff} | "
                     f"{rho} | {'–' if rk.p is None else f'{rk.p:.2g}'} | {f.n} | {r_(z)} | {p_(z)} | {z.n} |")
    out = ["## Which proxy predicts the trained KL", "",
           "J of every layout under each proxy's affinity (one calibration pass each, on the same tokens). "
           f"Pearson r of J against the seed-mean KL at step {study.steps} over the trained layouts (more negative: "
           "higher J, lower KL), its two-sided p (scipy), and a percentile bootstrap 95% interval (10000 "
           "resamples of the layouts, seed 0; with this few layouts a percentile interval is approximate and tends "
           "to be narrow); the difference from the first proxy's r with a paired bootstrap "
           "interval (both r on the same resamples); Spearman's rank correlation ρ (does J order the layouts as their "
           "KL does, whatever the shape of the relation); and r against the untrained (zero-shot) KL of every "
           "layout.", "",
           *lines, ""]
    known = [r for r in rows if r["fit"].r is not None]
    if len(known) > 1:
        best = min(known, key=lambda r: r["fit"].r)
        first = next((r for r in known if r["proxy"] == study.proxies[0]), None)
        line = f"Most negative r at step {study.steps}: **{best['proxy']}** ({best['fit'].r:+.3f})"
        if first is not None and best is not first:
            d = best["diff"]
            line += f", against {first['fit'].r:+.3f} for {first['proxy']}; "
            if d is None:
                line += "no paired interval of the difference (too few layouts scored under both)."
            elif d.high < 0:
                line += "the paired interval of the difference excludes 0, so these layouts resolve it."
            else:
                line += "the paired interval of the difference includes 0, so these layouts do not resolve it."
        else:
            line += "."
        out += [line, ""]
    return out


def provenance_lines(study: Study) -> list[str]:
    p, t = study.provenance, study.timings
    out = []
    if p:
        v = p.get("versions", {})
        commit = f" (commit {p['dtpshard_commit']})" if p.get("dtpshard_commit") else ""
        out.append("- versions: " + ", ".join(f"{k} {x}" for k, x in v.items()) + f"{commit}; Python "
                   f"{p.get('python', '?')} on {p.get('machine', '?')}")
        for name, digest in (p.get("model_files") or {}).items():
            out.append(f"- model file {name}: sha256 {digest}")
        src = p.get("model_source")
        if src:
            out.append(f"- made from {src.get('package', '?')}: {src.get('file', '?')}, "
                       f"sha256 {src.get('sha256', '?')}; {src.get('dequantised_by', '')}")
        d, tok = p.get("data", {}), p.get("tokens", {})
        runs = len(study.runs)
        d = {k: ", ".join(map(str, v)) if isinstance(v, list) else v for k, v in d.items()}
        train = study.sources.get("train_data", d.get("training"))
        ev = study.sources.get("eval_data", d.get("evaluation"))
        out.append(f"- data: calibration {d.get('calibration')} ({tok.get('calibration', '?')} tokens), training "
                   f"{train} ({tok.get('training_per_run', '?')} tokens per run, {runs} runs), evaluation "
                   f"{ev} ({tok.get('evaluation', '?')} held-out tokens)")
    if t:
        runs = {k: x for k, x in t.items() if k.startswith("run ")}
        other = {k: x for k, x in t.items() if not k.startswith("run ")}
        parts = [f"{k} {x / 60:.1f} min" if x >= 60 else f"{k} {x:.0f} s" for k, x in other.items()]
        if runs:
            parts.append(f"{len(runs)} runs {sum(runs.values()) / 60:.1f} min "
                         f"({min(runs.values()) / 60:.1f}–{max(runs.values()) / 60:.1f} min each)")
        out.append(f"- wall time per phase: {'; '.join(parts)}; total {sum(t.values()) / 60:.1f} min")
    return ["## Provenance", "", *out, ""] if out else []


def correlation_lines(study: Study) -> list[str]:
    out = []
    for label, step in (("untrained (step 0)", 0), (f"step {mid_step(study)}", mid_step(study)),
                        (f"step {study.steps}", study.steps)):
        infos = distinct(study)
        xs, ys = [i.J for i in infos], [layout_kl(i, step) for i in infos]
        fit, ci, rank = correlate(xs, ys), bootstrap_pearson(xs, ys), rank_correlate(xs, ys)
        r = "n/a (fewer than 3 layouts)" if fit.r is None else f"{fit.r:+.3f} (p = {fit.p:.2g}" + \
            (f", bootstrap 95% CI {ci.format()})" if ci else ")")
        rho = "" if rank.rho is None else f"; Spearman ρ = {rank.rho:+.3f} (p = {rank.p:.2g})"
        out.append(f"- KL {label} against J over {fit.n} layouts: Pearson r = {r}{rho}")
    return out


# -- the report --------------------------------------------------------------------------------
def markdown(study: Study, figures: dict[str, str]) -> str:
    c = study.config
    train = c.training if c else Recipe()  # no config.json yet: the recipe's defaults
    tokens = train.micro_batch * train.grad_accum * train.seq_len
    done = sum(r.done for r in study.runs)
    head = [f"# dtpshard experiment: {c.model if c else study.directory.name}", "",
            f"L = {c.devices if c else '?'} devices, delay δ = {c.delay if c else '?'}; "
            f"{len(study.layouts)} layouts, {len(study.runs)} distillation runs ({done} finished), "
            f"{study.steps} steps of {tokens} tokens each. KL is KL(dense ‖ DTP student) in nats per token on the "
            "held-out evaluation blocks; J is the co-located score (docs/design.md §3).", ""]
    if done < len(study.runs):
        head += ["**Partial results**: some runs are unfinished; their curves stop at their last evaluation.", ""]
    head += provenance_lines(study)
    body = ["## Results (docs/design.md §5)", "",
            "Mean ± sample sd over the runs of each group (training seeds; for random, the random layouts), "
            "and the lowest and highest single run.", "",
            results_table(study), "",
            "Step matching: the first step at which the optimised arm's mean KL curve (linear between "
            "evaluations) reaches the contiguous arm's mean KL at a step s; the multiplier is s over it. The "
            "range is the same computed on single curves, for every (optimised seed, contiguous seed) pair.", "",
            *step_matching_lines(study), ""]
    if "curves" in figures:
        body += ["## Training curves", "", f"![KL and perplexity against step]({figures['curves']})", "",
                 "Bold: mean over training seeds; faint: single seeds; grey: random layouts."
                 + (" Log step axis: step 0 (the untrained students) is left off it." if c and c.report.log_steps
                    else ""), ""]
    body += adapter_lines(study, figures)
    body += shared_lines(study, figures)
    body += recipe_lines(study, figures)
    body += delayed_lines(study, figures)
    body += optional_sections(study, figures)
    body += dominance_lines(study)
    body += report_lines(study)  # [eval]: what the students lose on benchmarks (studies/downstream.py)
    first = study.proxies[0]
    same = [f"{i.name} = {i.same_as}" for i in study.layouts.values() if i.same_as]
    n_layouts = len(distinct(study))
    body += ["## Co-located score J against KL", "", f"J under the {first} affinity (the one the optimised layouts "
             "maximise)" + ("; bootstrap intervals as below." if n_layouts >= 3 else ".")
             + (" Identical layouts (the same units share a device in every layer) count once in every "
                f"correlation: {', '.join(same)}." if same else ""), ""]
    # a correlation over fewer than 3 layouts has no value: say so once instead of a table of dashes
    body += correlation_lines(study) + [""] if n_layouts >= 3 else \
        [f"A correlation needs at least 3 distinct layouts; this experiment has {n_layouts} (their J and KL are "
         "in the table of every layout below).", ""]
    if "j_vs_kl" in figures:
        body += [f"![KL against J]({figures['j_vs_kl']})", ""]
    body += proxy_table(study) if n_layouts >= 3 else []
    if "proxies" in figures:
        body += [f"![trained KL against J under each proxy]({figures['proxies']})", ""]
    body += stall_lines(study)
    body += seed_lines(study, figures)
    body += ["## Every layout", "", layout_table(study), ""]
    if "up_edge" in figures:
        body += ["## Where the up edge is co-located, layer by layer", "",
                 f"![per-layer co-located fraction of the up edge]({figures['up_edge']})", "",
                 "The fraction of each layer's normalised up-edge affinity (heads of layer i → neurons of "
                 f"layer i) that stays on one device; 1/L = {1 / c.devices:.3f} is what ignoring the affinity "
                 "gives." if c else "", ""]
    return "\n".join(head + body)


def _check_ours(d: Path) -> None:
    """report.md and figures/ are replaced only in an experiment directory dtpshard marked
    (core/owned.py). Anywhere else (a copy of a published study, a folder of the user's that holds
    runs/*/metrics.jsonl) they are written only where neither exists: a user's report.md or
    figures/ is never overwritten."""
    if is_ours(d, "experiment", "config.json"):
        return
    found = [n for n in ("report.md", "figures") if os.path.lexists(d / n)]
    if found:
        raise UserError(f"{d / found[0]}: exists, and {d} is not an experiment directory dtpshard marked (no "
                        f"{MARK} that its config.json agrees with), so it may be someone else's; nothing was "
                        f"written (move it away, or report a directory `dtpshard experiment` made)")


def write_report(directory: Path) -> Path:
    d = Path(directory)
    # report.md and figures/ live in the experiment directory they report on, but never are (or
    # lead through a symlink to) a file it reads
    read = ("config.json", p.LAYOUT_DIR, p.ZEROSHOT, p.SCORES, p.TIMINGS, p.PROVENANCE, p.RUNS)
    check_outputs({"report": d / "report.md", "figures": d / "figures"}, {"the experiment's": [d / n for n in read]})
    study = load_study(directory)
    _check_ours(d)
    where = Path(directory) / "figures"
    created = not where.exists()
    try:
        figures = draw_all(study, where)
    except BaseException:
        if created:  # a failed report leaves the directory as it found it
            shutil.rmtree(where, ignore_errors=True)
        raise
    path = Path(directory) / "report.md"
    atomic_write_text(path, markdown(study, {k: f"figures/{v.name}" for k, v in figures.items()}))
    return path
