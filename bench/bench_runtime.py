"""Benchmark of the multi-process runtime : DTP (δ = 1, 2) against tensor parallelism (δ = 0).

L local gloo ranks (--threads each, default 1: one core per rank on a 2-core machine) run a random Qwen3-0.6B-width
model (D 1024, N 3072, head dim 128; 12 heads in 6 KV groups so that L = 2 and 3 both divide;
4 layers; vocab 8192 so the replicated LM head does not drown the layers) or --model DIR.
Timed: one prefill of --prompt-len tokens, then --new-tokens greedy decoding steps from the
per-rank KV cache, median of --repeats, the slowest rank counted. `--latency-ms` adds a fixed
latency to every transfer and `--bandwidth-gbps` a wire time of bytes / bandwidth (a sum is
available that much after the local transfer itself completed; sleep-based, runtime.ranks.Link) to
emulate a slower link: δ = 0 waits for it after every module, δ ≥ 1 overlaps it with δ modules of compute.
"compute" is the same forward with the transfers removed, so 1 - compute/δ0 is the share of the
TP step spent communicating, and the CPU column (user + system seconds of each rank's process, all
threads) shows how much of that time is the transfers' own work on the same cores rather than
waiting: with one core per rank and no idle core, such work cannot overlap with compute.
Usage: python bench/bench_runtime.py [--latency-ms 0 0.1 1 --worlds 2]
On a machine shared with other jobs the absolute times are noisy; modes are interleaved per repeat.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtpshard.core.launch import launch_local
from dtpshard.runtime.ranks import Link


class NoLink(Link):
    """Transfers removed: every rank computes as if alone (the function changes, the work does not)."""

    def start(self, p: torch.Tensor) -> torch.Tensor:
        return p  # the "sum" is the own partial: nothing arrives from the others

    def value(self, handle: torch.Tensor) -> torch.Tensor:
        return handle


def random_checkpoint(out: Path, layers: int, vocab: int) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers, num_attention_heads=12,
                      num_key_value_heads=6, head_dim=128, vocab_size=vocab, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(str(out))
    return out


def _cpu() -> float:
    """CPU seconds (user + system) of this process, all its threads: the compute and gloo's."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(net, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float, float]:
    """(prefill seconds, seconds per decoded token), the slowest rank's, and the CPU seconds per
    decoded token, the ranks' mean."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    cache = net.new_cache()
    nxt = net(prompt, cache, logits_to_keep=1)[:, -1].argmax(-1, keepdim=True)
    t1, c1 = time.perf_counter(), _cpu()
    for _ in range(new_tokens):
        nxt = net(nxt, cache, logits_to_keep=1)[:, -1].argmax(-1, keepdim=True)
    t2, c2 = time.perf_counter(), _cpu()
    times = torch.tensor([t1 - t0, (t2 - t1) / new_tokens], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    cpu = torch.tensor([(c2 - c1) / new_tokens], dtype=torch.float64)
    dist.all_reduce(cpu)
    return float(times[0]), float(times[1]), float(cpu[0]) / dist.get_world_size()


def worker(model: str, args: dict, out: str) -> int:
    from dtpshard.core.launch import process_group, set_threads
    from dtpshard.core.settings import resolve_dtp
    from dtpshard.runtime.ranks import RankModel, check_world

    set_threads(args["threads"])
    with process_group(timeout=300) as (rank, world):
        ckpt, _ = check_world(model, world)
        net = RankModel(ckpt, rank, resolve_dtp(ckpt.shape, devices=world), timeout=300)
        real_link = net.link
        prompt = torch.randint(0, ckpt.shape.vocab, (1, args["prompt_len"]),
                               generator=torch.Generator().manual_seed(0))
        rows = []
        for latency in args["latency_ms"]:
            modes = ["compute", *args["delays"]]
            runs: dict = {mode: [] for mode in modes}
            for rep in range(args["repeats"] + 1):  # modes interleaved, so drift hits them all alike
                for mode in modes:
                    net.link = NoLink(rank, 300) if mode == "compute" else real_link
                    net.link.latency = latency / 1000
                    net.link.bandwidth = args["bandwidth_gbps"] * 1e9 / 8
                    net.set_delay(0 if mode == "compute" else mode)
                    t = _timed(net, prompt, args["new_tokens"])
                    if rep:  # the first round is a warm-up
                        runs[mode].append(t)
            rows += [{"L": world, "latency_ms": latency, "mode": mode,
                      "prefill_s": statistics.median(r[0] for r in runs[mode]),
                      "token_s": statistics.median(r[1] for r in runs[mode]),
                      "token_cpu_s": statistics.median(r[2] for r in runs[mode])} for mode in modes]
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    return 0


def table(rows: list[dict]) -> str:
    """One line per (L, latency, δ): times, ratio to δ = 0, TP's communication share, the verdict."""
    lines = ["| L | latency ms | δ | prefill ms | ratio | comm share TP | ms/token | ratio | comm share TP | "
             "CPU ms/token per rank (compute-only) | DTP ≤ 0.85·TP where comm ≥ 1/5 |", "|" + "---|" * 11]
    for r in rows:
        if r["mode"] == "compute":
            continue
        same = {x["mode"]: x for x in rows if x["L"] == r["L"] and x["latency_ms"] == r["latency_ms"]}
        tp, comp = same[0], same["compute"]
        cells = [str(r["L"]), f"{r['latency_ms']:g}", f"{r['mode']:g}"]
        verdict = []
        for key, label in (("prefill_s", "prefill"), ("token_s", "decode")):
            ratio = r[key] / tp[key]
            share = max(0.0, 1 - comp[key] / tp[key])
            cells += [f"{1000 * r[key]:.2f}", f"{ratio:.3f}", f"{share:.2f}"]
            if r["mode"] != 0 and share >= 0.2:
                verdict.append(f"{label} {'yes' if ratio <= 0.85 else 'NO'}")
        cells.append(f"{1000 * r['token_cpu_s']:.1f} ({1000 * comp['token_cpu_s']:.1f})")
        cells.append(", ".join(verdict) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a Hugging Face checkpoint directory instead of the random model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2])
    ap.add_argument("--delays", type=float, nargs="+", default=[0, 1, 2])
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0, 0.1, 1])
    ap.add_argument("--bandwidth-gbps", type=float, default=0, help="simulated link bandwidth, Gbit/s (0: unlimited)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: cores / L - 2)")
    a = ap.parse_args()
    delays = [0] + [d for d in a.delays if d != 0]  # δ = 0 is the baseline, always measured
    args = {"latency_ms": a.latency_ms, "delays": [int(d) if d == int(d) else d for d in delays],
            "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "repeats": a.repeats,
            "threads": a.threads, "bandwidth_gbps": a.bandwidth_gbps}
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or random_checkpoint(Path(tmp) / "model", a.layers, a.vocab)
        rows = []
        for world in a.worlds:
            out = Path(tmp) / f"rows{world}.json"
            t = time.perf_counter()
            codes = launch_local(world, worker, (str(model), args, str(out)), grace=60)
            if any(e.code for e in codes):
                sys.exit(f"L={world}: ranks exited with {[e.code for e in codes]}")
            rows += json.loads(out.read_text())
            print(f"L={world}: {time.perf_counter() - t:.0f} s", file=sys.stderr)
    print(f"model: {a.model or f'random Qwen3-0.6B width, {a.layers} layers, vocab {a.vocab}'}; "
          f"prefill {a.prompt_len} tokens, {a.new_tokens} decoded, median of {a.repeats}; gloo, "
          f"{os.cpu_count()} cores, {a.threads or 'cores/L - 2'} threads per rank; link bandwidth "
          f"{f'{a.bandwidth_gbps:g} Gbit/s' if a.bandwidth_gbps else 'unlimited'}; load {os.getloadavg()[0]:.2f}")
    print(table(rows))


if __name__ == "__main__":
    main()
