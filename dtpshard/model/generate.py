"""Greedy or sampled decoding with the DTP model's KV cache, and `dtpshard generate`."""
from __future__ import annotations

from pathlib import Path
import torch

from dtpshard.core.devices import DTYPES, pick_device
from dtpshard.core.errors import UserError
from dtpshard.core.vocab import Count, Delay, Device, DType, NonNegativeInt, NonNegativeNumber, Seed, Stage3


@torch.no_grad()
def generate_ids(model: torch.nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, seed: int = 0, eos_id: int | None = None) -> torch.Tensor:
    """prompt_ids [B, T] -> [B, T + new]. Prefill once, then one token at a time from the cache."""
    g = torch.Generator(device=prompt_ids.device).manual_seed(seed)
    cache = model.new_cache()
    ids = prompt_ids
    logits = model(prompt_ids, cache=cache, logits_to_keep=1)[:, -1]
    for _ in range(max_new_tokens):
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            scores = logits.float() / temperature
            if top_k > 0:
                kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            nxt = torch.multinomial(scores.softmax(-1), 1, generator=g)
        ids = torch.cat([ids, nxt], dim=1)
        if eos_id is not None and bool((nxt == eos_id).all()):
            break
        logits = model(nxt, cache=cache, logits_to_keep=1)[:, -1]
    return ids


def generate_cmd(model: Path, *, prompt: str, devices: Count | None = None, delay: Delay | None = None,
                 layout: Path | None = None, max_new_tokens: Count = 40, temperature: NonNegativeNumber = 0.0,
                 top_k: NonNegativeInt = 0, seed: Seed = 0, stage3: Stage3 | None = None, dtype: DType = "float32",
                 device: Device = "auto") -> int:
    """Print a continuation of PROMPT from the DTP form of MODEL (greedy unless --temperature > 0).

    Args:
        model: Hugging Face checkpoint directory (or a distilled student's directory)
        prompt: the text to continue
        devices: L, the number of (simulated) devices; default from the checkpoint's dtp.json, else 4
        delay: δ, in modules (fractional allowed); 0 is tensor parallelism; default dtp.json, else 1
        layout: a layout JSON to apply before sharding
        max_new_tokens: how many tokens to generate
        temperature: 0 for greedy decoding, else the sampling temperature
        top_k: sample only among the k most likely tokens (0: all)
        seed: sampling seed
        stage3: own-partial scale for the last δ modules: sqrt (√L, the paper's) or one
        dtype: weights and activations
        device: auto (cuda if available, else cpu), cpu, cuda or cuda:N
    """
    from dtpshard.model.checkpoint import load_tokenizer
    from dtpshard.model.dtp import DTPModel

    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens}: must be at least 1")
    dev = pick_device(device)
    net = DTPModel.from_pretrained(model, devices, delay, dtype=DTYPES[dtype], layout=layout, stage3=stage3,
                                   device=dev).eval()
    tok = load_tokenizer(model)
    ids = tok(prompt, return_tensors="pt").input_ids.to(dev)
    if ids.shape[1] == 0:
        raise UserError("the prompt encodes to no tokens")
    out = generate_ids(net, ids, max_new_tokens, temperature, top_k, seed, tok.eos_token_id)
    print(prompt + tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return 0
