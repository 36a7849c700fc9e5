"""The report's section on recipe arms (arms with their own `recipe` or `lr`, training/recipes.py):
every arm's KL, top-1 and perplexity at every evaluation, and step matching against the
calibrated baseline.

The calibrated baseline is found, not named: of the full-distillation arms that train the paper's
recipe on the optimised layout with three or more seeds, the one of lowest seed-mean KL at the
last step (a learning-rate sweep's winner). Every arm's multiplier is the baseline's last step over
the step at which the arm's seed-mean curve first reaches the baseline's KL there.

A step's cost cannot come from the runs: a study's runs share the machine with each other and mix
machines. cost.json is bench/bench_distill.py --recipes --json's last line, copied in by hand:
each recipe's mean cost of a step over a run of the study's length against the paper recipe's,
measured in one process.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dtpshard.core.errors import UserError
from dtpshard.core.io import atomic_path, read_json
from dtpshard.studies.adapters import fmt_seeds, seeds_at
from dtpshard.studies.stats import Curve, is_rate, mean_curve, step_matching
from dtpshard.studies.study import Run, Study

SEEDS = 3  # a baseline is a mean over at least this many training seeds
COST = "cost.json"  # bench/bench_distill.py --recipes --json's rows (module docstring)


@dataclass
class RecipeArm:
    layout: str
    recipe: str
    lr: float | None
    adapters: int | None
    runs: list[Run]

    @property
    def name(self) -> str:
        lr = "" if self.lr is None else f", lr {self.lr:g}"
        return f"{self.layout}, {self.recipe}{lr}" + ("" if self.adapters is None else f", rank {self.adapters}")

    @property
    def kl(self) -> Curve:
        return mean_curve([r.kl for r in self.runs])


def arms(study: Study) -> list[RecipeArm]:
    """Every arm of a study with recipe runs (none without): the runs grouped by layout, recipe, lr
    and adapters' rank, the paper's recipe first, then by name."""
    partial = {n for n, info in study.layouts.items() if info.delayed is not None}  # studies/delayed.py's
    if not [r for r in study.recipe_runs if r.layout not in partial]:
        return []
    groups: dict[tuple, list[Run]] = {}
    for run in [r for r in (*study.runs, *study.recipe_runs, *study.adapter_runs) if r.layout not in partial]:
        groups.setdefault((run.layout, run.recipe, run.lr, run.adapters), []).append(run)
    keys = sorted(groups, key=lambda k: (k[0] != "optimised", k[0], k[3] is not None, k[1] != "paper", k[1],
                                         k[2] or 0))
    return [RecipeArm(*k, groups[k]) for k in keys]


def baseline(all_arms: list[RecipeArm], end: float) -> RecipeArm | None:
    """The calibrated paper recipe (module docstring), None until one has three seeds at `end`."""
    ready = [a for a in all_arms if a.recipe == "paper" and a.adapters is None and a.layout == "optimised"
             and sum(r.kl.at(end) is not None for r in a.runs) >= SEEDS and a.kl.at(end) is not None]
    return min(ready, key=lambda a: a.kl.at(end)) if ready else None


def step_costs(study: Study) -> dict[str, float]:
    """recipe -> the cost of its step over the paper recipe's, from cost.json (none without it)."""
    path = study.directory / COST
    if not path.is_file():
        return {}
    rows = read_json(path, "bench/bench_distill.py's JSON rows", 1 << 16)
    if not isinstance(rows, list) or not rows or not all(
            isinstance(r, dict) and isinstance(r.get("recipe"), str)
            and all(is_rate(r.get(k)) for k in ("seconds", "ratio")) for r in rows):
        raise UserError(f"{path}: not bench/bench_distill.py --recipes --json's rows (a list of rows with a recipe "
                        "name and positive numbers for seconds and ratio)")
    return {r["recipe"]: float(r["ratio"]) for r in rows}


def recipe_lines(study: Study, figures: dict[str, str]) -> list[str]:
    """The section, or nothing for an experiment without recipe arms."""
    all_arms = arms(study)
    if not all_arms:
        return []
    end = float(study.steps)
    base = baseline(all_arms, end)
    steps = sorted({float(s) for a in all_arms for s in a.kl.steps.tolist()})
    out = ["## Distillation recipes", "",
           "Arms by layout, recipe (training/recipes.py), peak learning rate and adapters' rank; mean ± sd over "
           "training seeds. The calibrated baseline is the paper recipe's arm on the optimised layout with "
           f"{SEEDS}+ seeds and the lowest mean KL at step {end:g}: "
           + (f"**{base.name}** (KL {base.kl.at(end):.3f})." if base else "none yet."), ""]
    costs = step_costs(study)
    shared = {spec.name for arm in study.config.arms for spec in arm.layouts if spec.shared} if study.config else set()
    head = ["arm", "seeds", *(f"KL @ {s:g}" for s in steps if s > 0), f"top-1 @ {end:g}", f"ppl @ {end:g}"]
    if base:
        head.append(f"step reaching {base.kl.at(end):.3f} (×)")
    if costs:
        head.append("cost of a step (× paper)")
    out += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for a in all_arms:
        cells = [a.name + (" ‡" if a is base else ""), str(len(a.runs)),
                 *(fmt_seeds(seeds_at(a.runs, s, "kl")) for s in steps if s > 0),
                 fmt_seeds(seeds_at(a.runs, end, "top1")), fmt_seeds(seeds_at(a.runs, end, "ppl"), 1)]
        if base:
            m = step_matching(a.kl, base.kl, end)
            cells.append("–" if m is None else m.format())
        if costs:  # bench_distill times the recipes on the plain student: not adapters', not shared neurons'
            plain = a.adapters is None and a.layout not in shared
            cells.append(f"{costs[a.recipe]:.2f}×" if a.recipe in costs and plain else "–")
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "‡ the calibrated baseline. Step matching: the first step at which the arm's seed-mean curve "
            "(linear between evaluations) reaches the baseline's mean KL at its last step; the multiplier is that "
            "step over the arm's. Only the seeds an arm has are in its mean: an arm of one seed is a pilot."
            + (f" Cost of a step: each recipe's mean over a {end:g}-step run against the paper recipe's, timed in one "
               "process by bench/bench_distill.py (cost.json; the same for every lr and layout, not measured for "
               "adapters or shared neurons)." if costs else ""), ""]
    out += head_start_lines(all_arms, end)
    if "recipes" in figures:
        out += [f"![KL against step for every recipe arm]({figures['recipes']})", "",
                "Bold: mean over training seeds; faint: single seeds; dashed grey: the calibrated baseline's KL at "
                f"step {end:g}.", ""]
    return out


def head_start_lines(all_arms: list[RecipeArm], end: float) -> list[str]:
    """The optimised layout's head start over contiguous under each recipe trained on both (same lr,
    no adapters): where the optimised arm's seed-mean curve reaches contiguous's KL at `end`."""
    by = {(a.layout, a.recipe, a.lr, a.adapters): a for a in all_arms}
    pairs = [(a, by[("contiguous", a.recipe, a.lr, None)]) for a in all_arms
             if a.layout == "optimised" and a.adapters is None and ("contiguous", a.recipe, a.lr, None) in by]
    if not pairs:
        return []
    out = ["The optimised layout's head start under each recipe trained on both layouts: the step at which the "
           f"optimised arm's seed-mean curve reaches the contiguous arm's mean KL at step {end:g}.", "",
           f"| recipe | optimised KL @ {end:g} | contiguous KL @ {end:g} | optimised reaches it at (×) |",
           "|---|---:|---:|---:|"]
    for opt, cont in pairs:
        m = step_matching(opt.kl, cont.kl, end)
        out.append(f"| {opt.name.removeprefix('optimised, ')} | {fmt_seeds(seeds_at(opt.runs, end, 'kl'))} | "
                   f"{fmt_seeds(seeds_at(cont.runs, end, 'kl'))} | {'–' if m is None else m.format()} |")
    return [*out, ""]


def draw_recipes(study: Study, path: Path) -> Path | None:
    """KL against step (log KL), one line per recipe arm, one panel per layout."""
    all_arms = arms(study)
    if not all_arms:
        return None
    import matplotlib.pyplot as plt

    layouts = list(dict.fromkeys(a.layout for a in all_arms))
    base = baseline(all_arms, float(study.steps))
    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4.2), sharey=True, squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        for i, a in enumerate(x for x in all_arms if x.layout == layout):
            colour = cmap(i % 10)
            for r in a.runs:
                ax.plot(r.kl.steps, r.kl.values, color=colour, alpha=0.25, linewidth=0.8)
            ax.plot(a.kl.steps, a.kl.values, color=colour, linewidth=2, label=a.name.removeprefix(f"{layout}, "))
        if base is not None:
            ax.axhline(base.kl.at(float(study.steps)), color="grey", linestyle="--", linewidth=1)
        ax.set_title(layout)
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(frameon=False, fontsize=7)
    axes[0][0].set_ylabel("KL(dense ‖ student), nats/token")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=130, bbox_inches="tight")
    plt.close(fig)
    return path
