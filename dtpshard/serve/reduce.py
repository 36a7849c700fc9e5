"""The Reduce (model/exchange.py) a vLLM rank moves its partials with: torch's functional collectives.

`start` issues `_c10d_functional.all_reduce` on a process group and returns its output unwaited;
`value` is `_c10d_functional.wait_tensor` on it. Eagerly the all-reduce runs on the backend's
own thread (gloo) or stream (NCCL) while the rank computes on; under torch.compile the two are
separate graph nodes that the exchange places δ modules apart, and Inductor keeps them there
(tests/test_vllm_graph.py reads the compiled code to hold it to that).

The raw ops, not `_functional_collectives.all_reduce`: while Dynamo traces, that wrapper returns
`wait_tensor(all_reduce(...))`, a wait right behind its collective, and the overlap would rest on
a compiler pass moving it (pytorch/pytorch#174280 reports Inductor moving a wait next to its
collective instead).

The group is vLLM's TP device group: NCCL on CUDA, gloo on a CPU. On one CPU host the student's
partials take the shared-memory ring instead (transport/shared.py; transport/choose.py decides);
this Reduce is the CUDA path and the fallback. No vLLM import here: the two-process tests run it
on a plain gloo group.
"""
from __future__ import annotations

import torch


class FunctionalReduce:
    """Σ over the ranks of the process group registered as `group_name`, started now, taken later."""

    def __init__(self, group_name: str):
        self.group_name = group_name

    def start(self, p: torch.Tensor) -> torch.Tensor:
        return torch.ops._c10d_functional.all_reduce(p, "sum", self.group_name)

    def value(self, handle: torch.Tensor) -> torch.Tensor:
        return torch.ops._c10d_functional.wait_tensor(handle)
