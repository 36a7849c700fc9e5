"""Reading Inductor's output code for where each sum of partials starts and is waited for
(tests/test_vllm.py on the CPU, bench/cuda_check.py on a GPU): a functional all-reduce and its
wait_tensor (keyed by the buffer reduced), or the shared-memory exchange's custom ops (keyed by
the token exchange_start returns, which exchange_value takes); vLLM's own blocking CPU all-reduce
counts as a sum waited for where it starts."""
from __future__ import annotations

import re

# the GEMM calls a compiled decoder's output code makes: vLLM's CPU kernels, Inductor's extern mm
GEMM = re.compile(r"\.(?:onednn_mm|weight_packed_linear|zentorch_linear_unary|_linear_pointwise|mkl_linear)"
                  r"\.default\(|extern_kernels\.(?:mm|addmm|bmm)\(|aten\.(?:mm|addmm|bmm)\.default\(")
START = re.compile(r"_c10d_functional\.all_reduce_?\.default\((\w+)|(\w+) = torch\.ops\.dtpshard\.exchange_start\.")
BLOCKING = re.compile(r"_C\.shm_allreduce\.default\(")  # vLLM's CPU all-reduce: started and waited in one op
ALIAS = re.compile(r"^\s*(\w+) = (\w+)\s*(?:;|$)")  # Inductor renames an op's result: `buf4 = buf2`
WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\((\w+)|dtpshard\.exchange_value\.default\((\w+)")


def overlaps(code: str) -> list[int]:
    """For each all-reduce started in the code, in order, the GEMMs run between its start and its wait."""
    started: dict[str, int] = {}  # buffer -> GEMMs seen when it started
    gemms, out = 0, []
    for line in code.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if m := START.search(line):
            started[m.group(1) or m.group(2)] = gemms
        elif BLOCKING.search(line):
            out.append(0)
        elif (m := ALIAS.match(line)) and m.group(2) in started:
            started[m.group(1)] = started.pop(m.group(2))
        elif (m := WAIT.search(line)) and (m.group(1) or m.group(2)) in started:
            out.append(gemms - started.pop(m.group(1) or m.group(2)))
        elif GEMM.search(line):
            gemms += 1
    if started:
        raise AssertionError(f"reduces never waited for: {sorted(started)}")
    return out
