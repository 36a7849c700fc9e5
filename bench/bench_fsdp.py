"""Benchmark: memory per process of `distill --fsdp` while loading, training and saving, against the
path it replaced and against one process; the memory plan against what was measured; bf16-mixed
step time against fp32.

Model: a synthetic Llama checkpoint stored in bf16 in several safetensors shards, many layers and a
small vocabulary so that the layers dominate (defaults: D 1024, N 2816, 16 layers, vocab 2048,
184 M parameters, 0.37 GB on disk). Student L = 4, δ = 1, contiguous layout; random-token text.

Arms, each a real `dtpshard distill` run (RUN/memory.json holds its plan and every rank's peak per
phase: VmHWM, reset between phases) except the first:
- before: the replaced --fsdp path, copied here: every rank reads the whole checkpoint as fp32,
  builds the teacher and the student whole and then shards them, and at the end rank 0 gathers
  the whole student and writes it as one file (same phases measured the same way, with the same
  allocator setting as distill: core/memory.py return_freed_memory);
- FSDP fp32: `--nproc K --fsdp --precision fp32`;
- FSDP fp32 with `--grad-checkpointing` (the activation memory it saves, measured and planned);
- one process: `--nproc 1` (everything in one process);
- FSDP bf16-mixed: `--nproc K --fsdp --precision bf16-mixed` (step time; a bf16 CPU matmul is slow).
Usage: python bench/bench_fsdp.py [--steps 3] [--layers 16] [--nproc 2] [--checkpointing-only --seq-len 512]
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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # synthetic.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tiny.py's tokenizer

from dtpshard.core.launch import launch_local, root_cause  # noqa: E402

MB = 1 << 20


def make_checkpoint(out: Path, a: argparse.Namespace) -> int:
    """The synthetic checkpoint (bench/synthetic.py), bf16 in 100 MB shards, and a byte-level BPE
    tokenizer of its vocabulary (tests/tiny.py's); returns the parameter count."""
    from synthetic import write_sharded_llama
    from tiny import tiny_tokenizer

    nbytes = write_sharded_llama(out, layers=a.layers, hidden=a.hidden, neurons=a.neurons, heads=16, kv_groups=4,
                                 vocab=a.vocab, shard_bytes=100 * MB)
    tiny_tokenizer(a.vocab).save_pretrained(str(out))
    return nbytes // 2


def _before(ckpt: Path, text: Path, out: Path, a: argparse.Namespace) -> int:
    """One rank of the replaced path, phase by phase."""
    import torch.distributed as dist

    from dtpshard.core.memory import return_freed_memory
    from dtpshard.model.checkpoint import load_tokenizer, open_checkpoint
    from dtpshard.model.dtp import DTPModel
    from dtpshard.training import fsdp
    from dtpshard.training.ddp import Dist
    from dtpshard.training.loop import _optimizer, accumulate
    from dtpshard.training.memory import PhasePeaks
    from dtpshard.training.recipe import FROZEN, DistillConfig, Student, Teacher, resolve, train_blocks_for
    from dtpshard.training.strategy import Sharded

    torch.set_num_threads(1)
    return_freed_memory()  # as distill does now: both paths measured with the same allocator setting
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    peaks = PhasePeaks("cpu")
    cfg = resolve(DistillConfig(teacher=ckpt, out=out, devices=4, delay=1, seq_len=a.seq_len, micro_batch=1,
                                grad_accum=1, fsdp=True, text=[str(text)], device="cpu"))
    strategy = Sharded(Dist(rank, world), "fp32")
    with peaks.phase("setup"):
        ck = open_checkpoint(ckpt)
        sd = ck.state_dict(torch.float32)  # the whole model, on every rank
        teacher = Teacher(DTPModel.from_state_dict(ck.hf_config, sd, devices=1, delay=0).requires_grad_(False))
        fsdp.shard(teacher, strategy.mesh, True)
        student = DTPModel.from_state_dict(ck.hf_config, sd, cfg.devices, cfg.delay)
        del sd
        for n, p in student.named_parameters():
            p.requires_grad_(n not in FROZEN)
        net = Student(student)
        fsdp.shard(net, strategy.mesh, False)
        named, opt, _ = _optimizer(cfg, student)
        blocks, _ = train_blocks_for(cfg, world, load_tokenizer(ckpt))
    with peaks.phase("training"):
        for s in range(a.steps):
            opt.zero_grad(set_to_none=True)
            accumulate(net, strategy, teacher, [blocks[(s * world + rank):(s * world + rank) + 1]], cfg, "cpu")
            fsdp.full_norm(torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0))
            opt.step()
    with peaks.phase("saving"):  # rank 0 gathers the whole student, then writes one file
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            save_file({k: v.contiguous() for k, v in full.items()}, str(out / f"student-{rank}.safetensors"))
        del full
    (out / f"before-rank{rank}.json").write_text(json.dumps(peaks.peaks))
    dist.destroy_process_group()
    return 0


def _distill(ckpt: Path, text: Path, run: Path, a: argparse.Namespace, *flags: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    args = [sys.executable, "-m", "dtpshard", "distill", str(ckpt), "--out", str(run), "--text", str(text),
            "--eval-text", str(text), "--steps", str(a.steps), "--seq-len", str(a.seq_len), "--micro-batch", "1",
            "--grad-accum", "1", "--eval-every", str(a.steps), "--eval-blocks", "1", "--device", "cpu",
            "--no-progress", "--save-dtype", "float32", *flags]
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"distill {' '.join(flags)}: {done.stderr.strip().splitlines()[-1]}")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    walls = [r["wall"] for r in rows if r["kind"] == "train"]
    return {**json.loads((run / "memory.json").read_text()),
            "step_s": statistics.median(b - c for b, c in zip(walls[1:], walls[:-1]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--neurons", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--checkpointing-only", action="store_true",
                    help="only FSDP fp32 with and without --grad-checkpointing (give a longer --seq-len)")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dtpshard-bench-fsdp-"))
    try:
        ckpt, text = root / "model", root / "text.txt"
        n = make_checkpoint(ckpt, a)
        text.write_text("\n\n".join(" ".join(f"w{(i * 7 + j) % 997}" for j in range(400)) for i in range(200)))
        files = len(list(ckpt.glob("*.safetensors")))
        print(f"synthetic Llama, bf16 in {files} files: D {a.hidden}, {a.layers} layers, N {a.neurons}, vocab "
              f"{a.vocab}: {n / 1e6:.1f} M parameters ({n * 2 / 1e9:.2f} GB stored, {n * 4 / 1e9:.2f} GB fp32); "
              f"student L=4 δ=1; {a.nproc} processes x 1 thread, 1 x {a.seq_len} tokens a step per process")
        print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
        fp32 = ["--nproc", str(a.nproc), "--fsdp", "--precision", "fp32"]
        arms = {"FSDP fp32": _distill(ckpt, text, root / "fsdp", a, *fp32),
                "FSDP fp32, --grad-checkpointing": _distill(ckpt, text, root / "ckpt", a, *fp32,
                                                           "--grad-checkpointing")}
        if a.checkpointing_only:
            print("load after: ", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
            return checkpointing_line(arms)
        (root / "before").mkdir()
        failed = root_cause(launch_local(a.nproc, _before, (ckpt, text, root / "before", a)))
        if failed:
            raise SystemExit(f"before: {failed}")
        before = [json.loads((root / "before" / f"before-rank{r}.json").read_text()) for r in range(a.nproc)]
        arms |= {"one process": _distill(ckpt, text, root / "one", a),
                 "FSDP bf16-mixed": _distill(ckpt, text, root / "bf16", a, "--nproc", str(a.nproc), "--fsdp",
                                             "--precision", "bf16-mixed")}
        print("load after: ", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
        report(before, arms)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(before: list[dict], arms: dict[str, dict]) -> None:

    def peak(rec: dict, phase: str) -> int:  # of the largest rank
        return max(v for v in rec["measured"][phase] if v is not None)

    base = {p: max(r[p] for r in before) for p in ("setup", "training", "saving")}
    print(f"\npeak RSS per process (largest rank), MB {'setup':>9} {'training':>9} {'saving':>9}"
          f"   {'setup / before':>14}")
    print(f"{'before (replaced --fsdp path)':<38} {base['setup'] / MB:9.0f} {base['training'] / MB:9.0f} "
          f"{base['saving'] / MB:9.0f}   {1.0:14.2f}")
    for name, rec in arms.items():
        s, t, v = (peak(rec, p) for p in ("setup", "training", "saving"))
        print(f"{name:<38} {s / MB:9.0f} {t / MB:9.0f} {v / MB:9.0f}   {s / base['setup']:14.2f}")
    print("\nmemory plan against the measured peak (largest rank, any phase)")
    for name, rec in arms.items():
        planned = rec["plan"]["total"]
        measured = max(peak(rec, p) for p in ("setup", "training", "saving"))
        print(f"{name:<38} planned {planned / MB:8.0f} MB  measured {measured / MB:8.0f} MB  "
              f"measured / planned {measured / planned:5.2f}")
    checkpointing_line(arms)
    f32, b16 = arms["FSDP fp32"]["step_s"], arms["FSDP bf16-mixed"]["step_s"]
    print(f"\nseconds per step, FSDP: fp32 {f32:.2f}, bf16-mixed {b16:.2f} ({b16 / f32:.2f}x)")


def checkpointing_line(arms: dict[str, dict]) -> None:

    def peak(rec: dict) -> int:  # of the largest rank
        return max(v for v in rec["measured"]["training"] if v is not None)

    plain, ckpt = arms["FSDP fp32"], arms["FSDP fp32, --grad-checkpointing"]
    planned = plain["plan"]["parts"]["activations"] - plain["plan"]["activations_with_checkpointing"]
    print(f"\nactivation memory --grad-checkpointing saves under --fsdp (training peak, largest rank): measured "
          f"{(peak(plain) - peak(ckpt)) / MB:.0f} MB ({peak(plain) / MB:.0f} -> {peak(ckpt) / MB:.0f}), planned "
          f"{planned / MB:.0f} MB; seconds per step {ckpt['step_s'] / plain['step_s']:.2f}x")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
