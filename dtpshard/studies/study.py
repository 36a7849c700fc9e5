"""An experiment directory as data (`load_study`): its layouts with J and zero-shot KL, its runs'
evaluation curves, and the groups the report and the figures compare (a group is a layout kind;
the random layouts form one group). Read by report.py and figures.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError
from dtpshard.core.vocab import LAYOUT_KINDS
from dtpshard.studies.stats import Curve, make_curve


@dataclass
class Run:
    name: str  # runs/NAME-sSEED
    layout: str
    seed: int
    done: bool
    kl: Curve
    ppl: Curve


@dataclass
class LayoutInfo:
    name: str
    kind: str  # family: optimised, contiguous, random, anti, heads-only, neurons-only, optimised-layers-4 ...
    J: float | None
    ratio: float | None
    up: list[float | None]  # per layer: co-located fraction of the up edge
    zero_kl: float | None
    zero_ppl: float | None
    runs: list[Run] = field(default_factory=list)


@dataclass
class Study:
    directory: Path
    config: dict[str, Any]
    layouts: dict[str, LayoutInfo]
    runs: list[Run]
    steps: int  # planned training steps (the end of the curves)


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable {what} ({e})") from None


def load_study(directory: Path) -> Study:
    from dtpshard.training.rundir import is_done, read_metrics

    d = Path(directory)
    if not d.is_dir():
        raise UserError(f"{d}: no such experiment directory")
    config = _read_json(d / "config.json", "experiment config") or {}
    zero = _read_json(d / "zeroshot.json", "zero-shot results") or {}
    layouts: dict[str, LayoutInfo] = {}
    for p in sorted((d / "layouts").glob("*.json")):
        obj = _read_json(p, "layout")
        s = obj.get("score", {}) if isinstance(obj, dict) else {}
        z = zero.get(p.stem, {})
        layouts[p.stem] = LayoutInfo(p.stem, str(obj.get("kind", "unknown")), s.get("J"), s.get("ratio_to_random"),
                                     [row.get("up") for row in s.get("layers", [])], z.get("kl"), z.get("ppl"))
    runs: list[Run] = []
    for r in sorted(p for p in (d / "runs").glob("*-s*") if p.is_dir()):
        layout, _, seed = r.name.rpartition("-s")
        if not seed.isdigit():
            continue
        rows = [row for row in read_metrics(r) if row.get("kind") == "eval"]
        run = Run(r.name, layout, int(seed), is_done(r),
                  make_curve([x["step"] for x in rows], [x.get("eval_kl") for x in rows]),
                  make_curve([x["step"] for x in rows], [x.get("eval_ppl") for x in rows]))
        runs.append(run)
        if layout not in layouts:  # a run without its layout file: still shown
            layouts[layout] = LayoutInfo(layout, layout.split("-")[0], None, None, [], None, None)
        layouts[layout].runs.append(run)
    if not layouts and not runs:
        raise UserError(f"{d}: no layouts/ and no runs/ (not an experiment directory)")
    steps = (config.get("training") or {}).get("steps")
    if not isinstance(steps, int):
        steps = int(max((r.kl.steps[-1] for r in runs if len(r.kl.steps)), default=0))
    return Study(d, config, layouts, runs, steps)


GROUP_ORDER = LAYOUT_KINDS  # the paper's order


def groups(study: Study) -> dict[str, list[LayoutInfo]]:
    """Layouts by group, the paper's order first (optimised, contiguous, random, ...)."""
    out: dict[str, list[LayoutInfo]] = {}
    for info in study.layouts.values():
        out.setdefault(info.kind, []).append(info)
    rank = {g: i for i, g in enumerate(GROUP_ORDER)}
    return dict(sorted(out.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


def mid_step(study: Study) -> int:
    return study.steps // 2


def layout_kl(info: LayoutInfo, step: int) -> float | None:
    """The seed-mean KL of a layout at `step` (step 0 of an untrained layout: its zero-shot KL)."""
    vals = [r.kl.at(step) for r in info.runs]
    vals = [v for v in vals if v is not None]
    if vals:
        return sum(vals) / len(vals)
    return info.zero_kl if step == 0 else None
