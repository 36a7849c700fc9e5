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
from dtpshard.core.io import read_json_object
from dtpshard.core.layout import Layout, is_layout_file
from dtpshard.core.owned import every
from dtpshard.core.vocab import LAYOUT_KINDS
from dtpshard.studies import stats
from dtpshard.studies.config import Experiment, read_record
from dtpshard.studies.provenance import LAYOUT_DIR, PROVENANCE, RUNS, SCORES, TEACHER_CACHE, TIMINGS, ZEROSHOT
from dtpshard.studies.stats import Curve, make_curve


@dataclass
class Run:
    name: str  # runs/NAME-sSEED
    layout: str
    seed: int
    done: bool
    kl: Curve
    ppl: Curve
    top1: Curve  # agreement with the teacher's argmax (empty for runs evaluated before it was recorded)
    adapters: int | None = None  # the adapters' rank (runs/NAME-rRANK-sSEED); None: full distillation
    recipe: str = "paper"  # the distillation recipe it trained with (training/recipes.py)
    lr: float | None = None  # its peak learning rate (config.json; None: not recorded)
    ce_weight: float | None = None  # its CE term's weight (config.json; None: not recorded)


EDGE_KINDS = ("up", "down", "attention->attention", "FFN->FFN")  # b - a = 1 or 2 (δ <= 2), by the source


def edge_kind(a: int, b: int) -> str:
    """An edge (a, b) by what it joins: heads -> neurons of a layer (up), neurons -> the next
    layer's KV groups (down), or, from δ = 2, one attention (FFN) to the next."""
    if b - a == 1:
        return "up" if a % 2 == 0 else "down"
    if b - a == 2:
        return "attention->attention" if a % 2 == 0 else "FFN->FFN"
    return f"{'attention' if a % 2 == 0 else 'FFN'}->{'attention' if b % 2 == 0 else 'FFN'} ({b - a} apart)"


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
    proxy_J: dict[str, float] = field(default_factory=dict)  # J under each proxy (scores.json)
    same_as: str | None = None  # the name of an identical layout listed before it (same units per device)
    identity: str | None = None  # Layout.function_key of its layout file (None: unreadable)
    edge_fractions: dict[str, float] = field(default_factory=dict)  # edge kind -> mean co-located fraction
    # a partial student's layout: score.delayed of its file (count, modules, by, sensitivity); None: every module
    delayed: dict[str, Any] | None = None
    zero_top1: float | None = None


@dataclass
class Study:
    directory: Path
    config: Experiment | None  # config.json (None: none yet)
    layouts: dict[str, LayoutInfo]
    runs: list[Run]
    steps: int  # planned training steps (the end of the curves)
    proxies: list[str] = field(default_factory=list)  # scored proxies, the optimised one first
    timings: dict[str, float] = field(default_factory=dict)  # phase -> wall seconds (timings.json)
    provenance: dict[str, Any] = field(default_factory=dict)  # provenance.json
    sources: dict[str, str] = field(default_factory=dict)  # train_data / eval_data of a run's config.json
    adapter_runs: list[Run] = field(default_factory=list)  # runs that trained adapters: in no layout's runs
    # full-distillation runs with the recipe or lr of their arm, not the [training] table's: in no layout's runs
    recipe_runs: list[Run] = field(default_factory=list)


# Every file is written by dtpshard; one edited by hand (or damaged) is refused by name here, before
# the tables and figures meet a value of the wrong type.
def _read_json(path: Path, what: str) -> dict[str, Any] | None:
    if not path.exists():
        return None
    return read_json_object(path, what)


def _table(obj: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    v = obj.get(key, {})
    if not isinstance(v, dict):
        raise UserError(f"{path}: {key!r} must be a JSON object, found {json.dumps(v)[:40]}")
    return v


_KL = (stats.is_kl, f"a KL: a finite number from 0 to {stats.MAX_KL:g}")
_PPL = (stats.is_perplexity, f"a perplexity: a finite number from 1 to {stats.MAX_PERPLEXITY:g}")
_TOP1 = (stats.is_fraction, "an agreement: a number from 0 to 1")
# each measured key a report reads, checked as what it measures (studies/stats.py): a value out of
# its range would reach a figure's axes or a table as a number no run can give
MEASURES = {"kl": _KL, "eval_kl": _KL, "ppl": _PPL, "eval_ppl": _PPL, "top1": _TOP1, "eval_top1": _TOP1,
            "step": (stats.is_step, "a step: an integer from 0 to 2^31"),
            "J": (lambda v: stats.is_number(v) and v >= 0, "a score J: a finite number >= 0"),
            # a layout's co-located share of an edge's affinity (the per-layer up edge is one of them)
            "colocated": (stats.is_fraction, "a co-located fraction: from 0 to 1"),
            "up": (stats.is_fraction, "a co-located fraction: from 0 to 1"),
            # J over its random expectation (edges / L): at most L, and no layout has 2^16 devices
            "ratio_to_random": (lambda v: stats.is_number(v) and 0 <= v <= 1 << 16,
                                "J over its random expectation: from 0 to the layout's L")}


def _num(obj: dict[str, Any], key: str, path: Path, kind: type = float, measure: str | None = None) -> Any:
    """obj[key] as a number (None when absent or null); anything else names the file. `measure`
    (default the key): a key of MEASURES the value must be."""
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise UserError(f"{path}: {key!r} must be {'an integer' if kind is int else 'a number'}, found "
                        f"{json.dumps(v)[:40]}")
    ok, wants = MEASURES.get(measure or key, (stats.is_number, "a finite number"))
    if not ok(v):
        raise UserError(f"{path}: {key!r} must be {wants}, found {json.dumps(v)[:40]}")
    return v


def _config(d: Path) -> Experiment | None:
    path = d / "config.json"
    data = _read_json(path, "experiment config")
    return None if data is None else read_record(data, str(path))


def _identity(obj: dict[str, Any], where: Path) -> str | None:
    """Layout.function_key of a layout file; None for one this version cannot read (never merged)."""
    try:
        return Layout.from_json(obj, where=str(where)).function_key()
    except UserError:
        return None


def _layout_info(p: Path, zero: dict[str, Any], zero_path: Path) -> LayoutInfo:
    obj = _read_json(p, "layout") or {}
    s = _table(obj, "score", p)
    rows = s.get("layers", [])
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise UserError(f"{p}: score.layers must be a list of objects")
    z = _table(zero, p.stem, zero_path)
    edges = s.get("edges", [])
    if not isinstance(edges, list) or not all(isinstance(e, dict) for e in edges):
        raise UserError(f"{p}: score.edges must be a list of objects")
    by_kind: dict[str, list[float]] = {}
    for e in edges:
        a, b, v = _num(e, "src", p, int), _num(e, "dst", p, int), _num(e, "colocated", p)
        if None not in (a, b, v):
            by_kind.setdefault(edge_kind(a, b), []).append(v)
    delayed = None
    if obj.get("delayed") is not None or "delayed" in s:
        d = _table(s, "delayed", p)
        count, modules = _num(d, "count", p, int), _num(d, "modules", p, int)
        if count is None or modules is None or not 0 < count <= modules:
            raise UserError(f"{p}: score.delayed must give count and modules, 0 < count <= modules")
        by = d.get("by")
        if by is not None and not isinstance(by, str):
            raise UserError(f"{p}: score.delayed.by must be a string")
        delayed = {"count": count, "modules": modules, "by": by}
    ratio, devices = _num(s, "ratio_to_random", p), obj.get("devices")
    if ratio is not None and isinstance(devices, int) and not isinstance(devices, bool) and ratio > devices:
        raise UserError(f"{p}: 'ratio_to_random' must be J over its random expectation: from 0 to the layout's L "
                        f"({devices}), found {json.dumps(ratio)[:40]}")
    return LayoutInfo(p.stem, str(obj.get("kind", "unknown")), _num(s, "J", p), ratio,
                      [_num(row, "up", p) for row in rows], _num(z, "kl", zero_path), _num(z, "ppl", zero_path),
                      identity=_identity(obj, p),
                      edge_fractions={k: sum(v) / len(v) for k, v in by_kind.items()}, delayed=delayed,
                      zero_top1=_num(z, "top1", zero_path))


def _eval_rows(run: Path) -> list[dict[str, Any]]:
    from dtpshard.training.rundir import METRICS, read_metrics

    path = run / METRICS
    rows = [row for row in read_metrics(run) if row.get("kind") == "eval"]
    for row in rows:
        if _num(row, "step", path) is None:
            raise UserError(f"{path}: an eval row without a step")
        _num(row, "eval_kl", path)
        _num(row, "eval_ppl", path)
        _num(row, "eval_top1", path)
    return rows


def _adapters(run: Path) -> int | None:
    """The adapters' rank a run trained (its config.json's `adapters`), None for full distillation."""
    cfg = _read_json(run / "config.json", "run config") or {}
    rank = cfg.get("adapters")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
        raise UserError(f"{run / 'config.json'}: adapters must be a positive integer or null, found {rank!r}")
    return rank


def _training(run: Path) -> tuple[str, float | None, str | None, float | None]:
    """(recipe, lr, layout name, CE weight) a run trained with, from its config.json (a run from
    before recipes: the paper's)."""
    from dtpshard.training.recipes import RECIPES

    path = run / "config.json"
    cfg = _read_json(path, "run config") or {}
    recipe = cfg.get("recipe", "paper")
    if recipe not in RECIPES:
        raise UserError(f"{path}: recipe must be one of {', '.join(RECIPES)}, found {recipe!r}")
    lr = _num(cfg, "lr", path) if "lr" in cfg else None
    layout = cfg.get("layout")
    ce = _num(cfg, "ce_weight", path) if "ce_weight" in cfg else None
    return recipe, lr, Path(layout).stem if isinstance(layout, str) and layout else None, ce


def load_study(directory: Path) -> Study:
    from dtpshard.training.rundir import DONE

    d = Path(directory)
    if not d.is_dir():
        raise UserError(f"{d}: no such experiment directory")
    config = _config(d)
    zero = _read_json(d / ZEROSHOT, "zero-shot results") or {}
    layouts: dict[str, LayoutInfo] = {}
    seen: dict[str, str] = {}
    rank = {k: i for i, k in enumerate(LAYOUT_KINDS)}  # the paper's families name a duplicate first
    for p in sorted((d / LAYOUT_DIR).glob("*.json")):
        layouts[p.stem] = _layout_info(p, zero, d / ZEROSHOT)
    runs: list[Run] = []
    adapter_runs: list[Run] = []
    recipe_runs: list[Run] = []
    for r in sorted(p for p in (d / RUNS).glob("*-s*") if p.is_dir()):
        layout, _, seed = r.name.rpartition("-s")
        if not seed.isdigit():
            continue
        rows = _eval_rows(r)
        lowrank = _adapters(r)
        recipe, lr, layout_file, ce = _training(r)
        if lowrank is not None:  # NAME-rRANK[-RECIPE]: the layout file names its layout
            layout = layout_file or layout.removesuffix(f"-r{lowrank}")
        own = config is not None and lowrank is None and (  # a run that records no lr trained the study's
            recipe != config.training.recipe or lr not in (None, config.training.lr)
            or ce not in (None, config.training.ce_weight))
        if own and layout_file:
            layout = layout_file
        run = Run(r.name, layout, int(seed), (r / DONE).is_file(),  # finished, even with its weights removed
                  *(make_curve([x["step"] for x in rows], [x.get(k) for x in rows])
                    for k in ("eval_kl", "eval_ppl", "eval_top1")), adapters=lowrank, recipe=recipe, lr=lr,
                  ce_weight=ce)
        if lowrank is not None:
            adapter_runs.append(run)
            continue
        if own:
            recipe_runs.append(run)
            continue
        runs.append(run)
        if layout not in layouts:  # a run without its layout file: still shown
            layouts[layout] = LayoutInfo(layout, layout.split("-")[0], None, None, [], None, None)
        layouts[layout].runs.append(run)
    if not layouts and not runs:
        raise UserError(f"{d}: no layouts/ and no runs/ (not an experiment directory)")
    # of identical layouts the one kept is a trained one, then the paper's family first
    for name in sorted(layouts, key=lambda n: (not layouts[n].runs, rank.get(layouts[n].kind, len(rank)), n)):
        key = layouts[name].identity
        if key in seen:
            layouts[name].same_as = seen[key]
        elif key is not None:
            seen[key] = name
    scores_path = d / SCORES
    scores = _read_json(scores_path, "proxy scores") or {}
    for name, info in layouts.items():
        table = _table(scores, name, scores_path)
        info.proxy_J = {p: _num(table, p, scores_path, measure="J") for p in table}
    proxies = config.proxies if config else Experiment(model="").proxies  # no config.json yet: the default
    # a layout optimised under another proxy: J is still the first's. J/random keeps its meaning:
    # every edge is normalised to sum 1 whatever the proxy, so the random expectation is n_edges / L for all
    for info in layouts.values():
        J = info.proxy_J.get(proxies[0])
        if J is not None and info.J is not None and info.J != J:
            info.ratio = None if not info.ratio or not info.J else J * info.ratio / info.J
            info.J = J
            info.up = [None] * len(info.up)  # its per-layer parts are under its own proxy: not shown with the others
    timings_path = d / TIMINGS
    timings = _read_json(timings_path, "timings") or {}
    for k in timings:
        if _num(timings, k, timings_path) is None:
            raise UserError(f"{timings_path}: {k!r} must be a number, found null")
    steps = config.training.steps if config else int(max((r.kl.steps[-1] for r in runs if len(r.kl.steps)), default=0))
    prov_path = d / PROVENANCE
    provenance = _read_json(prov_path, "provenance") or {}
    for key in ("versions", "model_files", "data", "tokens"):
        _table(provenance, key, prov_path)
    if provenance.get("model_source") is not None:
        _table(provenance, "model_source", prov_path)
    sources: dict[str, str] = {}
    for run in runs[:1]:  # every run reads the same corpus split; its config.json names it
        path = d / RUNS / run.name / "config.json"
        cfg = _read_json(path, "run config") or {}
        sources = {k: str(cfg[k]) for k in ("train_data", "eval_data") if cfg.get(k) is not None}
    return Study(d, config, layouts, runs, steps, list(proxies), timings, provenance, sources, adapter_runs,
                 recipe_runs)


GROUP_ORDER = LAYOUT_KINDS  # the paper's order


def groups(study: Study) -> dict[str, list[LayoutInfo]]:
    """Layouts by group, the paper's order first (optimised, contiguous, random, ...)."""
    out: dict[str, list[LayoutInfo]] = {}
    for info in study.layouts.values():
        out.setdefault(info.kind, []).append(info)
    rank = {g: i for i, g in enumerate(GROUP_ORDER)}
    return dict(sorted(out.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


def distinct(study: Study) -> list[LayoutInfo]:
    """The layouts without those identical to one listed before (a correlation over layouts
    counts each function once: e.g. neurons-only equals optimised when every device holds one KV group)."""
    return [i for i in study.layouts.values() if i.same_as is None]


def mid_step(study: Study) -> int:
    return study.steps // 2


def layout_kl(info: LayoutInfo, step: int) -> float | None:
    """The seed-mean KL of a layout at `step` (step 0 of an untrained layout: its zero-shot KL)."""
    vals = [r.kl.at(step) for r in info.runs]
    vals = [v for v in vals if v is not None]
    if vals:
        return sum(vals) / len(vals)
    return info.zero_kl if step == 0 else None


# -- what --force may clear ----------------------------------------------------------------------
FIGURES = ("curves", "j_vs_kl", "proxies", "up_edge", "head_start", "seeds", "adapters", "recipes",
           "shared", "delayed")  # figures/NAME.png


def _file(check: Any) -> Any:
    """The check of one entry that must be a regular file `check` accepts (unreadable: not ours)."""
    def entry(p: Path) -> Path | None:
        try:
            return None if p.is_file() and not p.is_symlink() and check(p) else p
        except (OSError, UserError):
            return p
    return entry


def _run(p: Path) -> Path | None:
    from dtpshard.training.rundir import RUN_TREE

    return RUN_TREE(p) if p.is_dir() and not p.is_symlink() else p


def _cache(d: Path) -> Path | None:
    from dtpshard.training.teacher_cache import CACHE_TREE

    return None if not any(d.iterdir()) else CACHE_TREE(d)


# the directories `experiment --force` may clear, each by what the experiment writes into it, at every depth
CLEARABLE = {LAYOUT_DIR: every(_file(lambda p: p.suffix == ".json" and is_layout_file(p))), RUNS: every(_run),
             TEACHER_CACHE: _cache, "figures": every(_file(lambda p: p.suffix == ".png" and p.stem in FIGURES)),
             "downstream": every(_file(lambda p: p.suffix == ".json"))}  # studies/downstream.py's kept items
