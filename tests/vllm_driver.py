"""Run by the vLLM environment's python (test_vllm.py, bench/bench_vllm.py): engines one after the
other in the same processes (vLLM is imported once), each given a batch.

    python tests/vllm_driver.py SPECS.json OUT.json                    # vLLM spawns its TP workers
    torchrun --nproc-per-node TP tests/vllm_driver.py SPECS.json OUT.json   # every process is a rank

From Python, `launch` runs either and removes what vLLM leaves behind (segments, sockets).

Under torchrun the engines use vLLM's external launcher: each of the TP processes runs the engine
with its own rank (no workers spawned, no queues between them), every spec's TP must be the
world size, and rank 0 writes OUT.

SPECS: a list of {"model", "tp", "dtype", "prompts": [[ids]], "max_tokens", "logprobs", "prompt_logprobs",
"enforce_eager", "engine": {...}, "env": {variable: value} (set before the engine starts),
"threads": N (torch threads per rank, each rank pinned to its own cores),
"harness": {"latency": bool, "remove_reduces": bool, "vllm_gloo": bool, "plain": "auto" | "ring" |
"engine"} (bench/vllm_link.py), {"piecewise": bool}
(tests/piecewise_probe.py: the compiled graph split as the GPU's piecewise mode splits it),
"inductor_code": bool (return Inductor's output code of every graph compiled),
"timing": {"batches": [B], "max_tokens": [N], "repeat": R, "latencies_ms": [ms]},
"profile": {"batches": [B], "max_tokens": N} (bench/profile_vllm.py)};
OUT: one result per spec, {"tokens": [[ids]], "transport": what rank 0's sums travel over,
"logprobs": [[{id: logprob} per new token]],
"prompt_logprobs": [[logprob of each prompt token]], "seconds",
"timings": {"LAT/B/N": [seconds of each repeat]}, "model_seconds": {"LAT/B/N": [seconds in the model's
forward]}, "inductor_code": [source], "profile": [per rank {"B/N": {"seconds", "events": {name: [calls,
self µs, total µs]}}} for N in 1 and max_tokens]} or {"error": message} when the engine refused the model.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

LAUNCHED = "WORLD_SIZE" in os.environ  # under torchrun
SEGMENTS = Path("/dev/shm")
TAG = "DTPSHARD_VLLM_SEGMENTS"  # the prefix a launch's ranks name their segments with (launch sets it)


def launch(python: Path, specs: Path, out: Path, *, world: int | None = None, env: dict | None = None,
           timeout: float | None = None) -> subprocess.CompletedProcess:
    """This driver over SPECS into OUT, by `torchrun --standalone` of `world` ranks (vLLM's external
    launcher), or with no `world` in one plain process (vLLM spawns its workers). The segments the
    ranks named are removed after the launch, those of a rank killed before its own end included,
    and so are vLLM's sockets (own_sockets)."""
    tag = f"dtpshard-vllm-{uuid.uuid4().hex[:12]}"
    launcher = [str(Path(python).parent / "torchrun"), "--standalone", "--nproc-per-node", str(world)] if world \
        else [str(python)]
    try:
        with own_sockets(env or os.environ) as env:
            return subprocess.run([*launcher, __file__, str(specs), str(out)], env={**env, TAG: tag},
                                  capture_output=True, text=True, timeout=timeout)
    finally:
        remove(SEGMENTS.glob(f"{tag}*"))


@contextlib.contextmanager
def own_sockets(env: dict):
    """`env` with vLLM's engine sockets (ZeroMQ's ipc://, one name a socket, left in the temporary
    directory when the engine stops) in a directory of their own, removed at the end. Its cache root
    stays ~/.cache/vllm: an empty one costs every rank about 10 s inspecting the model classes."""
    with tempfile.TemporaryDirectory(prefix="dtpshard-vllm-") as own:
        yield {**env, "VLLM_RPC_BASE_PATH": own}


def mapped_segments(pid: int) -> set[Path]:
    """The vLLM communicator segments in /dev/shm that process `pid` or a descendant maps. vLLM
    leaves them named when its engine or server stops (16 MiB a run); found this way, they are
    known to be its own."""
    pids, found = [pid], set()
    while pids:
        p = pids.pop()
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                pids += [int(c) for c in (task / "children").read_text().split()]
            for line in Path(f"/proc/{p}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(f"{SEGMENTS}/") and "cpushm" in fields[5]:
                    found.add(Path(fields[5]))
        except OSError:  # gone meanwhile
            continue
    return found


def remove(segments) -> None:
    for segment in segments:
        segment.unlink(missing_ok=True)


def _own_segments() -> str:
    """Under the external launcher vLLM names its CPU communicator's shared-memory segments after
    the init method, "env://" in every run: two runs at once on one host, or a killed run's
    leftovers, collide ("create shm in SHMManager failed. errno: 17"). The launch's tag (by hand:
    torchrun's rendezvous id, unique per launch) makes the names its own."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    tag = os.environ.get(TAG) or f"dtpshard-vllm-{os.environ['TORCHELASTIC_RUN_ID']}"
    named = _CPUSHMDistributed.make_group_name
    _CPUSHMDistributed.make_group_name = staticmethod(lambda comm: tag + named(comm).lstrip("/"))
    return tag


def _pin(threads: int) -> None:
    """This rank on its own `threads` cores (rank r: cores r·threads ...), torch on as many threads."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    mine = {cores[(rank * threads + i) % len(cores)] for i in range(threads)}
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(threads)


def _inductor_code() -> list[str]:
    """The source of every module Inductor has compiled (or loaded from its cache) in this process."""
    from torch._inductor.codecache import PyCodeCache

    mods = {id(m): m for m in [*PyCodeCache.modules, *PyCodeCache.modules_no_attr.values()]}
    return [Path(m.__file__).read_text() for m in mods.values() if getattr(m, "__file__", None)]


def _link():
    """bench/vllm_link.py: the benchmark's emulated link and removed reduces."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import vllm_link

    return vllm_link


def _harness(spec: dict) -> None:
    if spec.get("piecewise"):  # tests/piecewise_probe.py: split as the GPU's piecewise graphs
        import piecewise_probe

        piecewise_probe.install()
    if spec.get("vllm_gloo"):
        _link().vllm_on_gloo()
    if spec.get("plain", "auto") != "auto":
        _link().plain_sums(spec["plain"])
    if spec.get("latency"):
        _link().install_latency()
    if spec.get("remove_reduces"):
        _link().remove_reduces()


def _time(llm, prompts: list, timing: dict) -> tuple[dict, dict]:
    """Seconds per generate call and seconds in the model's forward, repeats interleaved over latencies."""
    from vllm import SamplingParams

    inside = [0.0]

    def hook(model):
        started = [0.0]
        model.register_forward_pre_hook(lambda *_: started.__setitem__(0, time.perf_counter()))
        model.register_forward_hook(lambda *_: inside.__setitem__(0, inside[0] + time.perf_counter() - started[0]))

    if LAUNCHED:  # the model runs in this process (with vLLM's own workers it does not: not timed)
        llm.apply_model(hook)
    set_latency = _link().set_latency if any(timing.get("latencies_ms", [0])) else (lambda seconds: None)
    walls: dict = {}
    model: dict = {}
    for _ in range(timing.get("repeat", 3)):
        for lat in timing.get("latencies_ms", [0]):
            set_latency(lat / 1000)
            for b in timing["batches"]:
                for n in timing["max_tokens"]:
                    fixed = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                    inside[0] = 0.0
                    start = time.perf_counter()
                    llm.generate(prompts[:b], fixed, use_tqdm=False)
                    key = f"{lat:g}/{b}/{n}"
                    walls.setdefault(key, []).append(time.perf_counter() - start)
                    model.setdefault(key, []).append(inside[0])
    set_latency(0.0)
    return walls, model


def _profile(llm, prompts: list, profile: dict) -> list[dict]:
    """Every rank's CPU profile (rank 0 gathers them) of a generate call per batch, of 1 new token and
    of `max_tokens`: their difference is that many decode steps less one (the prefill cancels)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler
    from vllm import SamplingParams

    out = {}
    for b in profile["batches"]:
        for n in (1, profile["max_tokens"]):
            fixed = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            llm.generate(prompts[:b], fixed, use_tqdm=False)  # warm at this size
            with profiler(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                llm.generate(prompts[:b], fixed, use_tqdm=False)
                seconds = time.perf_counter() - start
            events = {e.key: [e.count, e.self_cpu_time_total, e.cpu_time_total] for e in prof.key_averages()}
            out[f"{b}/{n}"] = {"seconds": seconds, "events": events}
    import torch.distributed as dist

    if not (LAUNCHED and dist.is_initialized()):
        return [out]
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, out)  # every rank's, so that rank 0 writes them all
    return ranks


def _transport(model) -> str:
    """What this rank's sums travel over: the student's own choice, or vLLM's TP communicator's."""
    reduce = getattr(getattr(model, "model", None), "reduce", None)
    if reduce is not None and hasattr(reduce, "said"):
        return reduce.said
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return "nothing (one rank)"
    module = getattr(group.device_communicator, "dist_module", None)
    if type(module).__name__ == "_CPUSHMDistributed":
        return "vLLM's shared-memory all-reduce (_CPUSHMDistributed)"
    return f"vLLM's {type(group.device_communicator).__name__} ({dist.get_backend(group.device_group)})"


def run(spec: dict) -> dict:
    from vllm import LLM

    if spec.get("threads"):
        _pin(spec["threads"])
    if spec.get("harness"):
        _harness(spec["harness"])
    os.environ.update(spec.get("env", {}))  # before the engine: vLLM's workers inherit it
    engine = dict(spec.get("engine", {}))
    if LAUNCHED:
        engine["distributed_executor_backend"] = "external_launcher"
    try:
        llm = LLM(model=spec["model"], tensor_parallel_size=spec["tp"], dtype=spec.get("dtype", "auto"),
                  enforce_eager=spec.get("enforce_eager", True), max_model_len=spec.get("max_model_len", 256),
                  max_num_seqs=spec.get("max_num_seqs", 16), seed=0, **engine)
    except Exception as e:  # the refusal is what the test reads
        return {"error": f"{type(e).__name__}: {e}"}
    made = set() if LAUNCHED else mapped_segments(os.getpid())  # vLLM's own workers': removed after
    try:
        return _serve(llm, spec)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm  # under torchrun the process groups stay: the next engine (same TP) finds them made
        gc.collect()
        remove(made)


def _serve(llm, spec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            logprobs=spec.get("logprobs"), prompt_logprobs=spec.get("prompt_logprobs"))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": time.perf_counter() - start,
              "transport": llm.apply_model(_transport)[0]}
    if spec.get("logprobs"):
        result["logprobs"] = [[{str(t): lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]
                              for o in outs]
    if spec.get("prompt_logprobs") is not None:  # each prompt token's own log-probability (None: the first)
        result["prompt_logprobs"] = [[None if pos is None else pos[t].logprob for t, pos in
                                      zip(p, o.prompt_logprobs)] for p, o in zip(spec["prompts"], outs)]
    if spec.get("timing"):
        result["timings"], result["model_seconds"] = _time(llm, prompts, spec["timing"])
    if spec.get("profile"):
        result["profile"] = _profile(llm, prompts, spec["profile"])
    if spec.get("inductor_code"):
        result["inductor_code"] = _inductor_code()
    if spec.get("harness", {}).get("piecewise"):
        import piecewise_probe

        result["piecewise"] = dict(piecewise_probe.REPORT)
    return result


def main(specs_path: str, out_path: str) -> int:
    specs = json.loads(open(specs_path).read())
    tag = _own_segments() if LAUNCHED else None
    results = []
    try:
        for spec in specs:
            results.append(run(spec))
            if os.environ.get("RANK", "0") == "0":
                open(out_path, "w").write(json.dumps(results))  # what is done survives a later engine's crash
    finally:  # vLLM leaves them named; every rank joined long ago, so each unlinks the one it made
        remove(SEGMENTS.glob(f"{tag}*_{os.environ['RANK']}") if tag else ())
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
