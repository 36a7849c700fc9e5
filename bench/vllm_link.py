"""Benchmark harness inside a vLLM rank (tests/vllm_driver.py loads it for bench/bench_vllm.py): an
emulated slower link, and a student with its reduces removed. Nothing here is dtpshard's library.

- `install_latency()`: every all-reduce completes LATENCY seconds after the transfer itself
  (in series, as runtime/ranks.py's Link emulates it). vLLM's own blocking all-reduce (plain TP's
  after every module; the embedding's and the final mean's in every model) sleeps that long after
  it returns (an opaque op, `link_latency`, so compiled graphs keep it). On the shared ring a
  landing waits until LATENCY after the peer published (transport/shared.py); on a collective the
  student's delayed reduces run on a Python process group wrapped around vLLM's gloo TP group, whose work completes
  LATENCY after gloo's: a wait_tensor at the landing waits only for what the compute since the
  start has not covered. The latency is read at each call, so one engine is timed at several
  latencies.
- `remove_reduces()`: the student's module reduces replaced by the own partial (Σ − own = 0):
  the same work without a transfer, a different function: the ceiling DTP can approach. The
  sums that block anyway (the final mean's) keep the student's own path.
- `vllm_on_gloo()`: vLLM's TP communicator without its shared-memory all-reduce, on gloo, as
  vLLM's CPU build runs on a host without AVX-512 (no `init_shm_manager` op): such a host emulated
  on this one, for vLLM's own sums only.
- `plain_sums(kind)`: the sums that block anyway (a plain module's, the final mean's) forced onto
  the ring ("ring") or vLLM's own all-reduce ("engine"), to measure transport/choose.py's
  `blocking_sum` against the other.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

LATENCY = [0.0]  # seconds, set by the driver between timed runs (set_latency)
RINGS: list = []  # the student's shared rings in this process: each keeps its latency in its segment


def set_latency(seconds: float) -> None:
    LATENCY[0] = seconds
    for ring in RINGS:
        ring.latency = seconds


def _sleep_until(t: float) -> None:
    left = t - time.perf_counter()
    if left > 0:
        time.sleep(left)


class _DelayedWork(dist.Work):
    def __init__(self, inner: dist.Work):
        super().__init__()
        self.inner, self.done = inner, [0.0]
        inner.get_future().add_done_callback(lambda _: self.done.__setitem__(0, time.perf_counter()))

    def wait(self, timeout=None) -> bool:  # c10d's signature
        self.inner.wait()
        if LATENCY[0] > 0:
            _sleep_until((self.done[0] or time.perf_counter()) + LATENCY[0])
        return True

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def get_future(self) -> torch.futures.Future:
        return self.inner.get_future()


class _DelayedGroup(dist.ProcessGroup):
    """A Python process group over `inner` whose all-reduces complete LATENCY late."""

    def __init__(self, inner: dist.ProcessGroup):
        super().__init__(inner.rank(), inner.size())
        self.inner = inner

    def allreduce(self, tensors, opts=None):  # c10d's signature
        return _DelayedWork(self.inner.allreduce(tensors, dist.AllreduceOptions() if opts is None else opts))

    def getBackendName(self) -> str:  # c10d's name
        return "delayed-gloo"


@torch.library.custom_op("dtpbench::link_latency", mutates_args=("x",))
def link_latency(x: torch.Tensor) -> None:
    """Sleep LATENCY after a blocking all-reduce that produced x. An opaque op: Dynamo traces
    through vLLM's CPU all-reduce into the graph, and vLLM drops Dynamo's guards, so a sleep written
    in Python there would be kept or left out by the latency at compile time; an op declared to
    mutate x stays in the graph, in order, and reads LATENCY when it runs."""
    if LATENCY[0] > 0:
        time.sleep(LATENCY[0])


def install_latency() -> None:
    from torch._C._distributed_c10d import _register_process_group
    from vllm.distributed import get_tp_group
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    import dtpshard.serve.vllm_model as vm

    blocking = CpuCommunicator.all_reduce

    def all_reduce(self, input_):
        out = blocking(self, input_)
        torch.ops.dtpbench.link_latency(out)
        return out

    CpuCommunicator.all_reduce = all_reduce
    made: dict[str, _DelayedGroup] = {}  # c10d's registry holds a group weakly: this keeps it alive
    chosen = vm.tp_reduce

    def tp_reduce(*args):
        reduce = chosen(*args)
        if reduce.transport != "collective":  # the shared ring: its latency is set with the others'
            reduce.ring.latency = LATENCY[0]
            RINGS.append(reduce.ring)
            return reduce
        inner = get_tp_group().device_group
        name = f"{inner.group_name}-delayed"
        if name not in made:
            made[name] = _DelayedGroup(inner)
            _register_process_group(name, made[name])
        reduce.group_name = name
        return reduce

    vm.tp_reduce = tp_reduce


class _NoReduce:
    def start(self, p: torch.Tensor) -> torch.Tensor:
        return p

    def value(self, handle: torch.Tensor) -> torch.Tensor:
        return handle


def remove_reduces() -> None:
    import dtpshard.serve.vllm_model as vm

    class NoReduce(_NoReduce, vm.TPReduce):
        transport = "none"

    chosen = vm.tp_reduce

    def tp_reduce(*args):
        own = chosen(*args)  # its blocking path (the final mean's) stays; its ring, if any, stays open for it
        reduce = NoReduce("")
        reduce.total, reduce.own = own.total, own
        reduce.said = "nothing (the module sums removed); " + own.said.rpartition("; ")[2]
        return reduce

    vm.tp_reduce = tp_reduce


def vllm_on_gloo() -> None:
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    # vLLM then takes torch.distributed (gloo) for its own sums (the embedding's, TP's)
    CpuCommunicator._all_group_ranks_share_shm_group_name = lambda self: False


def plain_sums(kind: str) -> None:
    import dtpshard.serve.vllm_model as vm

    chosen = vm.tp_reduce

    def tp_reduce(*args):
        reduce = chosen(*args)
        if kind == "ring" and hasattr(reduce, "now"):
            reduce.total, path = reduce.now, "the ring (--plain ring)"
        else:  # asked for, or no ring to take them (the partials on the collective)
            reduce.total, path = vm.tensor_model_parallel_all_reduce, f"the engine's own all-reduce (--plain {kind})"
        head = reduce.said.rpartition("; ")[0]
        reduce.said = f"{head}; the sums that block (plain modules', the final mean's) over {path}"
        return reduce

    vm.tp_reduce = tp_reduce
