"""Where a decode step's time goes in vLLM's compiled engine, per arm: the torch profiler on the ranks of
bench/bench_vllm.py's random model (TP 2, one pinned core a rank, vLLM's external launcher).

Every rank is profiled: a wait on one rank is the other's lateness. Arms: TP (the dense twin:
vLLM's blocking shared-memory all-reduce after every module), DTP with the ring's native kernels
(transport/ring.cpp), DTP with its Python kernels (DTPSHARD_NATIVE=0: the ring before the native
kernels), DTP over the collective (DTPSHARD_EXCHANGE=collective: torch's functional all-reduce on
gloo, its wait in `wait_tensor`) and no-comm (the student with its reduces removed: the same work,
no transfer). `--vllm-gloo` takes vLLM's shared-memory all-reduce away (bench/vllm_link.py), as on
a host whose vLLM CPU build lacks it (AVX2): TP's sums are then gloo's too. Per
batch, a generate of 1 new token is profiled and one of N; their difference over N − 1 is a
decode step. Inductor's kernels are named in the profile
(TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1), so a step splits into:

- GEMMs: the extern matrix products (aten, mkldnn, vLLM's CPU ops);
- fused elementwise: Inductor's kernels (norms, rotary, SiLU·mul, the residual adds and, for DTP,
  the landings' x + s·p + w·Σ − w·p_l, which Inductor fuses with its neighbours);
- attention: vLLM's CPU attention ops;
- the sums: DTP's exchange_start and exchange_value (the wait inside them is `ring_wait`), TP's
  `_C::shm_allreduce` (its wait is inside it), or on gloo the functional all-reduce's start and
  its `wait_tensor` (what the rank's own thread spends; gloo's work runs on gloo's thread, on the
  same pinned core, and shows as time taken from everything else);
- the rest: the step's wall time less all of the above (vLLM's scheduler, sampling, the
  compiled wrapper's Python, the profiler's own cost).

A profiled step is slower than an unprofiled one (each recorded op costs about a µs): read the
µs per op, and take the arms' throughput from bench/bench_vllm.py.

    python bench/profile_vllm.py --batch 1 8 --json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_vllm import bench_prompts, engine_spec, make_pair, run_engines  # noqa: E402

SUMS = {"dtpshard::exchange_start": "start", "dtpshard::exchange_value": "value", "dtpshard::ring_wait": "wait",
        "_C::shm_allreduce": "all-reduce", "_c10d_functional::all_reduce_": "start",
        "_c10d_functional::all_reduce": "start", "_c10d_functional::wait_tensor": "value"}


def kind(name: str) -> str | None:
    """The part of a step an event's own time belongs to (None: counted in its parent)."""
    if name in SUMS:
        return "sums"
    if "cpp_fused" in name or name.startswith("graph_"):
        return "fused elementwise"
    if any(k in name for k in ("attention", "paged_attention", "attn")):
        return "attention"
    if any(k in name for k in ("aten::mm", "aten::addmm", "mkldnn", "onednn", "_C::gemm", "aten::linear",
                               "aten::matmul", "_C::mla", "cpu_gemm", "dnnl")):
        return "GEMMs"
    return None


def per_step(profile: dict, batch: int, new: int) -> dict:
    """{"ms": a decode step, event name: [calls, self µs, total µs] per step}."""
    one, many = profile[f"{batch}/1"], profile[f"{batch}/{new}"]
    steps = new - 1
    out = {"ms": (many["seconds"] - one["seconds"]) / steps * 1e3}
    for name, (calls, self_us, total_us) in many["events"].items():
        c0, s0, t0 = one["events"].get(name, (0, 0.0, 0.0))
        out[name] = [(calls - c0) / steps, (self_us - s0) / steps, (total_us - t0) / steps]
    return out


def breakdown(step: dict) -> dict:
    """A step's µs by part (see the module docstring), and the sums' calls and µs per call."""
    parts = {"fused elementwise": 0.0, "attention": 0.0, "GEMMs": 0.0}
    for name, v in step.items():
        k = kind(name) if name != "ms" else None
        if k in parts:
            parts[k] += v[1]  # self time: a kernel's children (if any) are counted where they belong
    ev = {k: [0, 0.0, 0.0] for k in SUMS.values()}
    for name, k in SUMS.items():
        ev[k] = [a + b for a, b in zip(ev[k], step.get(name, [0, 0.0, 0.0]))]
    sums_us = ev["start"][2] + ev["value"][2] + ev["all-reduce"][2]
    parts["sums"] = sums_us
    parts["rest"] = step["ms"] * 1e3 - sum(parts.values())
    sums = ev["start"][0] or ev["all-reduce"][0]
    wait = ev["wait"][2]
    parts.update({
        "step µs": step["ms"] * 1e3, "sums per step": sums,
        "start µs/call": ev["start"][2] / ev["start"][0] if ev["start"][0] else None,
        "value µs/call": ev["value"][2] / ev["value"][0] if ev["value"][0] else None,
        "all-reduce µs/call": ev["all-reduce"][2] / ev["all-reduce"][0] if ev["all-reduce"][0] else None,
        "wait µs per step": wait,
        # DTP's per-sum work: its two ops less the time they spent waiting for a peer
        "per-sum work µs": (ev["start"][2] + ev["value"][2] - wait) / ev["start"][0] if ev["start"][0] else None,
    })
    return parts


def table(rows: list[dict]) -> str:
    head = ["arm", "batch", "rank", "step µs", "GEMMs", "fused elementwise", "attention", "sums", "rest",
            "sums/step", "start µs/call", "value µs/call", "wait µs/step", "per-sum work µs", "all-reduce µs/call"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]

    def f(v):
        return "–" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)

    for r in rows:
        b = r["parts"]
        lines.append("| " + " | ".join([r["arm"], str(r["batch"]), str(r["rank"]), f(b["step µs"]), f(b["GEMMs"]),
                                        f(b["fused elementwise"]), f(b["attention"]), f(b["sums"]), f(b["rest"]),
                                        f(b["sums per step"]), f(b["start µs/call"]), f(b["value µs/call"]),
                                        f(b["wait µs per step"]), f(b["per-sum work µs"]),
                                        f(b["all-reduce µs/call"])]) + " |")
    return "\n".join(lines)


def main() -> int:
    from dtpshard.serve.env import found_python, runtime_env

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new", type=int, default=33)
    ap.add_argument("--arms", nargs="+", default=["tp", "dtp", "dtp_python", "nocomm"],
                    choices=["tp", "dtp", "dtp_python", "dtp_collective", "nocomm"])
    ap.add_argument("--vllm-gloo", action="store_true", help="vLLM's communicator on gloo, as on an AVX2 host")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    python = found_python()
    if python is None or not python.exists():
        raise SystemExit("no vLLM environment: run `python -m dtpshard.serve.env` first")
    tp = 2
    prompts = bench_prompts(max(args.batch))
    env = dict(runtime_env(), OMP_NUM_THREADS="1", TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE="1")
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        student, dense = make_pair(Path(tmp), tp)

        def spec(model: Path, extra: dict | None = None, remove: bool = False) -> dict:
            return engine_spec(model, tp, prompts, args.batch, threads=1, env=extra, remove=remove,
                               vllm_gloo=args.vllm_gloo, profile={"batches": args.batch, "max_tokens": args.new})

        specs = {"tp": spec(dense), "dtp": spec(student), "dtp_python": spec(student, {"DTPSHARD_NATIVE": "0"}),
                 "dtp_collective": spec(student, {"DTPSHARD_EXCHANGE": "collective"}),
                 "nocomm": spec(student, remove=True)}
        specs = {a: specs[a] for a in args.arms}
        results = dict(zip(specs, run_engines(python, list(specs.values()), tp, env)))
    load = os.getloadavg()
    rows = []
    for arm, r in results.items():
        for b in args.batch:
            for rank, profile in enumerate(r["profile"]):
                step = per_step(profile, b, args.new)
                rows.append({"arm": arm, "batch": b, "rank": rank, "transport": r["transport"],
                             "parts": breakdown(step),
                             "top": sorted(((v[1], k) for k, v in step.items() if k != "ms"), reverse=True)[:12]})
    print(f"vLLM compiled, TP {tp}, 1 thread per rank pinned, {os.cpu_count()} cores, load average before "
          f"{load0[0]:.2f}, after {load[0]:.2f}; µs per decode step on each rank (profiled)"
          + ("; vLLM's communicator on gloo (--vllm-gloo)" if args.vllm_gloo else ""))
    print(table(rows))
    for arm in results:
        print(f"- {arm}: {results[arm]['transport']}")
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "top"} for r in rows]))
    for r in rows:
        print(f"\n{r['arm']} batch {r['batch']} rank {r['rank']}: most self time per step: " +
              ", ".join(f"{k} {us:.0f}" for us, k in r["top"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
