"""`dtpshard permute`: write a layout-permuted Hugging Face checkpoint, checked against the original."""
from __future__ import annotations

from pathlib import Path

import torch

from dtpshard.model.checkpoint import save_checkpoint
from dtpshard.core.errors import UserError
from dtpshard.core.layout import Layout
from dtpshard.core.permutation import apply_layout
from dtpshard.core.vocab import Count, PositiveNumber

LAYOUT_JSON = "layout.json"  # the applied layout, saved next to the permuted weights
CHECK_TOL = 1e-4  # max |Δlogits| in fp32 (docs/design.md §3)


def permute_cmd(model: Path, layout: Path, *, out: Path, force: bool = False, check_tokens: Count = 256,
                tolerance: PositiveNumber = CHECK_TOL, json: bool = False) -> int:
    """Write a permuted Hugging Face checkpoint that any tensor-parallel engine loads as is.

    Device d of an L-way contiguous split of the output holds the units the layout gives it.
    Before anything is renamed into place, the dense logits of the output and of the input are
    compared in fp32 (transformers' own model) and must agree to 1e-4. The permutation itself is
    exact; the difference is fp32 rounding of reordered sums, which grows with depth and logit
    size (SmolLM2-135M: 8e-5), while a wrong permutation differs by O(1).

    Args:
        model: the source Hugging Face checkpoint directory (safetensors)
        layout: the layout file (dtpshard.layout/1), made for this model
        out: the directory to write (weights, config, tokenizer files, layout.json)
        force: replace --out if it exists
        check_tokens: sequence length of the logits check (random token ids, seeded)
        tolerance: largest max |Δlogits| the check accepts
        json: print one JSON object {out, check: {max_abs_diff, ...}} instead of text
    """
    from dtpshard.model.checkpoint import open_checkpoint
    from dtpshard.core.io import atomic_dir

    model, layout_path, out = Path(model), Path(layout), Path(out)
    if check_tokens < 1:
        raise UserError(f"--check-tokens {check_tokens}: must be at least 1")
    if not 0 < tolerance < float("inf"):
        raise UserError(f"--tolerance {tolerance}: must be a positive number")
    ckpt = open_checkpoint(model)
    lay = Layout.load(layout_path)
    lay.check_model(ckpt.shape.summary(), where=f"layout {layout_path} (model {model})")
    if out.resolve() == model.resolve():
        raise UserError(f"--out {out} is the source model directory (write elsewhere)")
    if out.exists() and not (force and out.is_dir()):  # refuse before the (long) read of the weights
        raise UserError(f"output {out} exists (use --force to replace it)" if out.is_dir()
                        else f"output {out} exists and is not a directory")
    sd = apply_layout(ckpt.state_dict(), ckpt.shape, lay)  # stored dtype kept: a permutation is exact
    try:
        with atomic_dir(out, force=force) as tmp:
            save_checkpoint(tmp, ckpt.hf_config, sd, source=model, extra_json={LAYOUT_JSON: lay.to_json()})
            del sd
            tokens = min(check_tokens, getattr(ckpt.hf_config, "max_position_embeddings", None) or check_tokens)
            diff, scale = dense_logits_diff(model, tmp, tokens, ckpt.shape.vocab)
            if not json:
                print(f"check: max |logits(permuted) - logits(original)| = {diff:.3g} over {tokens} tokens "
                      f"(fp32, max |logit| {scale:.3g}, tolerance {tolerance:g})")
            if not diff <= tolerance:  # also catches NaN
                raise UserError(f"permuted logits differ from the original by {diff:.3g} > --tolerance "
                                f"{tolerance:g} (max |logit| {scale:.3g}); nothing written")
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror or e}") from None
    if json:
        import json as _json

        print(_json.dumps({"model": str(model), "layout": str(layout_path), "out": str(out), "kind": lay.kind,
                           "devices": lay.devices, "layout_sha256": lay.content_sha256(),
                           "check": {"max_abs_diff": diff, "max_abs_logit": scale, "tokens": tokens,
                                     "tolerance": tolerance, "passed": True}}))
    else:
        print(f"{lay.kind} layout (L = {lay.devices}) applied to {model} -> {out}")
    return 0


def dense_logits_diff(original: Path, permuted: Path, tokens: int, vocab: int) -> tuple[float, float]:
    """(max |Δlogits|, max |logit|) of the two checkpoints as transformers loads them, fp32, on
    seeded random ids (no tokenizer or data needed; every weight is exercised all the same)."""
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))  # [1, T]
    ref = _dense_logits(original, ids, "the source model")  # one model in memory at a time
    diff = (_dense_logits(permuted, ids, "the permuted checkpoint") - ref).abs().max().item()
    return diff, ref.abs().max().item()


def _dense_logits(path: Path, ids: torch.Tensor, what: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the check's output is its one printed line
    hf_logging.disable_progress_bar()
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager",
                                                  local_files_only=True)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"transformers cannot load {what} ({first})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    with torch.inference_mode():
        return hf.eval()(ids).logits.float()  # [1, T, V]
