"""Run by the vLLM environment's python (test_vllm.py, bench/bench_vllm.py): engines one after the
other in the same processes (vLLM is imported once), each given a batch.

    python tests/vllm_driver.py SPECS.json OUT.json                    # vLLM spawns its TP workers
    torchrun --nproc-per-node TP tests/vllm_driver.py SPECS.json OUT.json   # every process is a rank

Under torchrun the engines use vLLM's external launcher: each of the TP processes runs the engine
with its own rank (no workers spawned, no queues between them), every spec's TP must be the
world size, and rank 0 writes OUT.

SPECS: a list of {"model", "tp", "dtype", "prompts": [[ids]], "max_tokens", "logprobs", "engine": {...},
"timing": {"batches": [B], "max_tokens": [N], "repeat": R}};
OUT: one result per spec, {"tokens": [[ids]], "logprobs": [[{id: logprob} per new token]], "seconds",
"timings": {"B/N": [seconds of each repeat]}} or {"error": message} when the engine refused the model.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time

LAUNCHED = "WORLD_SIZE" in os.environ  # under torchrun


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = dict(spec.get("engine", {}))
    if LAUNCHED:
        engine["distributed_executor_backend"] = "external_launcher"
    try:
        llm = LLM(model=spec["model"], tensor_parallel_size=spec["tp"], dtype=spec.get("dtype", "auto"),
                  enforce_eager=spec.get("enforce_eager", True), max_model_len=spec.get("max_model_len", 256),
                  max_num_seqs=spec.get("max_num_seqs", 16), seed=0, **engine)
    except Exception as e:  # noqa: BLE001 - the refusal is what the test reads
        return {"error": f"{type(e).__name__}: {e}"}
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            logprobs=spec.get("logprobs"))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": time.perf_counter() - start}
    if spec.get("logprobs"):
        result["logprobs"] = [[{str(t): lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]
                              for o in outs]
    timing = spec.get("timing")
    if timing:
        result["timings"] = {}
        for b in timing["batches"]:
            for n in timing["max_tokens"]:
                fixed = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                runs = []
                for _ in range(timing.get("repeat", 3)):
                    start = time.perf_counter()
                    llm.generate(prompts[:b], fixed, use_tqdm=False)
                    runs.append(time.perf_counter() - start)
                result["timings"][f"{b}/{n}"] = runs
    llm.llm_engine.engine_core.shutdown()
    del llm  # under torchrun the process groups stay: the next engine (same TP) finds them made
    gc.collect()
    return result


def main(specs_path: str, out_path: str) -> int:
    specs = json.loads(open(specs_path).read())
    results = []
    for spec in specs:
        results.append(run(spec))
        if os.environ.get("RANK", "0") == "0":
            open(out_path, "w").write(json.dumps(results))  # what is done survives a later engine's crash
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
