"""Benchmark of `dtpshard permute`: streaming, one tensor at a time, against the whole-state-dict path.

Builds a synthetic Llama-family checkpoint under /tmp (random bf16 weights written shard by shard,
never the whole model in memory; default D 2048, N 5632, 32 query heads in 4 KV groups, 16 layers,
vocab 32000, untied: 1.67 GB in 4 shards of at most 500 MB, an index, config.json), a random
L = 4 layout, then runs each arm in a fresh subprocess, interleaved (A B C A B C ...):

  today   the path the streaming one replaced, copied here: the whole state dict, apply_layout,
          config through save_pretrained, one model.safetensors. (It then also loaded two fp32 models
          for its logits check; that is left out, so today's memory is understated.)
  stream  `dtpshard permute`, default check: every tensor read back and compared exactly
  nocheck `dtpshard permute --check none`

Reported per process: peak RSS (os.wait4's ru_maxrss) as a ratio of the checkpoint's bytes, the
same after subtracting the floor (python, torch, transformers and dtpshard imported, config.json
parsed, no weight read), and wall seconds against today's. Everything under /tmp is deleted at the end.
Usage: python bench/bench_permute.py [--layers 16 --shard-mb 500 --repeats 2]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_checkpoint(out: Path, layers: int, shard_bytes: int) -> int:
    """A random Llama checkpoint in shards of at most `shard_bytes`; returns the weights' bytes."""
    from synthetic import write_sharded_llama

    return write_sharded_llama(out, layers=layers, hidden=2048, neurons=5632, heads=32, kv_groups=4, vocab=32000,
                               shard_bytes=shard_bytes)


def today(src: Path, layout: Path, out: Path) -> None:
    """The pre-issue-12 `permute` (reading, apply_layout, save_checkpoint), check left out."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dtpshard.core.layout import Layout
    from dtpshard.core.permutation import permutation_spec, unit_index
    from dtpshard.core.shape import shape_from_hf_config
    from dtpshard.model.checkpoint import load_hf_config

    cfg = load_hf_config(src)
    shape = shape_from_hf_config(cfg)
    where = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    sd = {}
    for k, f in where.items():
        with safe_open(str(src / f), framework="pt") as st:
            sd[k] = st.get_tensor(k)
    lay = Layout.load(layout)
    for name, (m, axis, rows) in permutation_spec(shape).items():
        sd[name] = sd[name].index_select(axis, unit_index(lay.perm(m), rows))
    out.mkdir()
    cfg.save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})


def floor(src: Path) -> None:
    """What every arm does before reading a weight: imports, config.json parsed."""
    import transformers  # noqa: F401 -- imported, unused: its memory is the point

    import dtpshard.layouts.permute  # noqa: F401
    from dtpshard.model.checkpoint import read_shape

    read_shape(src)


def peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM: its own address space since exec;
    getrusage's maxrss would also count the parent's memory at fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no VmHWM in /proc/self/status (Linux only)")


def run(argv: list[str]) -> tuple[float, float]:
    """(peak RSS in bytes, wall seconds) of one fresh subprocess running `--arm ...`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--arm", *argv], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{argv} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return float(done.stdout.strip().splitlines()[-1].removeprefix("peak ")), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shard-mb", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--arm", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # internal: run one arm in this process
    args = ap.parse_args()
    if args.arm:
        if args.arm[0] == "today":
            today(*map(Path, args.arm[1:]))
        elif args.arm[0] == "cli":
            from dtpshard.cli import main as cli

            with contextlib.redirect_stdout(sys.stderr):
                assert cli(args.arm[1:]) == 0
        else:
            floor(Path(args.arm[1]))
        print(f"peak {peak_rss()}")
        return

    from dtpshard.core.layout import Layout
    from dtpshard.model.checkpoint import read_shape

    root = Path(tempfile.mkdtemp(prefix="bench_permute-", dir="/tmp"))
    try:
        src = root / "src"
        src.mkdir()
        t0 = time.perf_counter()
        size = write_checkpoint(src, args.layers, args.shard_mb << 20)
        shards = len(list(src.glob("*.safetensors")))
        print(f"checkpoint: {size / 1e9:.2f} GB of bf16 weights in {shards} shards (largest tensor "
              f"{32000 * 2048 * 2 / 1e6:.0f} MB), written in {time.perf_counter() - t0:.0f} s")
        Layout.random(read_shape(src), 4, seed=0).save(root / "layout.json")
        permute = ["cli", "permute", str(src), str(root / "layout.json"), "--out", str(root / "out")]
        arms = {"today": ["today", str(src), str(root / "layout.json"), str(root / "out")],
                "stream": permute, "nocheck": permute + ["--check", "none"]}
        load = [os.getloadavg()[0]]
        base = min(run(["floor", str(src)])[0] for _ in range(2))
        results: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}
        for _ in range(args.repeats):
            for arm, argv in arms.items():
                results[arm].append(run(argv))
                shutil.rmtree(root / "out")
                load.append(os.getloadavg()[0])
        t_today = statistics.median(w for _, w in results["today"])
        print(f"\nload average (1 min) during the runs: {min(load):.1f} to {max(load):.1f} on {os.cpu_count()} cores; "
              f"floor (python, torch, transformers, dtpshard imported, config.json read): {base / 1e9:.2f} GB")
        print("| arm | peak RSS (GB) | × checkpoint | (peak − floor) × checkpoint | wall (s) | wall × today |")
        print("|---|---|---|---|---|---|")
        for arm, rs in results.items():
            peak, wall = max(r for r, _ in rs), statistics.median(w for _, w in rs)
            print(f"| {arm} | {peak / 1e9:.2f} | {peak / size:.2f} | {(peak - base) / size:.2f} | {wall:.1f} | "
                  f"{wall / t_today:.2f} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
