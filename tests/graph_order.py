"""Reading Inductor's output code for where each functional all-reduce starts and is waited for
(tests/test_vllm.py on the CPU, bench/cuda_check.py on a GPU)."""
from __future__ import annotations

import re

# the GEMM calls a compiled decoder's output code makes: vLLM's CPU kernels, Inductor's extern mm
GEMM = re.compile(r"\.(?:onednn_mm|weight_packed_linear|zentorch_linear_unary|_linear_pointwise|mkl_linear)"
                  r"\.default\(|extern_kernels\.(?:mm|addmm|bmm)\(|aten\.(?:mm|addmm|bmm)\.default\(")
START = re.compile(r"_c10d_functional\.all_reduce_?\.default\((\w+)")
WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\((\w+)")


def overlaps(code: str) -> list[int]:
    """For each all-reduce started in the code, in order, the GEMMs run between its start and its wait."""
    started: dict[str, int] = {}  # buffer -> GEMMs seen when it started
    gemms, out = 0, []
    for line in code.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if m := START.search(line):
            started[m.group(1)] = gemms
        elif (m := WAIT.search(line)) and m.group(1) in started:
            out.append(gemms - started.pop(m.group(1)))
        elif GEMM.search(line):
            gemms += 1
    if started:
        raise AssertionError(f"reduces never waited for: {sorted(started)}")
    return out
