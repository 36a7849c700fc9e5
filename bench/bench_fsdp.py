"""Benchmark: memory per process and seconds per step of `distill --fsdp` against DDP, same run.

Model: a random Llama-family checkpoint built here and saved to a temporary directory (deleted at
the end): D --hidden, --layers layers, 16 query / 4 KV heads, N --neurons, untied embedding and
head of --vocab rows; the defaults make 123 M parameters, 0.49 GB in fp32. The student runs as
L = 4 devices, δ = 1, contiguous layout.

Arms, each --nproc processes (gloo on CPU), the loop's own functions (build_models, _optimizer,
accumulate, clip, AdamW step) on random tokens, micro-batch × accumulation × seq-len per process:
- DDP: every process holds the student, its gradients (plus DDP's gradient buckets, not counted
  as tensors, seen in RSS), AdamW's state and the teacher, whose frozen embedding and head are
  the student's (counted once) (the baseline of the ratios);
- FSDP: `--fsdp`, all of them sharded across the processes (fsdp.py).
Per process: tensor bytes of the student's and the teacher's parameters, of the gradients and
of the optimizer state (a DTensor counts its local shard; a shared tensor once), RSS after setup, peak RSS while
loading and while training (VmHWM, reset after setup through /proc/self/clear_refs), median
step time. Arms are interleaved (A B A B) so machine load hits them alike; `uptime` is printed.
Usage: python bench/bench_fsdp.py [--steps 3] [--repeats 2] [--layers 8] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtpshard.core.launch import launch_local, root_cause  # noqa: E402

MB = 1 << 20


def make_checkpoint(out: Path, a: argparse.Namespace) -> int:
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.neurons, num_hidden_layers=a.layers,
                      num_attention_heads=16, num_key_value_heads=4, vocab_size=a.vocab, tie_word_embeddings=False,
                      max_position_embeddings=4096)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    sd = {k: (torch.randn(v.shape, generator=g) * 0.02 if v.ndim > 1 else torch.ones(v.shape))
          for k, v in model.state_dict().items()}
    cfg.save_pretrained(out)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return sum(v.numel() for v in sd.values())


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _worker(arm: str, ckpt: Path, a: argparse.Namespace, out: Path) -> None:
    import torch.distributed as dist

    from dtpshard.training import fsdp
    from dtpshard.training.recipe import DistillConfig, build_models, resolve
    from dtpshard.training.loop import _optimizer, accumulate

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = arm == "FSDP"
    cfg = resolve(DistillConfig(teacher=ckpt, out=out, devices=4, delay=1, seq_len=a.seq_len, micro_batch=a.micro_batch,
                                grad_accum=a.grad_accum, fsdp=sharded, device="cpu"))
    if sharded:
        mesh = fsdp.mesh_for("cpu", world)
        teacher, student, _ = build_models(cfg, "cpu", lambda net, frozen: fsdp.shard(net, mesh, frozen))
    else:
        teacher, student, _ = build_models(cfg, "cpu")
    named, opt, _ = _optimizer(cfg, student.model)
    net, ddp = student, None
    if not sharded:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = ddp = DDP(student)
    setup_rss, load_peak = _rss("VmRSS"), _rss("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the training peak from here on
    g = torch.Generator().manual_seed(rank)
    vocab = student.model.shape.vocab
    times, losses = [], []
    for s in range(a.steps + 1):  # the first step allocates gradients and AdamW's state: not timed
        batches = [torch.randint(0, vocab, (a.micro_batch, a.seq_len + 1), generator=g) for _ in range(a.grad_accum)]
        dist.barrier()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        sums = accumulate(net, ddp, teacher, batches, cfg, "cpu")
        fsdp.full_norm(torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0))
        opt.step()
        dist.all_reduce(sums)
        if s:
            times.append(time.perf_counter() - t)
        losses.append(float(sums[0]))
    own = fsdp.local_bytes(student.parameters())
    both = fsdp.local_bytes([*student.parameters(), *teacher.parameters()])
    result = {"student": own, "teacher": both - own,
              "grads": fsdp.local_bytes(p.grad for _, p in named if p.grad is not None),
              "optimizer": fsdp.local_bytes(fsdp.optimizer_tensors(opt)), "setup_rss": setup_rss,
              "load_peak": load_peak, "train_peak": _rss("VmHWM"), "step_s": statistics.median(times),
              "losses": losses}
    (out / f"{arm}-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--neurons", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm and repeat (after one untimed)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dtpshard-bench-fsdp-"))
    try:
        ckpt = root / "model"
        ckpt.mkdir()
        n = make_checkpoint(ckpt, a)
        print(f"synthetic Llama: D {a.hidden}, {a.layers} layers, N {a.neurons}, vocab {a.vocab} (untied): "
              f"{n / 1e6:.1f} M parameters, {n * 4 / 1e9:.2f} GB fp32; student L=4 δ=1; {a.nproc} processes × "
              f"{a.threads} threads, batch {a.micro_batch}×{a.grad_accum}×{a.seq_len} tokens per process")
        print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
        runs: dict[str, list[list[dict]]] = {"DDP": [], "FSDP": []}
        for rep in range(a.repeats):
            for arm in runs:
                out = root / f"{arm}-{rep}"
                out.mkdir()
                failed = root_cause(launch_local(a.nproc, _worker, (arm, ckpt, a, out)))
                if failed is not None:
                    raise SystemExit(f"{arm}: {failed}")
                runs[arm].append([json.loads((out / f"{arm}-rank{r}.json").read_text()) for r in range(a.nproc)])
        print("load after: ", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
        report(runs, a)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(runs: dict[str, list[list[dict]]], a: argparse.Namespace) -> None:
    def per_rank(arm: str, key: str) -> float:  # the largest rank, first repeat (bytes do not vary)
        return max(r[key] for r in runs[arm][0])

    def step_s(arm: str) -> float:  # the slowest rank's median, median over repeats
        return statistics.median(max(r["step_s"] for r in rep) for rep in runs[arm])

    rows = [("student parameters", "student"), ("teacher parameters (not shared)", "teacher"), ("gradients", "grads"),
            ("AdamW state", "optimizer")]
    print(f"\nper process (largest rank), MB      {'DDP':>10} {'FSDP':>10} {'FSDP/DDP':>9}")
    total = {arm: 0.0 for arm in runs}
    for label, key in rows:
        d, f = per_rank("DDP", key) / MB, per_rank("FSDP", key) / MB
        total["DDP"] += d
        total["FSDP"] += f
        print(f"{label:<36} {d:10.1f} {f:10.1f} {f / d:9.3f}")
    sum_pgo = {arm: (per_rank(arm, "student") + per_rank(arm, "grads") + per_rank(arm, "optimizer")) / MB
               for arm in runs}
    print(f"{'student params+grads+AdamW':<36} {sum_pgo['DDP']:10.1f} {sum_pgo['FSDP']:10.1f} "
          f"{sum_pgo['FSDP'] / sum_pgo['DDP']:9.3f}   (1/K = {1 / a.nproc:.3f})")
    print(f"{'all tensors above':<36} {total['DDP']:10.1f} {total['FSDP']:10.1f} {total['FSDP'] / total['DDP']:9.3f}")
    for label, key in (("RSS after setup", "setup_rss"), ("peak RSS while loading", "load_peak"),
                       ("peak RSS while training", "train_peak")):
        d, f = per_rank("DDP", key) / MB, per_rank("FSDP", key) / MB
        print(f"{label:<36} {d:10.1f} {f:10.1f} {f / d:9.3f}")
    d, f = step_s("DDP"), step_s("FSDP")
    print(f"{'seconds per step (median)':<36} {d:10.2f} {f:10.2f} {f / d:9.3f}")
    ld, lf = runs["DDP"][0][0]["losses"], runs["FSDP"][0][0]["losses"]
    print(f"loss sums, step by step: DDP {[round(x, 4) for x in ld]}, FSDP {[round(x, 4) for x in lf]}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
