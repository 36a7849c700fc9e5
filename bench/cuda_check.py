"""One prepared script for a GPU machine: check and time the CUDA path.

1. Exactness on CUDA (fp32): DTPModel at δ = 0 against transformers on the GPU, δ = 1 against
   the CPU result, KV-cache decoding against the full forward.
2. bf16: DTPModel in bf16 and under autocast runs and stays close to fp32.
3. Throughput and peak memory, forward+backward, bf16 autocast: DTPModel (L = 4, δ = 1) against
   transformers' dense Qwen3 (same weights and tokens), Qwen3-0.6B widths, 4 layers, full vocab.
4. A short distillation on CUDA (bf16 autocast), resumable run directory and all.
5. Compiled DTP (model/compiled.py): compiled == eager in fp32; compiled DTP (L = 4, δ = 1) and
   compiled dense throughput under bf16 autocast (targets: ≥ 1.0× eager dense, ≥ 0.95× compiled dense).
6. The teacher cache on CUDA: built, then a short distillation reading it (`--teacher-cache`).
7. CUDA-graph decoding with NCCL (runtime/graphs.py): equal to eager decoding (1 rank, or 2 with
   two GPUs), and ms/token eager vs graph replay.
8. The exchange (model/exchange.py) with vLLM's Reduce (serve/reduce.py: functional collectives) on
   a ONE-rank NCCL group, so one GPU shows whether the serving design holds: eager; compiled
   whole; compiled with CUDA graphs (mode="reduce-overhead") whole, where sums stay open across
   modules; and with a graph break between modules, every pending sum waited for before the
   break (what serve/vllm_model.py does under piecewise CUDA graphs). Each equals the eager
   result; Inductor's code keeps each wait a module after its all-reduce. For the record, the
   pattern that pytorch/pytorch#192000 reports as crashing (a sum left open across a break under
   CUDA graphs) runs in a child process and is reported, not judged.
9. vLLM (where `import vllm` works: its CUDA build with dtpshard installed beside it): a DTP student
   against plain TP on the same weights (bench/bench_vllm.py), TP 2, 4 and 8 as the GPUs allow,
   batch 1 and 8, compiled with CUDA graphs (vLLM's default), bf16; the ratio is DTP / TP throughput.
   Sections 8 and 9 are the ones that need no second GPU besides 9's TP ≥ 2 rows.
10. vLLM at TP 1 (`vllm-tp1`, one GPU): a student served with CUDA graphs and with
   --enforce-eager (vLLM still builds a one-rank NCCL group): the same tokens, dtpshard's own.
11. The symmetric-memory exchange (`symmetric`, transport/symmetric.py) on every GPU here, eager
   and captured in a CUDA graph, against the functional collectives (one GPU: a one-rank group,
   which checks the API and capture but moves nothing).

    PYTHONPATH=. python bench/cuda_check.py              # every section
    PYTHONPATH=. python bench/cuda_check.py exchange     # only the named sections
    PYTHONPATH=. python bench/cuda_check.py exchange vllm-tp1 symmetric   # the one-GPU checks of the transport
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_transport import check, exchange, symmetric, vllm_one_gpu  # noqa: E402


def exactness() -> bool:
    from dtpshard.model.dtp import DTPModel
    from tiny import tiny_hf_model

    ok = True
    for fam in ("qwen3", "qwen2", "llama_tied"):
        hf = tiny_hf_model(fam)
        ids = torch.randint(0, 384, (2, 33))
        ref = hf.cuda()(ids.cuda()).logits
        m0 = DTPModel.from_hf(hf, devices=4, delay=0).cuda()
        d = (m0(ids.cuda()).logits - ref).abs().max().item()
        ok &= check(f"{fam} δ=0 vs transformers (cuda fp32)", d <= 1e-4, f"{d:.2e}")
        hf = hf.cpu()
        cpu = DTPModel.from_hf(hf, devices=4, delay=1)(ids).logits
        gpu = DTPModel.from_hf(hf, devices=4, delay=1).cuda()
        d = (gpu(ids.cuda()).logits.cpu() - cpu).abs().max().item()
        ok &= check(f"{fam} δ=1 cuda vs cpu (fp32)", d <= 1e-4, f"{d:.2e}")
        cache = gpu.new_cache()
        full = gpu(ids.cuda()).logits
        parts = [gpu(ids[:, :20].cuda(), cache=cache).logits]
        parts += [gpu(ids[:, t:t + 1].cuda(), cache=cache).logits for t in range(20, 33)]
        d = (torch.cat(parts, 1) - full).abs().max().item()
        ok &= check(f"{fam} KV-cache decode vs full (cuda)", d <= 1e-4, f"{d:.2e}")
        b16 = DTPModel.from_hf(hf, devices=4, delay=1, dtype=torch.bfloat16).cuda()
        d = (b16(ids.cuda()).logits.float().cpu() - cpu).abs().max().item()
        ok &= check(f"{fam} bf16 vs fp32", d < 0.1 * cpu.abs().max().item(),
                    f"{d:.3f} (max |logit| {cpu.abs().max():.2f})")
    return ok


def throughput() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dtpshard.model.dtp import DTPModel

    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(cfg).cuda()
    ids = torch.randint(0, cfg.vocab_size, (8, 1024), device="cuda")
    rows = []
    for name, model in (("transformers dense", hf), ("DTP L=4 δ=1", DTPModel.from_hf(hf, devices=4, delay=1).cuda())):
        model.train()

        def step(model=model):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(ids)
                logits = out.logits if hasattr(out, "logits") else out
                loss = logits.float().logsumexp(-1).mean()
            loss.backward()

        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / 5
        rows.append((name, ids.numel() / dt, torch.cuda.max_memory_allocated() / 2**30))
        model.zero_grad(set_to_none=True)
    base = rows[0]
    print("fwd+bwd, bf16 autocast, Qwen3-0.6B widths, 4 layers, vocab 151936, 8x1024 tokens")
    print(f"{'model':20} {'tok/s':>9} {'ratio':>6} {'peak GiB':>9} {'ratio':>6}")
    for n, tps, mem in rows:
        print(f"{n:20} {tps:9.0f} {tps / base[1]:6.2f} {mem:9.2f} {mem / base[2]:6.2f}")


def distillation() -> bool:
    from dtpshard.core.layout import Layout
    from dtpshard.model.dtp import DTPModel
    from dtpshard.training.distill import DistillConfig, distill
    from tiny import save_tiny

    with tempfile.TemporaryDirectory() as tmp:
        teacher = save_tiny(Path(tmp) / "teacher", "qwen3")
        layout = Layout.random(DTPModel.from_pretrained(teacher).shape, 4, 1, seed=0)
        layout.save(Path(tmp) / "layout.json")
        t = time.perf_counter()
        run = distill(DistillConfig(teacher=teacher, out=Path(tmp) / "run", layout=Path(tmp) / "layout.json",
                                    steps=30, seq_len=64, micro_batch=4, grad_accum=2, lr=3e-3, warmup=3,
                                    eval_every=10, eval_blocks=4, device="cuda", progress=False))
        import json

        evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in evals if r["kind"] == "eval"]
        return check("distillation on cuda (bf16 autocast)", evals[-1]["eval_kl"] < evals[0]["eval_kl"],
                     f"eval KL {evals[0]['eval_kl']:.4f} -> {evals[-1]['eval_kl']:.4f} in "
                     f"{time.perf_counter() - t:.1f} s")


def compiled() -> bool:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dtpshard.model.compiled import compile_module
    from dtpshard.model.dtp import DTPModel
    from dtpshard.training.recipe import Teacher  # a model's LM-head input as a module's forward
    from tiny import tiny_hf_model

    m = DTPModel.from_hf(tiny_hf_model("qwen3"), devices=4, delay=1).cuda()
    ids = torch.randint(0, 384, (2, 33), device="cuda")
    d = (compile_module(Teacher(m))(ids) - Teacher(m)(ids)).abs().max().item()
    ok = check("compiled DTP == eager (cuda fp32)", d <= 1e-4, f"{d:.2e}")
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(cfg).cuda().train()
    dtp = DTPModel.from_hf(hf, devices=4, delay=1).cuda().train()
    ids = torch.randint(0, cfg.vocab_size, (8, 1024), device="cuda")
    arms = {"transformers dense": hf, "DTP L=4 δ=1": dtp, "dense compiled": compile_module(hf),
            "DTP L=4 δ=1 compiled": compile_module(dtp)}
    tps = {}
    for name, model in arms.items():
        def step(model=model):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(ids)
                loss = (out.logits if hasattr(out, "logits") else out).float().logsumexp(-1).mean()
            loss.backward()

        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        tps[name] = ids.numel() * 5 / (time.perf_counter() - t)
        print(f"{name:22} {tps[name]:9.0f} tok/s  (first step {first:.1f} s)", flush=True)
    r1 = tps["DTP L=4 δ=1 compiled"] / tps["transformers dense"]
    r2 = tps["DTP L=4 δ=1 compiled"] / tps["dense compiled"]
    print(f"compiled DTP / eager dense {r1:.2f} (target >= 1.0); compiled DTP / compiled dense {r2:.2f} "
          f"(target >= 0.95)")
    return ok


def teacher_cache() -> bool:
    import json

    from dtpshard.training.distill import DistillConfig, distill
    from dtpshard.training.teacher_cache import build_cache, cache_blocks
    from tiny import save_tiny

    with tempfile.TemporaryDirectory() as tmp:
        teacher = save_tiny(Path(tmp) / "teacher", "qwen3")
        recipe = dict(steps=20, seq_len=64, micro_batch=4, grad_accum=2)
        blocks = cache_blocks(teacher, [0], recipe["steps"], recipe["seq_len"], recipe["micro_batch"],
                              recipe["grad_accum"], 1, None, None)
        cache = build_cache(teacher, blocks, Path(tmp) / "cache", 64, device="cuda", progress=False)
        run = distill(DistillConfig(teacher=teacher, out=Path(tmp) / "run", teacher_cache=cache, lr=3e-3, warmup=3,
                                    eval_every=10, eval_blocks=4, device="cuda", progress=False, **recipe))
        evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in evals if r["kind"] == "eval"]
        return check("cached-teacher distillation on cuda", evals[-1]["eval_kl"] < evals[0]["eval_kl"],
                     f"eval KL {evals[0]['eval_kl']:.4f} -> {evals[-1]['eval_kl']:.4f}")


def _graph_timing(model_dir: str, out: str) -> int:
    from dtpshard.core.launch import process_group
    from dtpshard.core.settings import resolve_dtp
    from dtpshard.runtime.graphs import GraphDecoder
    from dtpshard.runtime.ranks import RankModel, check_world

    with process_group(timeout=300, backend="nccl") as (rank, world):
        ckpt, _ = check_world(model_dir, world)
        net = RankModel(ckpt, rank, resolve_dtp(ckpt.shape, devices=world, delay=1), timeout=300, device="cuda")
        prompt = torch.randint(0, ckpt.shape.vocab, (1, 128), device="cuda")
        res = {}
        for name, dec in (("eager", net), ("graph", GraphDecoder(net, 1, 512)), ("eager ", net),
                          ("graph ", GraphDecoder(net, 1, 512))):
            cache = dec.new_cache()
            nxt = dec(prompt, cache)[:, -1:].argmax(-1)
            for _ in range(3):
                nxt = dec(nxt, cache)[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(64):
                nxt = dec(nxt, cache)[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            res[name.strip()] = (time.perf_counter() - t) / 64 * 1000
        if rank == 0:
            Path(out).write_text(f"{res['eager']:.3f} {res['graph']:.3f}")
    return 0


def cuda_graphs() -> bool:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dtpshard.core.launch import launch_local
    from test_graphs import _check

    world = 2 if torch.cuda.device_count() >= 2 else 1
    with tempfile.TemporaryDirectory() as tmp:
        try:
            _check(world, "nccl", Path(tmp))
            ok = check(f"CUDA-graph decode == eager ({world} NCCL rank(s), δ = 0, 1, 2)", True, "max diff <= 1e-4")
        except AssertionError as e:
            ok = check(f"CUDA-graph decode == eager ({world} NCCL rank(s))", False, str(e)[:200])
        cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
                          num_key_value_heads=8, head_dim=128, vocab_size=8192, tie_word_embeddings=True)
        torch.manual_seed(0)
        Qwen3ForCausalLM(cfg).save_pretrained(f"{tmp}/m")
        exits = launch_local(world, _graph_timing, (f"{tmp}/m", f"{tmp}/t.txt"), grace=60)
        if any(e.code for e in exits):
            return check("CUDA-graph decode timing", False, f"ranks exited {[e.code for e in exits]}")
        eager, graph = map(float, Path(f"{tmp}/t.txt").read_text().split())
        print(f"decode ms/token, {world} rank(s), δ=1, Qwen3-0.6B widths 4 layers: eager {eager:.2f}, "
              f"CUDA graph {graph:.2f} ({graph / eager:.2f}x)")
    return ok


def vllm_pair() -> bool:
    import importlib.util
    import os

    if importlib.util.find_spec("vllm") is None:
        print("SKIP  vLLM DTP vs TP: vllm is not installed here (pip install vllm, then this checkout)")
        return True
    from bench_vllm import make_pair, measure, table

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in (t for t in (2, 4, 8) if t <= torch.cuda.device_count()):
            pair = make_pair(Path(tmp) / f"tp{tp}", tp, dtype="bfloat16")
            rows += measure(Path(sys.executable), pair, tp, [1, 8], [0], 65, 3, dtype="bfloat16", env=env)
    print(table(rows))
    if not rows:
        print("SKIP  vLLM DTP vs TP: needs at least 2 GPUs (TP ≥ 2)")
    return check("vLLM DTP vs TP ran", bool(rows), f"{len(rows)} rows") if rows else True


SECTIONS = {"exactness": exactness, "throughput": lambda: throughput() or True, "distillation": distillation,
            "compiled": compiled, "teacher-cache": teacher_cache, "cuda-graphs": cuda_graphs, "exchange": exchange,
            "vllm": vllm_pair, "vllm-tp1": vllm_one_gpu, "symmetric": symmetric}


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("bench/cuda_check.py needs a CUDA device: torch.cuda.is_available() is False here")
    chosen = sys.argv[1:] or list(SECTIONS)
    unknown = [c for c in chosen if c not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown section {unknown[0]!r}: one of {', '.join(SECTIONS)}")
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    ok = True
    for name in chosen:
        ok &= bool(SECTIONS[name]())
    sys.exit(0 if ok else 1)
