"""Forward+backward throughput and memory of DTPModel (L=4, δ=1) against the dense model.

Dense baseline: transformers' own Qwen3ForCausalLM (sdpa attention) with the same weights and
tokens; DTPModel at L=1 is shown too. Model: random, Qwen3-0.6B widths (D 1024, 16/8 heads,
head dim 128, N 3072), 4 layers. Each arm runs in its own process so peak RSS is its own.
Memory columns: bytes of tensors saved for backward (exact, from saved-tensor hooks) and the
process's peak RSS growth over the loaded model.
Compiled arms (`+c`: torch.compile of the whole training forward, as `distill --compile on`)
use a fresh inductor cache dir for the run: round 1 pays the cold compile, later rounds load
the cached kernels (the "1st step s" column, compile included). Arms are interleaved per round
(A B C D A B C D) and each arm's best step over all rounds is reported.

    python bench/bench_model.py [--vocab 151936] [--tokens 1024] [--iters 3] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def qwen3_config(vocab: int):
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=vocab, tie_word_embeddings=True,
                       max_position_embeddings=4096)


def saved_bytes(fn) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def run_arm(arm: str, vocab: int, tokens: int, iters: int, seq: int) -> dict:
    from transformers import AutoModelForCausalLM

    from dtpshard.model.dtp import DTPModel

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(qwen3_config(vocab), attn_implementation="sdpa")
    model = hf if arm.startswith("hf-dense") else DTPModel.from_hf(hf, devices=int(arm.split("L")[1][0]), delay=1)
    model.train()
    ids = torch.randint(0, vocab, (tokens // seq, seq))
    fwd = model
    if arm.endswith("+c"):
        from dtpshard.model.compiled import compile_module

        fwd = compile_module(model)

    def step():
        out = fwd(ids)
        logits = out.logits if hasattr(out, "logits") else out
        logits.float().logsumexp(-1).mean().backward()

    t0 = time.perf_counter()
    step()  # warm-up (and the compile)
    first = time.perf_counter() - t0
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    act = saved_bytes(lambda: fwd(ids))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    best = min(times)
    return {"arm": arm, "tok_s": tokens / best, "sec": best, "first_s": first, "saved_MiB": act / 2**20,
            "rss_peak_MiB": peak / 1024, "rss_growth_MiB": (peak - base) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arms", nargs="+", default=["hf-dense", "dtp-L1", "dtp-L4", "hf-dense+c", "dtp-L4+c"])
    ap.add_argument("--arm")
    a = ap.parse_args()
    if a.arm:
        torch.set_num_threads(2)
        print(json.dumps(run_arm(a.arm, a.vocab, a.tokens, a.iters, a.seq)))
        return
    import os
    import tempfile

    runs: dict[str, list[dict]] = {arm: [] for arm in a.arms}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}  # cold in round 1, warm after
        for _ in range(a.rounds):
            for arm in a.arms:
                out = subprocess.run([sys.executable, __file__, "--arm", arm, "--vocab", str(a.vocab), "--tokens",
                                      str(a.tokens), "--seq", str(a.seq), "--iters", str(a.iters)],
                                     capture_output=True, text=True, check=True, env=env)
                runs[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = [{**max(rs, key=lambda r: r["tok_s"]), "firsts": [r["first_s"] for r in rs]} for rs in runs.values()]
    base = rows[0]
    load = os.getloadavg()
    print(f"Qwen3-0.6B widths, 4 layers, vocab {a.vocab}, {a.tokens} tokens/step (seq {a.seq}), fwd+bwd, fp32, "
          f"2 threads per arm, best of {a.iters} steps x {a.rounds} rounds; load {load[0]:.2f} {load[1]:.2f}")
    print(f"{'arm':11} {'tok/s':>7} {'ratio':>6} {'saved MiB':>10} {'ratio':>6} {'RSS peak MiB':>13} {'ratio':>6} "
          f"{'1st step s (per round)':>24}")
    for r in rows:
        print(f"{r['arm']:11} {r['tok_s']:7.0f} {r['tok_s'] / base['tok_s']:6.2f} {r['saved_MiB']:10.0f} "
              f"{r['saved_MiB'] / base['saved_MiB']:6.2f} {r['rss_peak_MiB']:13.0f} "
              f"{r['rss_peak_MiB'] / base['rss_peak_MiB']:6.2f} {' / '.join(f'{x:.1f}' for x in r['firsts']):>24}")
    by = {r["arm"]: r for r in rows}
    if "dtp-L4+c" in by and "hf-dense+c" in by:
        print(f"compiled DTP L=4 / compiled dense: {by['dtp-L4+c']['tok_s'] / by['hf-dense+c']['tok_s']:.2f}; "
              f"compiled DTP L=4 / eager dense: {by['dtp-L4+c']['tok_s'] / base['tok_s']:.2f}")

if __name__ == "__main__":
    main()
