"""`dtpshard generate`: a continuation of a prompt from the DTP model (decoding is in decode.py)."""
from __future__ import annotations

from pathlib import Path

from dtpshard.core.devices import pick_device
from dtpshard.core.errors import UserError
from dtpshard.core.io import dumps
from dtpshard.core.shape import check_context
from dtpshard.core.vocab import Count, Delay, Device, LoadDType, NonNegativeInt, NonNegativeNumber, Seed, Stage3, TopP
from dtpshard.model.checkpoint import check_token_ids
from dtpshard.model.dtp import DTPModel


def generate_cmd(model: Path, *, prompt: str, devices: Count | None = None, delay: Delay | None = None,
                 layout: Path | None = None, max_new_tokens: Count = 40, temperature: NonNegativeNumber = 0.0,
                 top_k: NonNegativeInt = 0, top_p: TopP = 1.0, seed: Seed = 0, stage3: Stage3 | None = None,
                 dtype: LoadDType = "auto", device: Device = "auto", tokenizer: Path | None = None,
                 compile: bool = False, json: bool = False) -> int:
    """Print a continuation of PROMPT from the DTP form of MODEL (greedy unless --temperature > 0).
    The same tokens as `DTPModel.from_pretrained(MODEL).generate(ids, max_new_tokens, do_sample=
    temperature > 0, temperature=..., top_k=..., top_p=..., seed=...)`.

    Args:
        model: Hugging Face checkpoint directory (or a distilled student's directory)
        prompt: the text to continue
        devices: L, the number of (simulated) devices; default from the student's recorded settings, else 4
        delay: δ, in modules (fractional allowed); 0 is tensor parallelism; default the student's, else 1
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
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens}: must be at least 1")
    if temperature < 0:
        raise UserError(f"temperature={temperature}: must be >= 0")
    dev = pick_device(device)
    net = DTPModel.from_pretrained(model, devices, delay, dtype=dtype, layout=layout, stage3=stage3,
                                   device=dev).eval()
    tok = net.checkpoint.tokenizer(tokenizer)
    if compile:
        net.compile()
    ids = tok(prompt, return_tensors="pt").input_ids.to(dev)
    if ids.shape[1] == 0:
        raise UserError("the prompt encodes to no tokens")
    check_token_ids(ids, net.shape.vocab, tokenizer or model)
    check_context(net.config, ids.shape[1], max_new_tokens)
    eos = net.config.eos_token_id if net.config.eos_token_id is not None else tok.eos_token_id
    out = net.generate(ids, max_new_tokens, do_sample=temperature > 0, temperature=temperature, top_k=top_k,
                       top_p=top_p, seed=seed, eos_token_id=eos)
    new = out[0, ids.shape[1]:]
    completion = tok.decode(new, skip_special_tokens=True)
    if json:
        print(dumps({"model": str(model), **net.dtp_settings(), "dtype": str(net.dtype).removeprefix("torch."),
                           "prompt": prompt, "completion": completion, "text": prompt + completion,
                           "prompt_ids": ids[0].tolist(), "new_token_ids": new.tolist()}))
    else:
        print(prompt + completion)
    return 0
