"""`dtpshard generate` (the L devices simulated in one process) and `dtpshard run` (one process
per device), over model/generate.py and runtime/run.py."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from cyclopts import Parameter

from dtpshard.core.devices import pick_device
from dtpshard.core.errors import UserError
from dtpshard.core.io import dumps
from dtpshard.core.settings import NO_FLAGS, DTPFlags
from dtpshard.core.vocab import Count, Device, DType, LoadDType, NonNegativeInt, NonNegativeNumber, Seconds, Seed, TopP


def generate_cmd(model: Path, *, prompt: str, dtp: Annotated[DTPFlags, Parameter(name="*")] = NO_FLAGS,
                 layout: Path | None = None, max_new_tokens: Count = 40, temperature: NonNegativeNumber = 0.0,
                 top_k: NonNegativeInt = 0, top_p: TopP = 1.0, seed: Seed = 0, dtype: LoadDType = "auto",
                 device: Device = "auto", tokenizer: Path | None = None, compile: bool = False,
                 json: bool = False) -> int:
    """Print a continuation of PROMPT from the DTP form of MODEL (greedy unless --temperature > 0).
    The same tokens as `DTPModel.from_pretrained(MODEL).generate(ids, max_new_tokens, do_sample=
    temperature > 0, temperature=..., top_k=..., top_p=..., seed=...)`.

    Args:
        model: Hugging Face checkpoint directory (or a distilled student's directory)
        prompt: the text to continue
        layout: a layout JSON to apply before sharding
        max_new_tokens: how many tokens to generate
        temperature: 0 for greedy decoding, else the sampling temperature
        top_k: sample only among the k most likely tokens (0: all)
        top_p: sample only from the smallest set of tokens whose probability reaches p (1: all)
        seed: sampling seed
        dtype: weights and activations; auto keeps the checkpoint's (as transformers)
        tokenizer: tokenizer directory, where MODEL has no tokenizer files
        compile: torch.compile the model's forward (pays a compile, then decodes faster on long runs)
        json: print one JSON object {text, completion, new_token_ids, ...} instead of the text
    """
    from dtpshard.model.generate import generate_text

    out = generate_text(model, prompt, dtp, layout=layout, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_k=top_k, top_p=top_p, seed=seed, dtype=dtype, device=pick_device(device),
                        tokenizer=tokenizer, compile=compile)
    print(dumps(out) if json else out["text"])
    return 0


def run_cmd(model: Path, *, prompt: str, dtp: Annotated[DTPFlags, Parameter(name="*")] = NO_FLAGS,
            layout: Path | None = None, max_new_tokens: Count = 40, timeout: Seconds = 600,
            latency_ms: NonNegativeNumber = 0, dtype: DType = "float32", device: Device = "auto", nproc: Count = 1,
            threads: NonNegativeInt = 0, tokenizer: Path | None = None, json: bool = False,
            cuda_graphs: bool = False) -> int:
    """Greedy continuation of PROMPT with MODEL run as DTP across processes, one rank per device
    (start it with torchrun --nproc-per-node L, or pass --nproc L; --devices, if given, must be
    that L). Rank 0 prints the text.

    Args:
        model: Hugging Face checkpoint directory (the world size L must divide its KV groups and neurons)
        prompt: the text to continue
        layout: a layout JSON made for L devices, applied while each rank reads its slices
        max_new_tokens: how many tokens to generate
        timeout: seconds to wait for the ranks to join and for any one transfer before giving up
        latency_ms: extra latency per transfer, emulating a slower link
        dtype: weights and activations
        device: auto (cuda if available, else cpu), cpu (gloo) or cuda (NCCL, one GPU per rank: cuda:LOCAL_RANK)
        nproc: spawn this many local ranks; 1: this process is one rank of a torchrun
        threads: torch threads per rank (0: the cores divided by the local ranks, less two for the transfers)
        tokenizer: tokenizer directory, where MODEL has no tokenizer files
        json: rank 0 prints one JSON object {text, completion, new_token_ids, ...} instead of the text
        cuda_graphs: decode each token as one CUDA-graph replay (device cuda; runtime/graphs.py)
    """
    from dtpshard.core.launch import check_threads, world_from_env
    from dtpshard.runtime.run import plan_run, run

    check_threads(threads)  # before any rank starts
    if nproc > 1 and "RANK" in os.environ:
        raise UserError(f"--nproc {nproc} under torchrun: torchrun has started the ranks already; drop --nproc")
    world = nproc if nproc > 1 else world_from_env()[1]
    if dtp.devices is not None and dtp.devices != world:
        raise UserError(f"--devices {dtp.devices}: the run has {world} rank(s), one per device (--nproc or torchrun)")
    job = plan_run(model, prompt, world, delay=dtp.delay, stage3=dtp.stage3, layout=layout,
                   max_new_tokens=max_new_tokens, timeout=timeout, latency_ms=latency_ms, dtype=dtype, device=device,
                   threads=threads, tokenizer=tokenizer, json=json, cuda_graphs=cuda_graphs)
    return run(job, nproc)
