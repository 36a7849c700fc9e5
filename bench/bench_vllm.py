"""vLLM decode speed of a DTP student against plain TP on the same weights, at TP = L.

The pair: a random student (DTPModel.save_pretrained, model_type "dtp", L devices, δ = 1) and
its permuted dense checkpoint: the same safetensors with its family's config (model_type
"llama"), which vLLM serves as a Llama with its usual all-reduce after every module. Both run
in the vLLM environment (dtpshard.serve.env), one engine each, each in its own
`torchrun --nproc-per-node TP` (tests/vllm_driver.py), under the same settings; per
batch size B, prompts of 32 tokens:

    time per output token = (t(N new) − t(1 new)) / (N − 1)   (the prefill cancels)
    decode tokens/s       = B / time per output token

the median of `--repeat` runs. The ratio is DTP's throughput over TP's: on the CPU the reduce
is vLLM's blocking all-reduce either way, so ≥ 0.95× says DTP costs nothing extra; on GPUs
(bench/cuda_check.py) it is where the delayed reduce should pay.

    PYTHONPATH=. python bench/bench_vllm.py                # TP 2, batch 1 and 8, this CPU
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# A SmolLM2-135M-like decoder whose KV groups and neurons split over 2, 4 and 8 devices.
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8,
             num_key_value_heads=8, head_dim=64, vocab_size=8192, max_position_embeddings=1024)


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


def measure(python: Path, pair: tuple[Path, Path], tp: int, batches: list[int], new: int, repeat: int,
            dtype: str = "float32", eager: bool = True, env: dict | None = None) -> list[dict]:
    """One engine per model; rows of (batch, DTP and TP time per output token and tokens/s, ratio)."""
    from dtpshard.serve.env import runtime_env

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (32,), generator=g).tolist() for _ in range(max(batches))]
    specs = [{"model": str(m), "tp": tp, "dtype": dtype, "prompts": prompts[:1], "max_tokens": 1,
              "enforce_eager": eager, "max_model_len": 1024, "max_num_seqs": max(batches),
              "timing": {"batches": batches, "max_tokens": [1, new], "repeat": repeat}} for m in pair]
    launcher = [str(python.parent / "torchrun"), "--standalone", "--nproc-per-node", str(tp)]  # each process a rank
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(specs):  # an engine per torchrun: a second one in the same ranks can hang
            (Path(tmp) / f"{i}.json").write_text(json.dumps([spec]))
            done = subprocess.run([*launcher, str(ROOT / "tests" / "vllm_driver.py"), f"{tmp}/{i}.json",
                                   f"{tmp}/{i}-out.json"], env=env or runtime_env(), capture_output=True, text=True)
            if done.returncode or not (Path(tmp) / f"{i}-out.json").exists():
                raise SystemExit(f"vLLM failed:\n{done.stderr[-4000:]}")
            results += json.loads((Path(tmp) / f"{i}-out.json").read_text())
    dtp, dense = results
    for r in (dtp, dense):
        if "error" in r:
            raise SystemExit(r["error"])
    rows = []
    for b in batches:
        tpot = [(statistics.median(r["timings"][f"{b}/{new}"]) - statistics.median(r["timings"][f"{b}/1"]))
                / (new - 1) for r in (dtp, dense)]
        rows.append({"tp": tp, "batch": b, "dtp_tpot_ms": 1e3 * tpot[0], "tp_tpot_ms": 1e3 * tpot[1],
                     "dtp_tok_s": b / tpot[0], "tp_tok_s": b / tpot[1], "ratio": tpot[1] / tpot[0]})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| TP | batch | DTP ms/token | TP ms/token | DTP tokens/s | TP tokens/s | DTP / TP throughput |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['tp']} | {r['batch']} | {r['dtp_tpot_ms']:.1f} | {r['tp_tpot_ms']:.1f} | {r['dtp_tok_s']:.1f} | "
              f"{r['tp_tok_s']:.1f} | {r['ratio']:.3f}× |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    from dtpshard.serve.env import found_python

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new", type=int, default=33, help="new tokens per timed request")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--compiled", action="store_true", help="vLLM's torch.compile (default: eager, as the tests)")
    args = ap.parse_args()
    python = found_python()
    if python is None:
        raise SystemExit("no vLLM environment: run `python -m dtpshard.serve.env` first")
    with tempfile.TemporaryDirectory() as tmp:
        pair = make_pair(Path(tmp), args.tp)
        rows = measure(python, pair, args.tp, args.batches, args.new, args.repeat, eager=not args.compiled)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
