"""vLLM decode throughput of a DTP student against plain TP on the same weights, in vLLM's default
(compiled) mode, with and without an emulated slower link.

The same random weights served three ways, each by one engine in its own `torchrun
--nproc-per-node TP` (tests/vllm_driver.py; vLLM's external launcher), under the same settings:

- DTP: the student (DTPModel.save_pretrained, model_type "dtp", L = TP, δ = 1);
- TP: its permuted dense twin (the same safetensors with the family's config, model_type "llama"),
  which vLLM serves as a Llama with a blocking all-reduce after every module;
- no-comm: the student with its module reduces removed (bench/vllm_link.py): the same work, a
  wrong function, the most the delayed reduce can give.

`--latency-ms` adds a fixed latency to every all-reduce of all three, the same for each (harness
only, bench/vllm_link.py): in series with the transfer, so TP waits all of it after every module
while DTP's delayed reduce waits only for what δ modules of compute have not covered. Per batch B,
prompts of 32 tokens:

    time per output token = (t(N new) − t(1 new)) / (N − 1)   (the prefill cancels)
    decode tokens/s       = B / time per output token

the median of `--repeat` runs, repeats interleaved over the latencies. "model share" is the part of
a decode step spent in the model's forward (the rest is vLLM's scheduler, sampling and LM head).
Each rank runs `--threads` torch threads pinned to its own cores.

    python bench/bench_vllm.py --tp 2 --batch 1 8 --latency-ms 0 0.5 --json

The last line with --json is a JSON list of rows {tp, batch, latency_ms, dtp_tok_s, tp_tok_s,
nocomm_tok_s, model_share}. Run by the project's python; vLLM runs in the environment
`python -m dtpshard.serve.env` builds (or $DTPSHARD_VLLM_PYTHON), as for the tests.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# Weights dominate a decode step: hidden 1024, 8 layers, fp32 (≈ 0.37 GB, ≈ 0.19 GB a rank at TP 2)
SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, vocab_size=8192, max_position_embeddings=1024)
PROMPT = 32


def make_pair(root: Path, devices: int, delay: float = 1, family: str = "llama", dtype: str = "float32",
              shape: dict | None = None) -> tuple[Path, Path]:
    """(student, dense) directories of the same random weights."""
    from dtpshard.model.checkpoint import open_checkpoint
    from dtpshard.model.dtp import DTPModel
    from tiny import save_tiny

    teacher = save_tiny(root / "teacher", family, **(shape or SHAPE))
    student, dense = root / f"student-{devices}", root / f"dense-{devices}"
    DTPModel.from_pretrained(teacher, devices, delay).save_pretrained(student, source=teacher,
                                                                      dtype=getattr(torch, dtype))
    dense.mkdir()
    for f in student.iterdir():
        if f.suffix in (".safetensors", ".json") and f.name != "config.json":
            shutil.copy(f, dense / f.name)
    base = open_checkpoint(student).hf_config.base_config()  # the family's config of the same fields
    base.architectures = [type(base).__name__.replace("Config", "ForCausalLM")]
    base.save_pretrained(dense)
    return student, dense


def run_engines(python: Path, specs: list[dict], tp: int, env: dict) -> list[dict]:
    """Each spec's engine in its own torchrun (a second engine in the same ranks can hang)."""
    launcher = [str(python.parent / "torchrun"), "--standalone", "--nproc-per-node", str(tp)]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(specs):
            (Path(tmp) / f"{i}.json").write_text(json.dumps([spec]))
            done = subprocess.run([*launcher, str(ROOT / "tests" / "vllm_driver.py"), f"{tmp}/{i}.json",
                                   f"{tmp}/{i}-out.json"], env=env, capture_output=True, text=True)
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


def measure(python: Path, pair: tuple[Path, Path], tp: int, batches: list[int], latencies: list[float],
            new: int, repeat: int, threads: int = 0, eager: bool = False, dtype: str = "float32",
            env: dict | None = None) -> list[dict]:
    """Rows per (latency, batch). `threads` > 0 pins each rank to that many cores; the emulated link
    (CPU only) is installed when a latency is not 0."""
    from dtpshard.serve.env import runtime_env

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (PROMPT,), generator=g).tolist() for _ in range(max(batches))]
    student, dense = pair

    def spec(model: Path, remove: bool) -> dict:
        return {"model": str(model), "tp": tp, "dtype": dtype, "prompts": prompts[:1], "max_tokens": 1,
                "enforce_eager": eager, "max_model_len": 1024, "max_num_seqs": max(batches), "threads": threads,
                "harness": {"latency": any(lat > 0 for lat in latencies), "remove_reduces": remove},
                "timing": {"batches": batches, "max_tokens": [1, new], "repeat": repeat, "latencies_ms": latencies}}

    env = dict(env or runtime_env())
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    dtp, plain, nocomm = run_engines(python, [spec(student, False), spec(dense, False), spec(student, True)], tp, env)
    rows = []
    for lat in latencies:
        for b in batches:
            (d, share), (t, _), (n, _) = (tok_s(r, lat, b, new) for r in (dtp, plain, nocomm))
            rows.append({"tp": tp, "batch": b, "latency_ms": lat, "dtp_tok_s": d, "tp_tok_s": t, "nocomm_tok_s": n,
                         "model_share": share})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| TP | batch | latency ms | DTP tok/s | TP tok/s | no-comm tok/s | DTP / TP | no-comm / TP | "
             "DTP's share of the ceiling's gain | model share of a step |", "|" + "---:|" * 10]
    for r in rows:
        gain = r["nocomm_tok_s"] - r["tp_tok_s"]
        got = (r["dtp_tok_s"] - r["tp_tok_s"]) / gain if abs(gain) > 1e-9 else float("nan")
        lines.append(f"| {r['tp']} | {r['batch']} | {r['latency_ms']:g} | {r['dtp_tok_s']:.1f} | {r['tp_tok_s']:.1f} | "
                     f"{r['nocomm_tok_s']:.1f} | {r['dtp_tok_s'] / r['tp_tok_s']:.3f}× | "
                     f"{r['nocomm_tok_s'] / r['tp_tok_s']:.3f}× | {got:.0%} | {r['model_share']:.0%} |")
    return "\n".join(lines)


def main() -> int:
    from dtpshard.serve.env import found_python

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0, 0.1, 0.5, 1])
    ap.add_argument("--new", type=int, default=33, help="new tokens per timed request")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / TP, at least 1)")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager (default: vLLM's compiled mode)")
    ap.add_argument("--json", action="store_true", help="end with the rows as one JSON line")
    args = ap.parse_args()
    python = found_python()
    if python is None or not python.exists():
        raise SystemExit("no vLLM environment: run `python -m dtpshard.serve.env` first")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.tp)
    with tempfile.TemporaryDirectory() as tmp:
        pair = make_pair(Path(tmp), args.tp)
        rows = measure(python, pair, args.tp, args.batch, args.latency_ms, args.new, args.repeat, threads, args.eager)
    load = os.getloadavg()
    print(f"vLLM {'eager' if args.eager else 'compiled'}, TP {args.tp}, {threads} thread(s) per rank, "
          f"{os.cpu_count()} cores, load average after the run {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
    print(table(rows))
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
