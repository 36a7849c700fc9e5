"""The exchange (model/exchange.py) is the schedule carried out once for every engine: the
simulator's, a runtime rank's and a vLLM rank's are the same code with another Reduce.

- The schedule's derived facts equal their definitions: the edges calibration scores are
  b - δ <= a <= b - 1 (docs/design.md §2), and a sum is sent only if it lands.
- On a 2-process gloo group, the Reduce vLLM uses (serve/reduce.py, functional collectives: the
  code path a GPU takes) gives the simulator's streams, eagerly and under torch.compile, with a
  graph break between a sum's start and its landing, settled before the break or not.
- It is asynchronous: a rank's start returns while the other rank has not yet sent, and the
  rank waits only where the sum lands.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from dtpshard.core.launch import launch_local, root_cause
from dtpshard.model.delay import schedule
from dtpshard.model.exchange import DeviceAxis, Exchange
from graph_order import overlaps

DEADLINE = 240


@pytest.mark.parametrize("modules", [2, 5, 8, 13])
@pytest.mark.parametrize("delay", [0, 0.25, 0.5, 1, 1.5, 2, 2.75, 4])
def test_edges_are_the_designs(modules, delay):
    if delay >= modules:
        pytest.skip("δ < M")
    want = [(a, b) for b in range(modules) for a in range(max(0, math.ceil(b - delay)), b)]
    sched = schedule(modules, 3, delay, "sqrt")
    assert sched.edges() == want
    # a sum is sent iff it lands; it lands ⌊δ⌋ (and ⌈δ⌉) modules after it is made, or never (stage 3)
    for k in range(modules):
        lands = [m for m, step in enumerate(sched) for a, _ in step.arrivals if a == k]
        assert (k in sched.last_use) == bool(lands)
        if lands:
            assert sched.last_use[k] == max(lands) == min(k + math.ceil(delay), modules - 1)
    assert sched.tensor_parallel == (delay == 0)


def _modules(L: int, D: int, M: int, seed: int = 0) -> list[torch.Tensor]:
    """Per module a [L, D, D] weight: device l's partial is tanh(x_l W_l) (a stand-in for a module)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(L, D, D, generator=g, dtype=torch.float64) / D ** 0.5 for _ in range(M)]


def _forward(x: torch.Tensor, weights: list[torch.Tensor], exchange: Exchange, at: frozenset = frozenset(),
             settle: bool = False, breaks: bool = False) -> torch.Tensor:
    """x: this rank's (or every device's) streams; before each module in `at`, the pending sums
    settled and/or a graph break."""
    for m, w in enumerate(weights):
        if m in at and settle:
            exchange.settle()
        if m in at and breaks:
            torch._dynamo.graph_break()
        p = torch.tanh(torch.einsum("l...d,lde->l...e", x, w))
        x = exchange.update(m, x, p)
    return exchange.mean(x)


def _simulated(L: int, delay: float, B: int = 3, D: int = 16, M: int = 8) -> torch.Tensor:
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return _forward(x.expand(L, B, D), _modules(L, D, M), Exchange(schedule(M, L, delay, "sqrt"), DeviceAxis(), L))


BREAKS = frozenset({2, 4, 6})
VARIANTS = {  # name -> (compiled, before which modules, settle there, graph break there)
    "eager": (False, frozenset(), False, False),
    "eager, settled early": (False, frozenset({2, 5}), True, False),
    "compiled": (True, frozenset(), False, False),
    "compiled, settled before each break": (True, BREAKS, True, True),
    # left open across the breaks: what CUDA graphs cannot take (pytorch/pytorch#192000), exact without them
    "compiled, open across the breaks": (True, BREAKS, False, True),
}


def _compiled_code(marker: str = "_c10d_functional") -> str:
    """The output code of the graphs Inductor compiled in this process that hold `marker` (the reduce's ops)."""
    from pathlib import Path

    from torch._inductor.codecache import PyCodeCache

    mods = {id(m): m for m in [*PyCodeCache.modules, *PyCodeCache.modules_no_attr.values()]}
    sources = [Path(m.__file__).read_text() for m in mods.values() if getattr(m, "__file__", None)]
    return "\n".join(s for s in sources if marker in s)


def _rank(out: str, delay: float, late_ms: float) -> int:
    from dtpshard.core.launch import process_group, set_threads
    from dtpshard.serve.reduce import FunctionalReduce

    set_threads()
    B, D, M = 3, 16, 8
    with process_group(timeout=120) as (rank, world):
        group = torch.distributed.group.WORLD.group_name
        x = torch.randn(B, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)[None]
        weights = [w[rank:rank + 1] for w in _modules(world, D, M)]
        sched = schedule(M, world, delay, "sqrt")
        res = {}
        for name, (compiled, at, settle, breaks) in VARIANTS.items():
            def run(x, at=at, settle=settle, breaks=breaks):
                return _forward(x, weights, Exchange(sched, FunctionalReduce(group), world), at, settle, breaks)

            torch._dynamo.reset()
            res[name] = (torch.compile(run, backend="inductor") if compiled else run)(x)
            if name == "compiled":
                res["code"] = _compiled_code()
        # asynchrony: rank 1 starts its half of a sum only once rank 0's start has returned (an event,
        # not a delay): a start that waited for rank 1 would never return, and the deadline fail the test
        reduce = FunctionalReduce(group)
        torch.distributed.barrier()
        started = Path(out, "rank0.started")
        if rank == 1:
            end = time.monotonic() + 120
            while not started.exists():
                if time.monotonic() > end:
                    raise AssertionError("rank 0's start waited for rank 1")
                time.sleep(0.01)
            time.sleep(late_ms / 1000)
        t0 = time.perf_counter()
        handle = reduce.start(torch.full((4,), rank + 1.0))
        t1 = time.perf_counter()
        if rank == 0:
            started.touch()
        total = reduce.value(handle)
        res["timing"] = (t1 - t0, time.perf_counter() - t1, total.tolist())
        torch.save(res, f"{out}/rank{rank}.pt")
    return 0


@pytest.mark.parametrize("delay", [1, 1.5, 2])
def test_functional_reduce_gives_the_simulators_streams(tmp_path, delay):
    late_ms = 400
    exits = launch_local(2, _rank, (str(tmp_path), delay, late_ms), deadline=DEADLINE)
    assert [e.code for e in exits] == [0, 0], root_cause(exits)
    want = _simulated(2, delay)
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt")
        for name in VARIANTS:
            assert (res[name] - want).abs().max().item() < 1e-12, (r, name)
        start, wait, total = res["timing"]
        assert total == [3.0] * 4
    # Inductor kept each wait where the exchange put it: ⌊δ⌋ modules (one GEMM each) after its start
    between = overlaps(torch.load(tmp_path / "rank0.pt")["code"])
    assert len(between) == len(schedule(8, 2, delay, "sqrt").last_use) + 1  # + the final mean's
    assert min(between[:-1]) >= int(delay) and between[-1] == 0, between
    _, wait0, _ = torch.load(tmp_path / "rank0.pt")["timing"]
    assert wait0 >= late_ms / 1000, "rank 0's value did not wait for rank 1's late half"


def test_overlaps_reads_a_wait_next_to_its_collective():
    """The parser itself: a wait right behind its collective counts no GEMM (so the test below can fail)."""
    code = ("buf1 = torch.ops._C.onednn_mm.default(arg1, buf0, None)\n"
            "torch.ops._c10d_functional.all_reduce_.default(buf1, 'sum', '2')\n"
            "torch.ops._c10d_functional.wait_tensor.default(buf1)\n"
            "buf3 = torch.ops._C.onednn_mm.default(arg2, buf2, None)\n"
            "torch.ops._c10d_functional.all_reduce_.default(buf3, 'sum', '2')\n"
            "buf4 = torch.ops._C.onednn_mm.default(arg3, buf2, None)\n"
            "torch.ops._c10d_functional.wait_tensor.default(buf3)\n")
    assert overlaps(code) == [0, 1]
