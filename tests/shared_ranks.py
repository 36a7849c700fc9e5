"""One rank of tests/test_shared_exchange.py: `python tests/shared_ranks.py SCENARIO OUT [ARG]`, with
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. Plain processes, not launch_local: the tests kill
and stop ranks themselves and watch what the survivor does. Each rank writes OUT/rank{r}.pt."""
from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from dtpshard.core.launch import RankFailure  # noqa: E402
from dtpshard.model.delay import schedule  # noqa: E402
from dtpshard.model.exchange import Exchange  # noqa: E402
from dtpshard.transport import shared  # noqa: E402
from dtpshard.transport.choose import choose  # noqa: E402
from test_exchange import BREAKS, _forward, _modules  # noqa: E402

VARIANTS = {  # name -> (compiled, before which modules, settle there, graph break there)
    "eager": (False, frozenset(), False, False),
    "compiled": (True, frozenset(), False, False),
    "compiled, open across the breaks": (True, BREAKS, False, True),
}


def _ring(group, key: str = "test", slots: int = 4, capacity: int = 1 << 16, timeout: float = 30):
    ring, why = shared.open_ring(group, key, slots, capacity, timeout)
    assert ring is not None, why
    return ring


def function(rank: int, world: int, out: Path, delay: float) -> dict:
    """The model-like forward of test_exchange over the ring (eager and compiled) and the ring's code."""
    torch.set_num_threads(1)
    B, D, M = 3, 16, 8
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)[None]
    weights = [w[rank:rank + 1] for w in _modules(world, D, M)]
    sched = schedule(M, world, delay, "sqrt")
    reduce, said = choose(dist.group.WORLD, "test", sched, B * D * 8, 30, collective=lambda: None)
    res = {"said": said, "slots": reduce.ring.slots}
    for name, (compiled, at, settle, breaks) in VARIANTS.items():
        def run(x, at=at, settle=settle, breaks=breaks):
            return _forward(x, weights, Exchange(sched, reduce, world), at, settle, breaks)

        torch._dynamo.reset()
        res[name] = (torch.compile(run, backend="inductor") if compiled else run)(x)
        if name == "compiled":
            from test_exchange import _compiled_code

            res["code"] = _compiled_code("dtpshard.exchange")
            res["ops"] = _ops_per_sum(lambda: torch.compile(run, backend="inductor")(x))
    res["fallbacks"], res["native"] = reduce.ring.fallbacks, reduce.ring.native
    return res


def _ops_per_sum(forward) -> dict[str, list[str]]:
    """What one forward's exchange ops dispatch, profiled: {op: the sorted names of the ops each of its
    calls made} for exchange_start and exchange_value, and "fallbacks": any Python kernel the
    native ones called back (none in a steady decode-like forward on a quiet machine; on a loaded
    one, a wait that outlasts the spin). A Python kernel's own calls are not listed."""
    from torch.profiler import ProfilerActivity, profile

    forward()  # compiled before the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward()
    out: dict[str, list] = {"fallbacks": []}
    for e in prof.events():
        if e.name in ("dtpshard::exchange_start", "dtpshard::exchange_value"):
            inside, todo = [], list(e.cpu_children)
            while todo:
                c = todo.pop()
                inside.append(c.name)
                todo += [] if c.name.endswith("_py") else c.cpu_children
            out.setdefault(e.name.split("::")[1], []).append(sorted(inside))
        elif e.name.startswith("dtpshard::") and e.name.endswith("_py"):
            out["fallbacks"].append(e.name)
    return out


def slow(rank: int, world: int, out: Path, late_ms: float) -> dict:
    """Rank 1 starts `late_ms` late (several modules' worth): rank 0's starts never wait for it, its
    first landing does."""
    ring = _ring(dist.group.WORLD)
    sums, started, waited = [], [], 0.0
    pending = []
    for k in range(1, 9):
        if rank == 1 and k == 1:
            time.sleep(late_ms / 1000)
        t = time.perf_counter()
        pending.append((k, ring.start(torch.full((5,), float(k * (rank + 1))))))
        started.append(time.perf_counter() - t)
        if len(pending) == 3:  # δ = 2: two sums in flight
            k0, seq = pending.pop(0)
            t = time.perf_counter()
            sums.append((k0, ring.value(seq, torch.empty(5)).tolist()))
            waited += time.perf_counter() - t
    for k0, seq in pending:
        sums.append((k0, ring.value(seq, torch.empty(5)).tolist()))
    return {"sums": sums, "start_max": max(started), "waited": waited, "native": ring.native}


def large(rank: int, world: int, out: Path, _: float) -> dict:
    """Messages over a slot (the group's all-reduce) between ring messages, two sums in flight."""
    ring = _ring(dist.group.WORLD, capacity=256)
    sizes = [16, 200, 16, 64, 300, 300, 8]  # floats; 64 fills a slot exactly, 200 and 300 do not fit
    pending, sums = [], []
    for k, n in enumerate(sizes):
        pending.append((n, ring.start(torch.full((n,), float(k * 10 + rank)))))
        if len(pending) == 2:
            n0, seq = pending.pop(0)
            sums.append(ring.value(seq, torch.empty(n0)).unique().tolist())
    sums += [ring.value(seq, torch.empty(n0)).unique().tolist() for n0, seq in pending]
    return {"sums": sums, "fallbacks": ring.fallbacks, "native": ring.native}


def backpressure(rank: int, world: int, out: Path, read_ms: float) -> dict:
    """A 2-slot ring; rank 1 reads `read_ms` late each time: rank 0 must not overwrite unread slots."""
    ring = _ring(dist.group.WORLD, slots=2)
    sums, blocked = [], []
    prev = None
    for k in range(1, 11):
        t = time.perf_counter()
        seq = ring.start(torch.full((64,), float(k * 10 + rank)))
        blocked.append(time.perf_counter() - t)
        if prev is not None:
            if rank == 1:
                time.sleep(read_ms / 1000)
            sums.append(ring.value(prev, torch.empty(64)).unique().tolist())
        prev = seq
    sums.append(ring.value(prev, torch.empty(64)).unique().tolist())
    return {"sums": sums, "blocked": blocked, "native": ring.native}


def lost(rank: int, world: int, out: Path, how: str) -> dict:
    """Rank 1 is killed (SIGKILL), raises, or stops (SIGSTOP: a hang) after 3 sums; rank 0 waits on the 4th."""
    ring = _ring(dist.group.WORLD, timeout=3)
    for _ in range(3):
        ring.value(ring.start(torch.ones(4)), torch.empty(4))
    if rank == 1:
        (out / "pid1").write_text(str(os.getpid()))
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        raise RuntimeError("rank 1 fails")
    time.sleep(0.2)
    t = time.perf_counter()
    try:
        ring.value(ring.start(torch.ones(4)), torch.empty(4))
    except RankFailure as e:
        return {"error": str(e), "after": time.perf_counter() - t, "native": ring.native}
    return {"error": None, "native": ring.native}


def bits(rank: int, world: int, out: Path, _: float) -> dict:
    """Every rank's partials drawn from the same seeds: the ring's sum against torch's sum of the
    stacked rows, in each dtype, for a decode-sized and an odd-sized message."""
    ring = _ring(dist.group.WORLD)
    equal = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for n in (1024, 37):
            rows = [torch.randn(n, generator=torch.Generator().manual_seed(r * 100 + n), dtype=torch.float32)
                    .mul(10 ** (r % 3)).to(dtype) for r in range(world)]
            got = ring.value(ring.start(rows[rank]), rows[rank])
            want = torch.stack(rows).sum(0)
            equal[f"{dtype}/{n}"] = got.dtype == dtype and torch.equal(got, want)
    return {"equal": equal, "native": ring.native}


def wait_forever(rank: int, world: int, out: Path, _: str) -> dict:
    """Both ranks wait on a sum no one sends (for SIGTERM); rank 0 says where its segment was."""
    ring = _ring(dist.group.WORLD, timeout=600)
    (out / f"ready{rank}").write_text(str(os.getpid()))
    ring.value(ring.issued + 5, torch.empty(4))
    return {}


def main(scenario: str, out: str, arg: str = "0") -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    fn = {"function": function, "slow": slow, "backpressure": backpressure, "lost": lost,
          "wait_forever": wait_forever, "large": large, "bits": bits}[scenario]
    res = fn(rank, world, Path(out), float(arg) if scenario != "lost" and scenario != "wait_forever" else arg)
    torch.save(res, Path(out) / f"rank{rank}.pt")
    if scenario == "lost":  # the peer is gone: nothing to end together
        os._exit(0)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
