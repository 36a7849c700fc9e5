"""bench/cuda_check.py's sections on how partials travel on CUDA: the exchange over functional
collectives on a one-rank NCCL group (section 8), vLLM at TP 1 with and without CUDA graphs
(section 10), and the symmetric-memory exchange (section 11). Run through cuda_check.py."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch


def check(name: str, ok: bool, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    return ok


def _exchange_rank(out: str, variant: str) -> int:
    """One NCCL rank: the exchange of 2 devices' schedule (δ = 1) over 8 toy modules, run as
    `variant`; the result and Inductor's code saved to out."""
    import torch.distributed as dist

    from dtpshard.core.launch import process_group
    from dtpshard.model.delay import schedule
    from dtpshard.model.exchange import Exchange
    from dtpshard.serve.reduce import FunctionalReduce

    class Own:  # a one-rank sum is the rank's own partial: the eager reference
        def start(self, p):
            return p

        def value(self, handle):
            return handle

    M, D, B, breaks = 8, 1024, 8, {2, 4, 6}
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(D, D, device="cuda", generator=g) / D ** 0.5 for _ in range(M)]
    x0 = torch.randn(B, D, device="cuda", generator=g)
    sched = schedule(M, 2, 1, "sqrt")
    with process_group(timeout=120, backend="nccl"):
        group = dist.group.WORLD.group_name

        def forward(x, reduce, settle, split):
            exchange = Exchange(sched, reduce, 2)
            for m, w in enumerate(weights):
                if m in breaks and settle:
                    exchange.settle()
                if m in breaks and split:
                    torch._dynamo.graph_break()
                x = exchange.update(m, x, torch.tanh(x @ w))
            return exchange.mean(x)

        want = forward(x0, Own(), False, False)
        settle, split, mode = {"eager": (False, False, None), "compiled": (False, False, "default"),
                               "graphs": (False, False, "reduce-overhead"),
                               "graphs, settled before each break": (True, True, "reduce-overhead"),
                               "graphs, open across breaks": (False, True, "reduce-overhead")}[variant]
        def run(x):
            return forward(x, FunctionalReduce(group), settle, split)

        fn = run if mode is None else torch.compile(run, mode=mode)
        from torch._dynamo.utils import counters

        counters.clear()
        for _ in range(3):  # warm-up, recording, replay
            got = fn(x0.clone())
        torch.cuda.synchronize()
        graphs = -1  # no CUDA graphs asked for
        if mode == "reduce-overhead":  # a skipped capture runs eagerly and would pass without a graph
            from torch._inductor.cudagraph_trees import get_manager

            manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
            captured = 0 if manager is None else len(list(manager.get_roots()))
            graphs = captured if not counters["inductor"]["cudagraph_skips"] else 0
        code = ""
        if mode == "default":
            from torch._inductor.codecache import PyCodeCache
            code = "\n".join(Path(m.__file__).read_text() for m in PyCodeCache.modules
                             if "_c10d_functional" in Path(m.__file__).read_text())
        Path(out).write_text(f"{(got - want).abs().max().item()} {graphs}\n{code}")
    return 0


def exchange() -> bool:
    from dtpshard.core.launch import launch_local
    from graph_order import overlaps

    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("eager", "compiled", "graphs", "graphs, settled before each break",
                        "graphs, open across breaks"):
            out = f"{tmp}/{len(variant)}.txt"
            crash_case = variant == "graphs, open across breaks"  # upstream's: reported, not judged, and fast
            exits = launch_local(1, _exchange_rank, (out, variant), grace=30, deadline=90 if crash_case else 600)
            if crash_case:
                print(f"INFO  exchange, {variant}: rank exited {exits[0].code}"
                      + (f", max diff {Path(out).read_text().split()[0]}" if Path(out).exists() else ""))
                continue
            if exits[0].code or not Path(out).exists():
                ok &= check(f"exchange on a one-rank NCCL group, {variant}", False, f"rank exited {exits[0].code}")
                continue
            head, _, code = Path(out).read_text().partition("\n")
            diff, graphs = head.split()
            ok &= check(f"exchange on a one-rank NCCL group, {variant}", float(diff) <= 1e-5, f"max diff {diff}")
            if int(graphs) >= 0:
                ok &= check(f"exchange, {variant}: CUDA graphs captured, none skipped", int(graphs) > 0,
                            f"{graphs} graph(s) recorded")
            if code:
                between = overlaps(code)
                ok &= check("compiled exchange: each wait a module after its all-reduce",
                            min(between[:-1], default=0) >= 1, f"GEMMs between start and wait: {between}")
    return ok


def vllm_one_gpu() -> bool:
    """A student at TP 1 (vLLM still builds its one-rank NCCL group) served with CUDA graphs (vLLM's
    default) and with --enforce-eager: the same greedy tokens, and dtpshard's own."""
    import importlib.util
    import json
    import os

    if importlib.util.find_spec("vllm") is None:
        print("SKIP  vLLM at TP 1: vllm is not installed here (pip install vllm, then this checkout)")
        return True
    from bench_vllm import make_pair  # puts tests/ on the path
    from dtpshard.model.dtp import DTPModel
    from vllm_driver import launch

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU")}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 8000, (5 + 7 * i,), generator=g).tolist() for i in range(4)]
    with tempfile.TemporaryDirectory() as tmp:
        student, _ = make_pair(Path(tmp), 1, dtype="float32")
        specs = [{"model": str(student), "tp": 1, "dtype": "float32", "prompts": prompts, "max_tokens": 16,
                  "enforce_eager": eager, "max_model_len": 1024} for eager in (False, True)]
        Path(tmp, "specs.json").write_text(json.dumps(specs))
        done = launch(Path(sys.executable), Path(tmp, "specs.json"), Path(tmp, "out.json"), env=env, timeout=1500)
        if done.returncode or not Path(tmp, "out.json").exists():
            return check("vLLM at TP 1", False, f"driver exit {done.returncode}: {done.stderr[-1500:]}")
        graphs, eager = json.loads(Path(tmp, "out.json").read_text())
        model = DTPModel.from_pretrained(student, dtype=torch.float32).eval()
        ours = [model.generate(torch.tensor([p]), 16, eos_token_id=-1)[0, len(p):].tolist() for p in prompts]
    ok = check("vLLM at TP 1: CUDA graphs == --enforce-eager", graphs.get("tokens") == eager.get("tokens"),
               f"transport {graphs.get('transport')!r}")
    return ok & check("vLLM at TP 1: == dtpshard generate", eager.get("tokens") == ours, "greedy, fp32")


def _symmetric_rank(out: str) -> int:
    """One rank of the symmetric-memory exchange (transport/symmetric.py): the exchange of this
    group's size over 8 toy modules at δ = 1, eager and captured in a CUDA graph, against the
    functional collectives' result."""
    import torch.distributed as dist

    from dtpshard.core.launch import process_group
    from dtpshard.model.delay import schedule
    from dtpshard.model.exchange import Exchange
    from dtpshard.serve.reduce import FunctionalReduce
    from dtpshard.transport.shared import ring_slots
    from dtpshard.transport.symmetric import SymmetricReduce

    M, D, B = 8, 1024, 8
    with process_group(timeout=120, backend="nccl") as (rank, world):
        g = torch.Generator(device="cuda").manual_seed(rank)
        weights = [torch.randn(D, D, device="cuda", generator=g) / D ** 0.5 for _ in range(M)]
        x0 = torch.randn(B, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
        sched = schedule(M, max(world, 2), 1, "sqrt")
        symmetric = SymmetricReduce(dist.group.WORLD, ring_slots(sched), B * D, torch.float32, x0.device)

        def forward(reduce):
            if hasattr(reduce, "begin"):
                reduce.begin()
            exchange = Exchange(sched, reduce, max(world, 2))
            x = x0.clone()
            for m, w in enumerate(weights):
                x = exchange.update(m, x, torch.tanh(x @ w))
            h = exchange.mean(x)
            if hasattr(reduce, "finish"):
                reduce.finish()
            return h

        want = forward(FunctionalReduce(dist.group.WORLD.group_name))
        eager = forward(symmetric)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(symmetric)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            captured = forward(symmetric)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        diffs = [(eager - want).abs().max().item(), (captured - want).abs().max().item()]
        if rank == 0:
            Path(out).write_text(f"{world} {diffs[0]} {diffs[1]}")
    return 0


def symmetric() -> bool:
    """The symmetric-memory exchange on every GPU here (one GPU: a one-rank group, which checks the
    allocation, the rendezvous and capture, not a transfer)."""
    from dtpshard.core.launch import launch_local

    world = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        exits = launch_local(world, _symmetric_rank, (f"{tmp}/out.txt",), grace=30, deadline=300)
        if any(e.code for e in exits) or not Path(tmp, "out.txt").exists():
            return check("symmetric-memory exchange", False, f"rank exits {[e.code for e in exits]}")
        n, eager, graph = Path(tmp, "out.txt").read_text().split()
    return check(f"symmetric-memory exchange on {n} GPU(s): eager and CUDA graph == functional collectives",
                 max(float(eager), float(graph)) <= 1e-5, f"max diff eager {eager}, graph replay {graph}")


