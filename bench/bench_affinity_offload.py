"""Benchmark of the streamed affinity pass: peak memory and time of `--offload` against the
in-memory pass.

Builds a synthetic sharded bf16 checkpoint on /tmp (Llama family; by default 8 layers, D 2048,
N 8192, 8 query heads of 64 in 2 KV groups, vocab 32000, untied: about 1.1 GB), written shard by
shard and deleted at the end. Each arm runs in a fresh subprocess on the same random tokens, the
arms interleaved (A B A B ...): the in-memory pass (`DenseModel.from_checkpoint` then
`compute_affinity`, what `dtpshard affinity --no-offload` runs) and the streamed pass
(`StreamedDense`, what `--offload` runs; with --spill its hidden states all go to disk). Printed:
peak RSS of each process (getrusage) in GB and as a ratio of the checkpoint's bytes, the same
above the process's RSS after its imports, the streamed/in-memory ratio of each (target <= 0.6),
the wall time of load + pass and its ratio, and the largest difference of the two passes' scores
relative to each edge's largest score (expected 0: the same arithmetic).

    PYTHONPATH=. python bench/bench_affinity_offload.py [--layers 8] [--blocks 2] [--seq-len 64] [--repeat 2] [--spill]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def build_checkpoint(path: Path, args: argparse.Namespace) -> int:
    """Random bf16 Llama weights in shards of about --shard-mb MB plus an index; returns the weights' bytes."""
    from synthetic import write_sharded_llama

    return write_sharded_llama(path, layers=args.layers, hidden=args.hidden, neurons=args.neurons, heads=args.heads,
                               kv_groups=args.kv_groups, head_dim=args.head_dim, vocab=args.vocab,
                               shard_bytes=args.shard_mb << 20)


def child(args: argparse.Namespace) -> None:
    """One arm in this fresh process: load + pass; writes its scores and its numbers."""
    import resource

    import psutil
    import torch

    from dtpshard.affinity.offload import HiddenStates
    from dtpshard.affinity.scorer import compute_affinity
    from dtpshard.model.checkpoint import open_checkpoint
    from dtpshard.model.decoder import rotary_for
    from dtpshard.model.dense import DenseModel, StreamedDense

    ids = torch.load(args.ckpt / "ids.pt")
    rotary_for(open_checkpoint(args.ckpt).hf_config)  # the lazy imports (transformers' model code) before `base`
    base = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    ckpt = open_checkpoint(args.ckpt)
    if args.child == "memory":
        model = DenseModel.from_checkpoint(ckpt)
        hidden = None
    else:
        model = StreamedDense(ckpt)
        hidden = HiddenStates(0, args.result.parent) if args.spill else None
    edges = compute_affinity(model, ids, delay=args.delay, micro_batch=args.micro_batch, hidden=hidden)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    np.savez(args.result, **{f"{a}_{b}": s for (a, b), s in edges.items()})
    args.result.with_suffix(".json").write_text(json.dumps({"peak": peak, "base": base, "wall": wall}))


def run_arm(arm: str, ckpt: Path, work: Path, i: int, args: argparse.Namespace) -> dict:
    result = work / f"{arm}{i}.npz"
    cmd = [sys.executable, __file__, "--child", arm, "--ckpt", str(ckpt), "--result", str(result),
           "--delay", str(args.delay), "--micro-batch", str(args.micro_batch)] + (["--spill"] if args.spill else [])
    subprocess.run(cmd, check=True)
    stats = json.loads(result.with_suffix(".json").read_text())
    print(f"  {arm} #{i}: peak RSS {stats['peak'] / 1e9:.2f} GB, {stats['wall']:.1f} s, "
          f"load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    with np.load(result) as z:
        stats["edges"] = {k: z[k] for k in z.files}
    return stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--neurons", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-groups", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-mb", type=int, default=400)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--delay", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=2, help="A B pairs")
    ap.add_argument("--spill", action="store_true", help="the streamed arm also spills every hidden state to disk")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--child", choices=["memory", "offload"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    import torch

    work = Path(tempfile.mkdtemp(prefix="bench_affinity_offload-", dir=args.dir))
    try:
        ckpt = work / "ckpt"
        ckpt.mkdir()
        t0 = time.perf_counter()
        build_checkpoint(ckpt, args)
        on_disk = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        shards = len(list(ckpt.glob("*.safetensors")))
        gen = torch.Generator().manual_seed(0)
        torch.save(torch.randint(0, args.vocab, (args.blocks, args.seq_len), generator=gen),
                   ckpt / "ids.pt")
        print(f"checkpoint: {on_disk / 1e9:.2f} GB in {shards} bf16 shards ({args.layers} layers, D {args.hidden}, "
              f"N {args.neurons}, {args.heads} heads / {args.kv_groups} KV groups x {args.head_dim}, vocab "
              f"{args.vocab}), written in {time.perf_counter() - t0:.0f} s; {args.blocks} x {args.seq_len} tokens, "
              f"δ={args.delay:g}, float32 compute, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
        runs: dict[str, list[dict]] = {"memory": [], "offload": []}
        for i in range(args.repeat):
            for arm in runs:
                runs[arm].append(run_arm(arm, ckpt, work, i, args))
        ref = runs["memory"][0]["edges"]
        diff = max(float(np.abs(r["edges"][k] - s).max() / s.max())
                   for arm in runs.values() for r in arm for k, s in ref.items())
        print(f"load after the runs {os.getloadavg()[0]:.2f}; largest score difference between all runs, relative to "
              f"each edge's largest score: {diff:.1e}\n")
        GB = 1e9
        print("| arm | peak RSS (GB) | peak / checkpoint | peak above imports (GB) | above imports / checkpoint "
              "| load + pass (s) |")
        print("|---|---|---|---|---|---|")
        for arm, name in (("memory", "in memory"), ("offload", "streamed" + (" + spill" if args.spill else ""))):
            for r in runs[arm]:
                above = r["peak"] - r["base"]
                print(f"| {name} | {r['peak'] / GB:.2f} | {r['peak'] / on_disk:.2f} | {above / GB:.2f} | "
                      f"{above / on_disk:.2f} | {r['wall']:.1f} |")

        def med(f):
            return float(np.median([f(a, b) for a, b in zip(runs["offload"], runs["memory"])]))

        print(f"\nstreamed / in memory, median of the {args.repeat} A-B pairs: peak RSS "
              f"{med(lambda a, b: a['peak'] / b['peak']):.2f}, peak above imports "
              f"{med(lambda a, b: (a['peak'] - a['base']) / (b['peak'] - b['base'])):.2f} (target <= 0.6), "
              f"wall {med(lambda a, b: a['wall'] / b['wall']):.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
