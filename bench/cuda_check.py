"""One prepared script for a GPU machine: check and time the CUDA path.

1. Exactness on CUDA (fp32): DTPModel at δ = 0 against transformers on the GPU, δ = 1 against
   the CPU result, KV-cache decoding against the full forward.
2. bf16: DTPModel in bf16 and under autocast runs and stays close to fp32.
3. Throughput and peak memory, forward+backward, bf16 autocast: DTPModel (L = 4, δ = 1) against
   transformers' dense Qwen3 (same weights and tokens), Qwen3-0.6B widths, 4 layers, full vocab.
4. A short distillation on CUDA (bf16 autocast), resumable run directory and all.

    PYTHONPATH=. python bench/cuda_check.py
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def check(name: str, ok: bool, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    return ok


def exactness() -> bool:
    from tiny import tiny_hf_model

    from dtpshard.model.dtp import DTPModel

    ok = True
    for fam in ("qwen3", "qwen2", "llama_tied"):
        hf = tiny_hf_model(fam)
        ids = torch.randint(0, 384, (2, 33))
        ref = hf.cuda()(ids.cuda()).logits
        m0 = DTPModel.from_hf(hf, devices=4, delay=0).cuda()
        d = (m0(ids.cuda()).logits - ref).abs().max().item()
        ok &= check(f"{fam} δ=0 vs transformers (cuda fp32)", d <= 1e-4, f"{d:.2e}")
        hf = hf.cpu()
        cpu = DTPModel.from_hf(hf, devices=4, delay=1)(ids).logits
        gpu = DTPModel.from_hf(hf, devices=4, delay=1).cuda()
        d = (gpu(ids.cuda()).logits.cpu() - cpu).abs().max().item()
        ok &= check(f"{fam} δ=1 cuda vs cpu (fp32)", d <= 1e-4, f"{d:.2e}")
        cache = gpu.new_cache()
        full = gpu(ids.cuda()).logits
        parts = [gpu(ids[:, :20].cuda(), cache=cache).logits]
        parts += [gpu(ids[:, t:t + 1].cuda(), cache=cache).logits for t in range(20, 33)]
        d = (torch.cat(parts, 1) - full).abs().max().item()
        ok &= check(f"{fam} KV-cache decode vs full (cuda)", d <= 1e-4, f"{d:.2e}")
        b16 = DTPModel.from_hf(hf, devices=4, delay=1, dtype=torch.bfloat16).cuda()
        d = (b16(ids.cuda()).logits.float().cpu() - cpu).abs().max().item()
        ok &= check(f"{fam} bf16 vs fp32", d < 0.1 * cpu.abs().max().item(), f"{d:.3f} (max |logit| {cpu.abs().max():.2f})")
    return ok


def throughput() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dtpshard.model.dtp import DTPModel

    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(cfg).cuda()
    ids = torch.randint(0, cfg.vocab_size, (8, 1024), device="cuda")
    rows = []
    for name, model in (("transformers dense", hf), ("DTP L=4 δ=1", DTPModel.from_hf(hf, devices=4, delay=1).cuda())):
        model.train()

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(ids)
                logits = out.logits if hasattr(out, "logits") else out
                loss = logits.float().logsumexp(-1).mean()
            loss.backward()

        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / 5
        rows.append((name, ids.numel() / dt, torch.cuda.max_memory_allocated() / 2**30))
        model.zero_grad(set_to_none=True)
    base = rows[0]
    print("fwd+bwd, bf16 autocast, Qwen3-0.6B widths, 4 layers, vocab 151936, 8x1024 tokens")
    print(f"{'model':20} {'tok/s':>9} {'ratio':>6} {'peak GiB':>9} {'ratio':>6}")
    for n, tps, mem in rows:
        print(f"{n:20} {tps:9.0f} {tps / base[1]:6.2f} {mem:9.2f} {mem / base[2]:6.2f}")


def distillation() -> bool:
    from tiny import save_tiny

    from dtpshard.training.distill import DistillConfig, distill
    from dtpshard.core.layout import Layout
    from dtpshard.model.dtp import DTPModel

    with tempfile.TemporaryDirectory() as tmp:
        teacher = save_tiny(Path(tmp) / "teacher", "qwen3")
        layout = Layout.random(DTPModel.from_pretrained(teacher).shape.summary(), 4, 1, seed=0)
        layout.save(Path(tmp) / "layout.json")
        t = time.perf_counter()
        run = distill(DistillConfig(teacher=teacher, out=Path(tmp) / "run", layout=Path(tmp) / "layout.json",
                                    steps=30, seq_len=64, micro_batch=4, grad_accum=2, lr=3e-3, warmup=3,
                                    eval_every=10, eval_blocks=4, device="cuda", progress=False))
        import json

        evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in evals if r["kind"] == "eval"]
        return check("distillation on cuda (bf16 autocast)", evals[-1]["eval_kl"] < evals[0]["eval_kl"],
                     f"eval KL {evals[0]['eval_kl']:.4f} -> {evals[-1]['eval_kl']:.4f} in "
                     f"{time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    ok = exactness()
    throughput()
    ok &= distillation()
    sys.exit(0 if ok else 1)
