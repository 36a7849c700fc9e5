"""Inside a vLLM rank (tests/vllm_driver.py, harness "piecewise"): the compiled student split as the
GPU's piecewise CUDA graphs would split it, on a CPU.

vLLM's CPU platform compiles the forward as one graph, so the split never runs here. This harness
builds the student as for piecewise graphs (serve/vllm_model.py settles before attention when
`split_at_attention` says so), takes Dynamo's graph of its forward in place of the compile
backend, splits a copy with vLLM's own `split_graph` at the GPU's default splitting ops (its
attention ops), and reads each piece: every sum started in a piece must be waited for in that
piece, and no started sum may be a piece's output (a capture boundary between a collective and
its wait is pytorch/pytorch#192000's crash). The graph itself then runs uncompiled.
"""
from __future__ import annotations

import copy

REPORT: dict = {}
STARTS = ("_c10d_functional.all_reduce", "dtpshard.exchange_start")
WAITS = ("_c10d_functional.wait_tensor", "dtpshard.exchange_value")


def _is(node, names: tuple[str, ...]) -> bool:
    return node.op == "call_function" and any(n in str(node.target) for n in names)


def read(items) -> dict:
    """Per piece of split_graph's items: the sums started, and those waited elsewhere or output."""
    pieces = [i for i in items if not i.is_splitting_graph]
    crossing, outputs, started = [], [], 0
    for item in pieces:
        nodes = list(item.graph.graph.nodes)
        waited = {n.args[0] for n in nodes if _is(n, WAITS)}
        out = nodes[-1].args[0] if nodes and nodes[-1].op == "output" else ()
        out = set(out) if isinstance(out, (tuple, list)) else {out}
        for n in nodes:
            if _is(n, STARTS):
                started += 1
                if n not in waited:
                    crossing.append(f"{item.submod_name}:{n.name}")
                if n in out:
                    outputs.append(f"{item.submod_name}:{n.name}")
    return {"pieces": len(pieces), "splits": len(items) - len(pieces), "started": started,
            "crossing": crossing, "outputs": outputs}


def capture(gm, example_inputs):
    from vllm.compilation.backends import split_graph
    from vllm.config import CompilationConfig

    _, items = split_graph(copy.deepcopy(gm), list(CompilationConfig._attention_ops))
    REPORT.update(read(items))
    return gm


def install() -> None:
    from vllm.config import CompilationConfig

    import dtpshard.serve.vllm_model as vm

    vm.split_at_attention = lambda *args: True
    CompilationConfig.init_backend = lambda self, *args, **kwargs: capture
