"""Who beats whom: at every evaluation, how many random layouts and contiguous seeds each
optimised seed beats, and the paper's sentence (its section 5: "every optimised seed beats every
contiguous seed and all but one of sixteen random layouts") checked in the study's numbers.

A seed beats another run when its KL at that step is strictly lower. A random layout counts once,
with its seed-mean KL (a layout trained with several seeds is one layout), as the paper counts
random layouts; contiguous counts its seeds, as the paper counts them.
"""
from __future__ import annotations

from dataclasses import dataclass

from dtpshard.studies.stats import mean_curve
from dtpshard.studies.study import Run, Study, distinct, groups, layout_kl


@dataclass(frozen=True)
class Standing:
    """One optimised seed at one evaluation step."""

    run: str
    kl: float
    random: int  # random layouts with a higher KL than this seed's
    random_of: int  # random layouts with a KL at this step
    contiguous: int
    contiguous_of: int
    lost_to: list[tuple[str, float]]  # (random layout or contiguous run, its KL) at or below this seed's
    beaten: list[tuple[str, float]]  # the others

    @property
    def sentence_holds(self) -> bool:
        """Every contiguous seed and all but (at most) one random layout beaten."""
        return self.contiguous == self.contiguous_of and self.random >= self.random_of - 1


def _runs(study: Study, kind: str) -> list[Run]:
    return [r for i in groups(study).get(kind, []) for r in i.runs]


def standings(study: Study) -> list[tuple[int, list[Standing]]]:
    """Per evaluation step of the optimised seeds (those every one of them reached): each seed's
    standing against the random layouts and the contiguous seeds. [] without optimised runs or
    without a trained random layout (against contiguous alone, the head start says it all)."""
    optimised = [r for r in _runs(study, "optimised") if len(r.kl.steps)]
    contiguous = _runs(study, "contiguous")
    rand = [i for i in distinct(study) if i.kind == "random" and i.runs]
    if not optimised or not rand:
        return []
    out = []
    for step in mean_curve([r.kl for r in optimised]).steps:
        kls = [(i.name, layout_kl(i, step)) for i in rand]
        kls = [(n, v) for n, v in kls if v is not None]
        conts = [(r.name, r.kl.at(step)) for r in contiguous]
        conts = [(n, v) for n, v in conts if v is not None]
        rows = []
        for r in optimised:
            mine = r.kl.at(step)
            lost = sorted([(n, v) for n, v in kls + conts if v <= mine], key=lambda t: t[1])
            beaten = [(n, v) for n, v in kls + conts if v > mine]
            rows.append(Standing(r.name, mine, sum(v > mine for _, v in kls), len(kls),
                                 sum(v > mine for _, v in conts), len(conts), lost, beaten))
        out.append((int(step), rows))
    return out


def _cell(s: Standing) -> str:
    parts = []
    if s.random_of:
        parts.append(f"{s.random}/{s.random_of} random")
    if s.contiguous_of:
        parts.append(f"{s.contiguous}/{s.contiguous_of} contiguous")
    return ", ".join(parts)


def _closest(rows: list[Standing]) -> str:
    """The narrowest win of any optimised seed at this step, as a KL gap and a share of the loser's KL."""
    wins = []
    for s in rows:
        wins += [(v - s.kl, s, n, v) for n, v in s.beaten]
    if not wins:
        return ""
    gap, s, n, v = min(wins, key=lambda t: t[0])
    return f"the narrowest win: {s.run} ({s.kl:.4f}) over {n} ({v:.4f}), by {gap:.4f} ({100 * gap / v:.1f}%)"


def dominance_lines(study: Study) -> list[str]:
    table = standings(study)
    if not table:
        return []
    seeds = [s.run for s in table[0][1]]
    n_random, n_cont = table[-1][1][0].random_of, table[-1][1][0].contiguous_of
    check = n_random >= 2 and n_cont >= 1  # the paper's sentence needs both, and "all but one" of several
    head = "| step | " + " | ".join(seeds) + " |" + (" the paper's sentence |" if check else "")
    lines = [head, "|---|" + "---|" * (len(seeds) + check)]
    for step, rows in table:
        verdict = (" held |" if all(s.sentence_holds for s in rows) else " not held |") if check else ""
        lines.append(f"| {step} | " + " | ".join(_cell(s) for s in rows) + " |" + verdict)
    out = ["## Who beats whom", "",
           "At every evaluation, how many random layouts and contiguous seeds each optimised seed beats (a strictly "
           "lower KL at that step). A random layout counts once, with the mean KL of its training seeds; "
           "contiguous counts its seeds.", "", *lines, ""]
    if check:
        held = [step for step, rows in table if all(s.sentence_holds for s in rows)]
        end, rows = table[-1]
        sentence = (f"every optimised seed beats every contiguous seed and all but one of the {n_random} random "
                    "layouts")
        verdict = "**held**" if len(held) and held[-1] == end else "**not held**"
        out.append(f"The paper's sentence in this study's numbers ({len(seeds)} optimised seeds, {n_cont} contiguous "
                   f"seeds, {n_random} random layouts): \"{sentence}\". At step {end}: {verdict}; at "
                   f"{len(held)} of {len(table)} evaluations (steps {', '.join(map(str, held)) or 'none'}).")
        losses = [f"{s.run} ({s.kl:.4f}) to {', '.join(f'{n} ({v:.4f})' for n, v in s.lost_to)}"
                  for s in rows if s.lost_to]
        out.append(f"At step {end}: " + ("; ".join(losses) if losses else "no optimised seed is beaten")
                   + (f"; {_closest(rows)}." if _closest(rows) else "."))
        out.append("")
    return out
