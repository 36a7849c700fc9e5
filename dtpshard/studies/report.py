"""`dtpshard report DIR`: the Markdown report of an experiment directory, with PNG figures.

Reads what `dtpshard experiment` writes (see experiment.py): config.json, layouts/*.json (J and
its per-layer parts), zeroshot.json (step-0 KL per layout) and runs/NAME-sSEED/metrics.jsonl.
Works on a partial experiment too (unfinished runs are marked and used up to their last
evaluation). Writes DIR/report.md and DIR/figures/*.png, each atomically.

Numbers follow docs/design.md §5: a group is a layout kind (the random layouts form one group);
its KL and perplexity are the mean ± sample sd over every run of the group (seeds, or random
layouts), read off the evaluation curves at the middle and at the end of training by linear
interpolation. Step matching compares the optimised and contiguous groups' mean KL curves.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

from dtpshard.core.io import atomic_write_text
from dtpshard.studies.stats import correlate, mean_curve, mean_sd, step_matching
from dtpshard.studies.study import Study, groups, layout_kl, load_study, mid_step


# -- tables ------------------------------------------------------------------------------------
def _fmt(v: float | None, digits: int = 3) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def results_table(study: Study) -> str:
    mid, end = mid_step(study), study.steps
    g = groups(study)
    match = None
    if g.get("optimised") and g.get("contiguous"):
        opt = mean_curve([r.kl for i in g["optimised"] for r in i.runs])
        cont = mean_curve([r.kl for i in g["contiguous"] for r in i.runs])
        match = step_matching(opt, cont, end)
    lines = [f"| layout | layouts | runs | KL@0 | KL@{mid} | KL@{end} | ppl@{end} | step matching contiguous@{end} |",
             "|---|---|---|---|---|---|---|---|"]
    for name, infos in g.items():
        runs = [r for i in infos for r in i.runs]
        if not runs:
            continue
        at = lambda c, s: [r.__dict__[c].at(s) for r in runs]  # noqa: E731
        sm = {"optimised": match.format() if match else "–", "contiguous": f"{end}"}.get(name, "")
        lines.append(f"| {name} | {len(infos)} | {len(runs)} | {mean_sd(at('kl', 0)).format()} | "
                     f"{mean_sd(at('kl', mid)).format()} | {mean_sd(at('kl', end)).format()} | "
                     f"{mean_sd(at('ppl', end)).format(2)} | {sm} |")
    return "\n".join(lines)


def layout_table(study: Study) -> str:
    mid, end = mid_step(study), study.steps
    lines = [f"| layout | kind | J | J / random | zero-shot KL | zero-shot ppl | runs | KL@{mid} | KL@{end} | ppl@{end} |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for info in sorted(study.layouts.values(), key=lambda i: -(i.J or 0)):
        ppl = [r.ppl.at(end) for r in info.runs]
        ppl = [v for v in ppl if v is not None]
        unfinished = sum(not r.done for r in info.runs)
        runs = f"{len(info.runs)}" + (f" ({unfinished} running)" if unfinished else "")
        lines.append(f"| {info.name} | {info.kind} | {_fmt(info.J, 4)} | {_fmt(info.ratio)} | {_fmt(info.zero_kl, 4)} | "
                     f"{_fmt(info.zero_ppl, 2)} | {runs} | {_fmt(layout_kl(info, mid), 4)} | "
                     f"{_fmt(layout_kl(info, end), 4)} | {_fmt(sum(ppl) / len(ppl) if ppl else None, 2)} |")
    return "\n".join(lines)


def correlation_lines(study: Study) -> list[str]:
    out = []
    for label, step in (("untrained (step 0)", 0), (f"step {mid_step(study)}", mid_step(study)),
                        (f"step {study.steps}", study.steps)):
        infos = list(study.layouts.values())
        fit = correlate([i.J for i in infos], [layout_kl(i, step) for i in infos])
        r = "n/a (fewer than 3 layouts)" if fit.r is None else f"{fit.r:+.3f} (p = {fit.p:.2g})"
        out.append(f"- KL {label} against J over {fit.n} layouts: Pearson r = {r}")
    return out


# -- the report --------------------------------------------------------------------------------
def markdown(study: Study, figures: dict[str, str]) -> str:
    c = study.config
    train = c.get("training") or {}
    tokens = train.get("micro_batch", 4) * train.get("grad_accum", 4) * train.get("seq_len", 1024)
    done = sum(r.done for r in study.runs)
    head = [f"# dtpshard experiment: {c.get('model', study.directory.name)}", "",
            f"L = {c.get('devices', '?')} devices, delay δ = {c.get('delay', '?')}; "
            f"{len(study.layouts)} layouts, {len(study.runs)} distillation runs ({done} finished), "
            f"{study.steps} steps of {tokens} tokens each. KL is KL(dense ‖ DTP student) in nats per token on the "
            "held-out evaluation blocks; J is the co-located score (docs/design.md §3).", ""]
    if done < len(study.runs):
        head += ["**Partial results**: some runs are unfinished; their curves stop at their last evaluation.", ""]
    body = ["## Results (docs/design.md §5)", "",
            "Mean ± sample sd over the runs of each group (training seeds; for random, the random layouts).", "",
            results_table(study), "",
            "Step matching: the first step at which the optimised arm's mean KL curve (linear between "
            "evaluations) reaches the contiguous arm's mean KL at the last step; the multiplier is that step "
            "over it.", ""]
    if "curves" in figures:
        body += ["## Training curves", "", f"![KL and perplexity against step]({figures['curves']})", "",
                 "Bold: mean over training seeds; faint: single seeds; grey: random layouts.", ""]
    body += ["## Co-located score J against KL", ""] + correlation_lines(study) + [""]
    if "j_vs_kl" in figures:
        body += [f"![KL against J]({figures['j_vs_kl']})", ""]
    body += ["## Every layout", "", layout_table(study), ""]
    if "up_edge" in figures:
        body += ["## Where the up edge is co-located, layer by layer", "",
                 f"![per-layer co-located fraction of the up edge]({figures['up_edge']})", "",
                 "The fraction of each layer's normalised up-edge affinity (heads of layer i → neurons of "
                 f"layer i) that stays on one device; 1/L = {1 / c['devices']:.3f} is what ignoring the affinity "
                 "gives." if isinstance(c.get("devices"), int) else "", ""]
    return "\n".join(head + body)


def write_report(directory: Path) -> Path:
    from dtpshard.studies.figures import draw_all

    study = load_study(directory)
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


def report_cmd(directory: Path) -> int:
    """Write DIR/report.md with PNG figures under DIR/figures/ for an experiment directory
    (`dtpshard experiment` runs this at its end; run it yourself on a partial experiment).

    Args:
        directory: the experiment directory (config.json, layouts/, zeroshot.json, runs/)
    """
    path = write_report(directory)
    print(f"report: {path}")
    return 0
