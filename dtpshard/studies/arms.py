"""An experiment's arm: its [[arms]] table (`Arm`), and the same resolved (`plan_arm`) into the
layouts it makes (`LayoutSpec`, each a file layouts/NAME.json) and the runs it trains (`ArmPlan`,
each runs/NAME). The names say what differs between arms, so a report groups runs by name alone.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from dtpshard.core.errors import UserError
from dtpshard.core.vocab import (
    OPTIMISING_KINDS,
    Count,
    DelayedBy,
    DelayedShare,
    LayoutKind,
    LearningRate,
    NonNegativeNumber,
    Proxy,
    Seed,
    SharedBy,
    SharedFraction,
)
from dtpshard.layouts.delayed import suffix as partial_suffix
from dtpshard.training.recipes import RecipeName

OPTIMISING = OPTIMISING_KINDS


@dataclass(kw_only=True)
class Arm:
    """One [[arms]] table: a layout family, its training seeds ([] scores it only), random
    layouts' seeds, and for optimising kinds the number of optimised layers and the proxy
    optimised (default: the experiment's first). `adapters`: the arm trains low-rank adapters
    of this rank (distill --adapters), its runs named NAME-rRANK-sSEED, with `lr` (default the
    [training] table's) as its peak learning rate. `shared`: the fraction of every layer's neurons
    its layouts replicate (docs/design.md §6; `dtpshard layout --shared`), chosen as `shared_by`
    says; its layouts are named KIND-sharedPERCENT and form their own group in the report.
    `recipe`: the arm trains with this recipe (distill --recipe; default the [training] table's),
    its runs named NAME-RECIPE-sSEED; a full-distillation arm's own `lr` is named too
    (NAME-lrLR-sSEED). Such runs are the report's recipe arms (studies/recipes.py). `delayed`: this share of
    the modules delayed, chosen `delayed_by` (layouts KIND-delayedPCT[-BY]); `ce_weight`: its own (runs -ceW)."""

    kind: LayoutKind
    seeds: list[Seed] = field(default_factory=lambda: [0])
    layout_seeds: list[Seed] | None = None
    layers: Count | None = None
    proxy: Proxy | None = None
    name: str | None = None
    adapters: Count | None = None
    lr: LearningRate | None = None
    shared: SharedFraction = 0.0
    shared_by: SharedBy = "fo"
    recipe: RecipeName | None = None
    delayed: DelayedShare | None = None
    delayed_by: DelayedBy = "sensitivity"
    ce_weight: NonNegativeNumber | None = None


@dataclass(kw_only=True)
class LayoutSpec:
    """One layout an arm makes: layouts/NAME.json (proxy: the affinity an optimising kind uses)."""

    name: str
    kind: LayoutKind
    seed: Seed = 0
    layers: Count | None = None
    proxy: Proxy | None = None
    shared: SharedFraction = 0.0
    shared_by: SharedBy = "fo"
    delayed: DelayedShare | None = None  # a partial student's share of delayed modules (None: every module)
    delayed_by: DelayedBy = "sensitivity"


@dataclass(kw_only=True)
class ArmPlan:
    """An arm resolved: its layouts, each trained with every seed (with adapters of rank
    `adapters`, at peak learning rate `lr`, where given)."""

    kind: LayoutKind
    seeds: list[Seed]
    layouts: list[LayoutSpec]
    adapters: Count | None = None
    lr: LearningRate | None = None
    recipe: RecipeName | None = None
    ce_weight: NonNegativeNumber | None = None

    def run_name(self, layout: str, seed: int) -> str:
        """runs/NAME: the layout's name, the adapters' rank, the arm's own recipe, a full
        distillation's own lr, its own CE weight, the seed."""
        return (f"{layout}{'' if self.adapters is None else f'-r{self.adapters}'}"
                f"{'' if self.recipe is None else f'-{self.recipe}'}"
                f"{'' if self.lr is None or self.adapters is not None else f'-lr{self.lr:g}'}"
                f"{'' if self.ce_weight is None else f'-ce{self.ce_weight:g}'}-s{seed}")


def plan_arm(arm: Arm, where: str, proxies: list[str]) -> ArmPlan:
    """The [[arms]] table at `where` checked against the experiment's proxies and resolved into
    its layouts (named as Arm says); one line naming the key if anything is wrong."""
    kind = arm.kind
    for key in ("seeds", "layout_seeds"):
        seeds = getattr(arm, key)
        if seeds is not None and len(set(seeds)) != len(seeds):
            raise UserError(f"{where}.{key} = {seeds!r}: repeats a seed")
    if arm.layout_seeds is not None and kind != "random":
        raise UserError(f"{where}.layout_seeds: only random arms have layout seeds")
    if arm.layers is not None and kind not in OPTIMISING:
        raise UserError(f"{where}.layers: only optimising kinds ({', '.join(OPTIMISING)}) take layers")
    proxy = arm.proxy
    if proxy is not None and kind not in OPTIMISING:
        raise UserError(f"{where}.proxy: only optimising kinds ({', '.join(OPTIMISING)}) take a proxy")
    if proxy is not None and proxy not in proxies:
        raise UserError(f"{where}.proxy = {proxy!r}: not one of the experiment's proxies ({', '.join(proxies)})")
    if kind in OPTIMISING and proxy is None:
        proxy = proxies[0]
    base = arm.name or (kind + ("" if arm.layers is None else f"-layers-{arm.layers}")
                        + ("" if proxy in (None, proxies[0]) else f"-{proxy}") + shared_suffix(arm.shared))
    base += partial_suffix(arm.delayed, arm.delayed_by)
    shared = {"shared": arm.shared, "shared_by": arm.shared_by, "delayed": arm.delayed, "delayed_by": arm.delayed_by}
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", base):
        raise UserError(f"{where}.name = {base!r}: use letters, digits, '.', '_' and '-' only")
    if kind == "random":
        layout_seeds = arm.layout_seeds if arm.layout_seeds is not None else [0]
        if not layout_seeds:
            raise UserError(f"{where}.layout_seeds = []: give at least one")
        layouts = [LayoutSpec(name=f"{base}-{s}", kind=kind, seed=s, **shared) for s in layout_seeds]
    else:
        layouts = [LayoutSpec(name=base, kind=kind, layers=arm.layers, proxy=proxy, **shared)]
    return ArmPlan(kind=kind, seeds=list(arm.seeds), layouts=layouts, adapters=arm.adapters, lr=arm.lr,
                   recipe=arm.recipe, ce_weight=arm.ce_weight)


def shared_suffix(fraction: float) -> str:
    """What a shared arm's layouts add to their name and kind: -shared10 for 10% (none for 0)."""
    return f"-shared{100 * fraction:.4g}" if fraction else ""
