"""bench/bench_vllm.py's rows of partial students: each share's row carries that student's own
numbers (speed, ratio, transport, the model's share of a step), never the full student's."""
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_vllm.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_vllm", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_partial_rows_carry_their_own_numbers():
    bench = _bench()
    arm = bench.delayed_arm(0.5)
    row = {"tp": 2, "batch": 1, "latency_ms": 0.5, "executor": "external", "rounds": 3,
           "tp_tok_s": 10.0, "tp_transport": "ring", "tp_model_share": 0.5,
           "dtp_tok_s": 12.0, "dtp_per_tp": 1.2, "dtp_per_tp_range": [1.1, 1.3], "dtp_transport": "ring",
           "dtp_model_share": 0.9,
           f"{arm}_tok_s": 11.0, f"{arm}_per_tp": 1.1, f"{arm}_per_tp_range": [1.0, 1.2],
           f"{arm}_transport": "ring and vLLM's all-reduce", f"{arm}_model_share": 0.7}
    full, half = bench.delayed_rows([row], [0.5])
    assert full["delayed"] == 1.0 and full["dtp_tok_s"] == 12.0 and full["dtp_model_share"] == 0.9
    assert not any(k.startswith(arm) for k in full)
    assert half["delayed"] == 0.5 and half["dtp_tok_s"] == 11.0 and half["dtp_per_tp"] == 1.1
    assert half["dtp_model_share"] == 0.7 and half["dtp_transport"] == "ring and vLLM's all-reduce"
    assert half["tp_tok_s"] == 10.0  # the baseline of the same rounds
    assert "| 90% |" in bench.table([full]) and "| 70% |" in bench.table([half])


def test_rows_against_tp_over_the_ring():
    """Every DTP arm's ratio to TP over the ring (the same transport, every sum blocking) travels with
    its row, a partial student's its own; the table gives it beside the ratio to TP as vLLM runs it
    and names each arm's transport."""
    bench = _bench()
    arm = bench.delayed_arm(0.5)
    row = {"tp": 2, "batch": 8, "latency_ms": 0.0, "executor": "external", "rounds": 2,
           "tp_tok_s": 10.0, "tp_transport": "vLLM's CpuCommunicator (gloo)", "tp_model_share": 0.5,
           "tp_ring_tok_s": 16.0, "tp_ring_per_tp": 1.6, "tp_ring_per_tp_range": [1.5, 1.7],
           "tp_ring_transport": "shared memory (one-sided ring)", "tp_ring_model_share": 0.8,
           "nocomm_tok_s": 20.0, "nocomm_per_tp": 2.0, "nocomm_per_tp_range": [2.0, 2.0],
           "nocomm_transport": "nothing", "nocomm_model_share": 1.0,
           "dtp_tok_s": 19.0, "dtp_per_tp": 1.9, "dtp_per_tp_range": [1.8, 2.0], "dtp_per_tp_ring": 1.19,
           "dtp_per_tp_ring_range": [1.1, 1.3], "dtp_transport": "shared memory (one-sided ring)",
           "dtp_model_share": 0.9,
           f"{arm}_tok_s": 17.0, f"{arm}_per_tp": 1.7, f"{arm}_per_tp_range": [1.6, 1.8],
           f"{arm}_per_tp_ring": 1.06, f"{arm}_per_tp_ring_range": [1.0, 1.1],
           f"{arm}_transport": "ring", f"{arm}_model_share": 0.85}
    full, half = bench.delayed_rows([row], [0.5])
    assert full["dtp_per_tp_ring"] == 1.19 and half["dtp_per_tp_ring"] == 1.06
    assert half["tp_ring_tok_s"] == 16.0  # the baseline of the same rounds
    text = bench.table([full])
    head, _, cells = text.splitlines()[:3]
    assert "TP over the ring tok/s" in head and "DTP / TP over the ring" in head
    assert "| 1.190× (1.100–1.300) |" in cells and "| 90% |" in cells  # (19 − 10) / (20 − 10)
    assert "- TP over the ring: shared memory (one-sided ring)" in text
    assert "- TP: vLLM's CpuCommunicator (gloo)" in text
