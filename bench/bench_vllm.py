"""vLLM decode throughput of a DTP student against plain TP on the same weights, in vLLM's default
(compiled) mode, with and without an emulated slower link.

The same random weights served four ways, each by one engine in its own `torchrun
--nproc-per-node TP` (tests/vllm_driver.py; vLLM's external launcher), under the same settings:

- DTP: the student (DTPModel.save_pretrained, model_type "dtp", L = TP, δ = 1);
- TP: its permuted dense twin (the same safetensors with the family's config, model_type "llama"),
  which vLLM serves as a Llama with a blocking all-reduce after every module on vLLM's own
  communicator (shared memory on an AVX-512 host, gloo where its CPU build has no shared-memory
  all-reduce);
- TP over the ring: the same weights as a student of δ = 0 (tensor parallelism: every sum blocks
  where it is made) over the student's own transport: DTP against it is what the overlap alone buys;
- no-comm: the student with its module reduces removed (bench/vllm_link.py): the same work, a
  wrong function, the most the delayed reduce can give;
- with --python-arm, the student again on the ring's Python kernels (DTPSHARD_NATIVE=0): the
  ring before its native kernels (transport/native.py);
- with --collective-arm, the student again with its partials on the collective
  (DTPSHARD_EXCHANGE=collective: gloo here), the transport before the shared-memory ring;
- with --shared FRACTION [FRACTION ...], a shared student of the same weights per fraction
  (docs/design.md §6: that fraction of every layer's neurons, drawn at random, replicated on every
  rank, the rest contiguous; which neurons does not change the cost), on the same transport and
  settings as the student; the table then says the weights a rank holds;
- with --delayed SHARE [SHARE ...], a partial student of the same weights per share (docs/design.md
  §1, per-module delay: that share of the modules, drawn at random with seed 0, delayed, every other
  module's sum blocking (transport/choose.py `blocking_sum`); which modules barely changes the cost). With
  --json each share adds one row per (batch, latency) with the same fields, `dtp_*` being that
  student's, and `delayed` (the share; 1.0 in the full student's rows);
- with --plain-arm ring|engine, each partial student again with the sums that block anyway (its
  plain modules', the final mean's) forced onto that path (arm dtp_plainKIND_delayedPCT, in the
  rows of the full student): the library's choice (transport/choose.py `blocking_sum`) against the
  other, in one run.

Each row names what each arm's sums travel over (the engine's own report): the student's
shared-memory ring (transport/shared.py) or a collective, and TP's vLLM communicator.
`--vllm-gloo` takes vLLM's shared-memory all-reduce away from every arm (harness only,
bench/vllm_link.py): vLLM's communicator is then gloo, as on a host whose vLLM CPU build has no
shared-memory all-reduce (AVX2), whatever this host's ISA. `--plain ring|engine` forces the path
of the sums that block anyway (a partial student's plain modules', the final mean's) in every
arm; the default is the library's (transport/choose.py `blocking_sum`). `--executor mp` times
the same pair in vLLM's own multiprocess executor instead, each worker pinned to its own cores,
at latency 0 (the harness needs the ranks' own processes, so there is no no-comm arm there).

`--latency-ms` adds a fixed latency to every all-reduce of every arm, the same for each (harness
only, bench/vllm_link.py): in series with the transfer, so TP waits all of it after every module
while DTP's delayed reduce waits only for what δ modules of compute have not covered. Per batch B,
prompts of 32 tokens:

    time per output token = (t(N new) − t(1 new)) / (N − 1)   (the prefill cancels)
    decode tokens/s       = B / time per output token

the median of `--repeat` runs in one engine, repeats interleaved over the latencies. Each arm's
engine is started once per round (`--rounds`, default 2), the arms alternated, each round in a
rotated order: a cell is the median over the rounds, a ratio to TP the median of the rounds'
ratios with their range (min–max), marked where the range crosses 1. "model share" is the part of
a decode step spent in the model's forward (the rest is vLLM's scheduler, sampling and LM head).
Each rank runs `--threads` torch threads pinned to its own cores.

    python bench/bench_vllm.py --tp 2 --batch 1 8 --latency-ms 0 0.5 --json

The last line with --json is a JSON list of rows {executor, tp, batch, latency_ms, rounds, and per
arm ARM_tok_s (the median), ARM_tok_s_rounds, ARM_per_tp and ARM_per_tp_range (not for tp),
for each DTP arm ARM_per_tp_ring and ARM_per_tp_ring_range (against TP over the ring), and
ARM_transport and ARM_model_share (the model forward's share of a decode step)}. Run by the
project's python; vLLM runs in the environment `python -m dtpshard.serve.env` builds (or
$DTPSHARD_VLLM_PYTHON), as for the tests.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from vllm_students import (  # noqa: E402  (the arms' models; callers import them from here too)
    SHAPE,
    delayed_arm,
    make_delayed,
    make_pair,
    make_shared,
    plain_arm_name,
    rank_weights,
    shared_arm,
)

PROMPT = 32


def run_engines(python: Path, specs: list[dict], tp: int, env: dict, executor: str = "external") -> list[dict]:
    """Each spec's engine in its own torchrun (a second engine in the same ranks can hang), or with
    executor "mp" in one plain process that starts vLLM's own TP workers."""
    from vllm_driver import launch

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(specs):
            (Path(tmp) / f"{i}.json").write_text(json.dumps([spec]))
            done = launch(python, Path(tmp, f"{i}.json"), Path(tmp, f"{i}-out.json"),
                          world=None if executor == "mp" else tp, env=env)
            if done.returncode or not (Path(tmp) / f"{i}-out.json").exists():
                raise SystemExit(f"vLLM failed:\n{done.stderr[-4000:]}")
            (result,) = json.loads((Path(tmp) / f"{i}-out.json").read_text())
            if "error" in result:
                raise SystemExit(result["error"])
            results.append(result)
    return results


def tok_s(result: dict, lat: float, b: int, new: int) -> tuple[float, float]:
    """(decode tokens/s, the model forward's share of a decode step) at latency `lat`, batch b."""
    med = {n: (statistics.median(result["timings"][f"{lat:g}/{b}/{n}"]),
               statistics.median(result["model_seconds"][f"{lat:g}/{b}/{n}"])) for n in (1, new)}
    step = (med[new][0] - med[1][0]) / (new - 1)
    return b / step, (med[new][1] - med[1][1]) / (new - 1) / step


def delayed_rows(rows: list[dict], shares: list[float]) -> list[dict]:
    """The full student's rows (delayed 1.0), then per share a copy of each whose dtp_* fields are that
    partial student's (its arm's own keys dropped from every row)."""
    arms = [delayed_arm(s) for s in shares]
    own = [{k: v for k, v in row.items() if not any(k.startswith(a + "_") for a in arms)} for row in rows]
    out = [{**row, "delayed": 1.0} for row in own]
    for share, arm in zip(shares, arms):
        for row, base in zip(rows, own):
            fields = {"dtp" + k.removeprefix(arm): v for k, v in row.items() if k.startswith(arm + "_")}
            out.append({**base, **fields, "delayed": share})
    return out


def bench_prompts(n: int) -> list[list[int]]:
    """n random prompts of PROMPT tokens, the same in every run (seed 0)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, SHAPE["vocab_size"], (PROMPT,), generator=g).tolist() for _ in range(n)]


def engine_spec(model: Path, tp: int, prompts: list, batches: list[int], threads: int, eager: bool = False,
                dtype: str = "float32", env: dict | None = None, latency: bool = False, remove: bool = False,
                vllm_gloo: bool = False, plain: str = "auto", **measure) -> dict:
    """tests/vllm_driver.py's spec of one engine serving `model` for up to max(batches) sequences;
    `measure`: what the driver measures in it (its "timing" or "profile")."""
    return {"model": str(model), "tp": tp, "dtype": dtype, "prompts": prompts[:1], "max_tokens": 1,
            "enforce_eager": eager, "max_model_len": 1024, "max_num_seqs": max(batches), "threads": threads,
            "env": env or {}, "harness": {"latency": latency, "remove_reduces": remove, "vllm_gloo": vllm_gloo,
                                          "plain": plain}, **measure}


# the last two when asked for; then dtp_sharedPCT and dtp_delayedPCT
ARMS = ("dtp", "tp", "tp_ring", "nocomm", "dtp_python", "dtp_collective")


def measure(python: Path, pair: tuple[Path, Path], tp: int, batches: list[int], latencies: list[float],
            new: int, repeat: int, threads: int = 0, eager: bool = False, dtype: str = "float32",
            env: dict | None = None, executor: str = "external", collective_arm: bool = False,
            shared: dict[str, Path] | None = None, rounds: int = 2, python_arm: bool = False,
            delayed: dict[str, Path] | None = None, vllm_gloo: bool = False, plain: str = "auto",
            plain_arm: str | None = None) -> list[dict]:
    """Rows per (latency, batch). `threads` > 0 pins each rank to that many cores (external launcher)
    or each of vLLM's workers to its own cores (executor "mp": VLLM_CPU_OMP_THREADS_BIND); the
    emulated link (CPU only) is installed when a latency is not 0 (external launcher only: the
    harness lives in the ranks' own processes). `collective_arm` adds the student with its partials
    forced onto the collective (DTPSHARD_EXCHANGE=collective): the transport before the ring.
    `python_arm` adds the student on the ring's Python kernels (DTPSHARD_NATIVE=0).
    `shared`: arm -> a shared student (make_shared), `delayed`: arm -> a partial student
    (make_delayed), each timed as the student is. `vllm_gloo`, `plain`: the harness's (the module
    docstring); `plain_arm`: each partial student again with its blocking sums on that path. Each arm's engine
    is started once a round (`rounds`); a cell is the median over the rounds, and a ratio to TP the
    median of each round's ratio, with its range."""
    from dtpshard.serve.env import runtime_env

    prompts = bench_prompts(max(batches))
    student, dense = pair

    mp = executor == "mp"

    def spec(model: Path, remove: bool, env: dict | None = None, blocking: str = plain) -> dict:
        return engine_spec(model, tp, prompts, batches, threads=0 if mp else threads, eager=eager, dtype=dtype,
                           env=env, latency=any(lat > 0 for lat in latencies), remove=remove,
                           vllm_gloo=vllm_gloo, plain=blocking,
                           timing={"batches": batches, "max_tokens": [1, new], "repeat": repeat,
                                   "latencies_ms": latencies})

    if mp and any(latencies):
        raise SystemExit("--executor mp: latency 0 only (the link harness runs in the ranks' own processes)")
    env = dict(env or runtime_env())
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
        if mp:  # each worker on its own `threads` cores
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(f"{r * threads}-{(r + 1) * threads - 1}" if threads > 1
                                                        else str(r) for r in range(tp))
    specs = {"dtp": spec(student, False), "tp": spec(dense, False),
             "tp_ring": spec(student.parent / f"tp-ring-{tp}", False)}
    if not mp:  # the no-comm ceiling needs the harness in the ranks
        specs["nocomm"] = spec(student, True)
    if python_arm:
        specs["dtp_python"] = spec(student, False, {"DTPSHARD_NATIVE": "0"})
    if collective_arm:
        specs["dtp_collective"] = spec(student, False, {"DTPSHARD_EXCHANGE": "collective"})
    for arm, path in {**(shared or {}), **(delayed or {})}.items():
        specs[arm] = spec(path, False)
    for arm, path in (delayed or {}).items() if plain_arm else ():
        specs[plain_arm_name(plain_arm, arm)] = spec(path, False, blocking=plain_arm)
    results: dict[str, list[dict]] = {arm: [] for arm in specs}
    arms = list(specs)
    for r in range(rounds):  # every arm once a round, each round's order rotated: no arm always first
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for arm, result in zip(order, run_engines(python, [specs[a] for a in order], tp, env, executor)):
            results[arm].append(result)
    rows = []
    for lat in latencies:
        for b in batches:
            row = {"tp": tp, "batch": b, "latency_ms": lat, "executor": executor, "rounds": rounds}
            per_round = {arm: [tok_s(r, lat, b, new) for r in rs] for arm, rs in results.items()}
            for arm, got in per_round.items():
                speeds = [t for t, _ in got]
                row[f"{arm}_tok_s"] = statistics.median(speeds)
                row[f"{arm}_tok_s_rounds"] = speeds
                row[f"{arm}_transport"] = results[arm][0]["transport"]
                if arm != "tp":  # the ratio to TP of each round's engines, started one after the other
                    ratios = [t / tp_t for (t, _), (tp_t, _) in zip(got, per_round["tp"])]
                    row[f"{arm}_per_tp"] = statistics.median(ratios)
                    row[f"{arm}_per_tp_range"] = [min(ratios), max(ratios)]
                if arm.startswith("dtp"):  # what the overlap alone buys: the same transport, every sum blocking
                    ratios = [t / r_t for (t, _), (r_t, _) in zip(got, per_round["tp_ring"])]
                    row[f"{arm}_per_tp_ring"] = statistics.median(ratios)
                    row[f"{arm}_per_tp_ring_range"] = [min(ratios), max(ratios)]
                row[f"{arm}_model_share"] = statistics.median(share for _, share in got)
            rows.append(row)
    return rows


def ratio(row: dict, arm: str, base: str = "tp") -> str:
    """An arm's median ratio to `base` over the rounds, with its range; a range across 1.0 says so."""
    key = f"{arm}_per_{base}"
    if key not in row:  # rows of one engine per arm (before rounds)
        return f"{row[arm + '_tok_s'] / row[base + '_tok_s']:.3f}×"
    lo, hi = row[f"{key}_range"]
    cell = f"{row[key]:.3f}× ({lo:.3f}–{hi:.3f})"
    return cell + (" crosses 1" if lo < 1 < hi else "")


def table(rows: list[dict]) -> str:
    """The rows, each arm's tok/s (median over the rounds) and its ratio to TP (median and range of the
    rounds' ratios); then what each arm's sums travel over."""
    arms = [a for a in ARMS if f"{a}_tok_s" in rows[0]]
    for kind in ("shared", "delayed", "plainring_delayed", "plainengine_delayed"):
        prefix = f"dtp_{kind}"
        arms += sorted((k.removesuffix("_tok_s") for k in rows[0] if k.startswith(prefix) and k.endswith("_tok_s")),
                       key=lambda a, p=prefix: float(a.removeprefix(p).replace("_", ".")))
    names = {"dtp": "DTP", "tp": "TP", "tp_ring": "TP over the ring", "nocomm": "no-comm",
             "dtp_collective": "DTP over the collective",
             "dtp_python": "DTP, the ring's Python kernels",
             **{a: f"DTP {a.removeprefix('dtp_shared').replace('_', '.')}% shared" for a in arms
                if a.startswith("dtp_shared")},
             **{a: f"DTP {a.removeprefix('dtp_delayed').replace('_', '.')}% delayed" for a in arms
                if a.startswith("dtp_delayed")},
             **{a: f"DTP {a.rpartition('delayed')[2].replace('_', '.')}% delayed, blocking sums on the "
                   f"{a.removeprefix('dtp_plain').partition('_')[0]}" for a in arms if a.startswith("dtp_plain")}}
    ring = "tp_ring" in arms
    head = ["executor", "TP", "batch", "latency ms", *(f"{names[a]} tok/s" for a in arms),
            *(f"{names[a]} / TP" for a in arms if a != "tp"), *(["DTP / TP over the ring"] if ring else [])]
    if "nocomm" in arms:
        head.append("DTP's share of the ceiling's gain")
    head.append("DTP's model share of a step")
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [r["executor"], r["tp"], r["batch"], f"{r['latency_ms']:g}", *(f"{r[a + '_tok_s']:.1f}" for a in arms),
                 *(ratio(r, a) for a in arms if a != "tp"), *([ratio(r, "dtp", "tp_ring")] if ring else [])]
        if "nocomm" in arms:
            gain = r["nocomm_tok_s"] - r["tp_tok_s"]
            cells.append(f"{(r['dtp_tok_s'] - r['tp_tok_s']) / gain:.0%}" if gain > 1e-9 else "n/a (no-comm ≤ TP)")
        cells.append(f"{r['dtp_model_share']:.0%}" if r["dtp_model_share"] else "n/a")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines.append("")
    lines += [f"- {names[a]}: {rows[0][a + '_transport']}" for a in arms]
    return "\n".join(lines)


def isa() -> str:
    """The host's widest x86 vector ISA, which decides vLLM's CPU build (AVX-512: a shared-memory all-reduce)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "ISA unknown"
    return next((name for name in ("avx512f", "avx2") if name in flags), "neither AVX2 nor AVX-512").upper()


def main() -> int:
    from dtpshard.serve.env import found_python

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0, 0.1, 0.5, 1])
    ap.add_argument("--new", type=int, default=33, help="new tokens per timed request")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per engine, at each latency and batch")
    ap.add_argument("--rounds", type=int, default=2, help="engines per arm, the arms alternated")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / TP, at least 1)")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager (default: vLLM's compiled mode)")
    ap.add_argument("--executor", choices=("external", "mp"), default="external",
                    help="external: one torchrun rank per TP rank (the default); mp: vLLM's own multiprocess "
                         "executor, each worker pinned to its own cores (latency 0, no no-comm arm)")
    ap.add_argument("--collective-arm", action="store_true",
                    help="also time the student with its partials on the collective (DTPSHARD_EXCHANGE=collective)")
    ap.add_argument("--python-arm", action="store_true",
                    help="also time the student on the ring's Python kernels (DTPSHARD_NATIVE=0)")
    ap.add_argument("--shared", type=float, nargs="+", default=[], metavar="FRACTION",
                    help="also time a shared student per fraction: that fraction of every layer's neurons on "
                         "every rank")
    ap.add_argument("--delayed", type=float, nargs="+", default=[], metavar="SHARE",
                    help="also time a partial student per share in (0, 1): that share of its modules delayed, the "
                         "rest all-reduced at once")
    ap.add_argument("--vllm-gloo", action="store_true",
                    help="vLLM's communicator on gloo in every arm, as on a host whose vLLM CPU build has no "
                         "shared-memory all-reduce (AVX2)")
    ap.add_argument("--plain", choices=("auto", "ring", "engine"), default="auto",
                    help="the path of the sums that block anyway (plain modules', the final mean's): the "
                         "library's choice, the ring, or vLLM's own all-reduce")
    ap.add_argument("--plain-arm", choices=("ring", "engine"), default=None,
                    help="also time each --delayed student with its blocking sums forced onto this path")
    ap.add_argument("--json", action="store_true", help="end with the rows as one JSON line")
    args = ap.parse_args()
    python = found_python()
    if python is None or not python.exists():
        raise SystemExit("no vLLM environment: run `python -m dtpshard.serve.env` first")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.tp)
    with tempfile.TemporaryDirectory() as tmp:
        pair = make_pair(Path(tmp), args.tp)
        shared = {shared_arm(f): make_shared(Path(tmp), args.tp, f) for f in args.shared}
        if any(not 0 < s < 1 for s in args.delayed):
            raise SystemExit("--delayed: each share must be in (0, 1) (1.0 is the full student, always timed)")
        partial = {delayed_arm(s): make_delayed(Path(tmp), args.tp, s) for s in args.delayed}
        weights = {arm: rank_weights(path, args.tp) for arm, path in (("dtp", pair[0]), *shared.items())}
        load0 = os.getloadavg()
        rows = measure(python, pair, args.tp, args.batch, args.latency_ms, args.new, args.repeat, threads, args.eager,
                       executor=args.executor, collective_arm=args.collective_arm, shared=shared,
                       rounds=args.rounds, python_arm=args.python_arm, delayed=partial, vllm_gloo=args.vllm_gloo,
                       plain=args.plain, plain_arm=args.plain_arm)
    load = os.getloadavg()
    print(f"load average before the run {load0[0]:.2f} / {load0[1]:.2f} / {load0[2]:.2f}")
    print(f"vLLM {'eager' if args.eager else 'compiled'}, TP {args.tp}, {threads} thread(s) per rank, "
          f"{os.cpu_count()} cores, {isa()}, load average after the run {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
          + (", vLLM's communicator on gloo (--vllm-gloo)" if args.vllm_gloo else "")
          + ("" if args.plain == "auto" else f", blocking sums forced to {args.plain} (--plain)"))
    print(table(rows))
    print("weights a rank holds: " + ", ".join(f"{k} {v / 1e6:.1f} M" for k, v in weights.items()))
    if args.json:
        for row in rows:
            row.update({f"{k}_rank_weights": v for k, v in weights.items()})
        print(json.dumps(delayed_rows(rows, args.delayed) if args.delayed else rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
