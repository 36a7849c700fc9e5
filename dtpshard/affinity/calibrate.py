"""`dtpshard affinity`: one calibration pass over the dense model, written as an affinity file."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from dtpshard.core.errors import UserError
from dtpshard.core.vocab import AffinityDType, Count, Delay, Device, NonNegativeInt, NonNegativeNumber, Seed


def affinity_cmd(model: Path, *, out: Path, text: list[str] | None = None, dataset: str | None = None,
                 text_field: str = "text", tokenizer: Path | None = None, blocks: Count = 64, seq_len: Count = 1024, delay: Delay = 1.0, seed: Seed = 0,
                 group_unit: bool = False, exact_jacobian: bool = False, ablation: bool = False,
                 micro_batch: Count = 4, chunk: NonNegativeInt = 0, device: Device = "auto",
                 dtype: AffinityDType = "float32", offload: bool | None = None, memory_budget: NonNegativeNumber = 0.0,
                 spill_dir: Path | None = None, progress: bool = True, json: bool = False) -> int:
    """Score how much every unit depends on every co-located unit (docs/design.md §2), in one pass.

    Calibration text (--text files, or --dataset, or by default the built-in offline corpus) is
    tokenised and packed into --blocks blocks of --seq-len tokens; the dense model runs over them
    once, layer by layer, and every edge (a, b) that delay δ creates gets a score matrix
    [units(a), units(b)], the mean over tokens accumulated in float64. The defaults are the
    paper's: the up edge is first order through SwiGLU per query head, summed per KV group, with ρ
    held at its dense value; the down edge is the additive q/k/v score.

    A model that does not fit --memory-budget is streamed: one decoder layer at a time is read
    from the checkpoint, all calibration tokens go through it, its edges are accumulated and it is
    dropped (the scores are the same as in memory); calibration hidden states beyond what is left
    of the budget are kept in temporary files.

    Args:
        model: Hugging Face checkpoint directory (llama, mistral, qwen2 or qwen3 family)
        out: affinity file to write (required; safetensors, format dtpshard.affinity/1)
        text: calibration text files or directories (.txt split at blank lines, .jsonl/.json records, .parquet)
        dataset: a save_to_disk directory, a parquet file or directory, or a hub name: fineweb-edu, wikitext-2, owner/name[:config]
        text_field: the column or JSON field that holds the text
        tokenizer: tokenizer directory, where MODEL has no tokenizer files
        blocks: number of calibration blocks
        seq_len: tokens per block
        delay: DTP delay δ; every edge b-δ <= a <= b-1 is scored (δ >= 2 adds attention->attention, FFN->FFN, ...)
        seed: seed of the document order
        group_unit: score a KV group as one unit (sum its r heads' contributions before squaring)
        exact_jacobian: use the exact RMSNorm Jacobian (ρ moves with the contribution) instead of γ/ρ
        ablation: leave-one-out score: actually remove the contribution and recompute the norm and the unit
        micro_batch: sequences per module call (memory)
        chunk: cap on tokens per score chunk; 0 = automatic (memory)
        device: auto (cuda if available, else cpu), cpu, cuda or cuda:N
        dtype: compute dtype of the pass (sums are always accumulated in float64)
        offload: --offload reads one decoder layer at a time from the checkpoint, --no-offload holds the whole model; default: offload only when the model does not fit --memory-budget
        memory_budget: GiB the pass may hold (model and calibration hidden states); 0 = 0.8 x the memory available now (RAM, or the GPU's free memory)
        spill_dir: directory for the hidden states that do not fit the budget, in anonymous temporary files (default: the directory of --out)
        progress: show a progress bar
        json: print one JSON object {out, edges, tokens, seconds, ...} on stdout
    """
    import torch

    from dtpshard.affinity.scorer import ScoreOptions, compute_affinity
    from dtpshard.affinity.file import Affinity, edges_for_delay
    from dtpshard.model.checkpoint import check_token_ids, load_tokenizer, open_checkpoint
    from dtpshard.core.shape import check_delay
    from dtpshard.data.blocks import load_texts, make_blocks
    from dtpshard.model.dense import DenseModel, StreamedDense
    from dtpshard.affinity.offload import GiB, HiddenStates, default_budget, plan
    from dtpshard.core.io import check_output_file, check_writable_dir, refuse_overwriting
    from dtpshard.core.devices import pick_device

    opts = ScoreOptions(group_unit=group_unit, exact_jacobian=exact_jacobian, ablation=ablation)
    device = pick_device(device)
    ckpt = open_checkpoint(model)
    shape = ckpt.shape
    check_delay(shape, delay)
    if not edges_for_delay(shape.modules, delay):
        raise UserError(f"--delay {delay}: no edges (every module sees all partials below δ = 1)")
    weights = [*ckpt.files.files, ckpt.files.index, Path(model) / "config.json"]
    refuse_overwriting(out, the_model_directory=Path(model), the_model_file=weights, the_tokenizer=tokenizer)
    check_output_file(Path(out))  # before the pass, not after it
    tok = load_tokenizer(tokenizer or model)
    texts = load_texts(text, dataset, role="calibration", text_field=text_field)
    ids = make_blocks(tok, texts, seq_len, blocks, seed=seed)  # [blocks, seq_len]
    check_token_ids(ids, shape.vocab, tokenizer or model)

    budget = int(memory_budget * GiB) if memory_budget > 0 else default_budget(device)
    how = plan(shape, ids.numel(), delay, getattr(torch, dtype), budget, offload)
    spill = spill_dir if spill_dir is not None else out.parent
    if how.hidden > how.hidden_budget:
        check_writable_dir(spill / "spill")
    print(f"affinity pass: {how.describe()}", file=sys.stderr)
    t0 = time.perf_counter()
    build = StreamedDense if how.offload else DenseModel.from_checkpoint
    dense = build(ckpt, dtype=getattr(torch, dtype), device=device)
    edges = compute_affinity(dense, ids, delay, opts, micro_batch=micro_batch, chunk=chunk or None,
                             progress=progress, hidden=HiddenStates(how.hidden_budget, spill))
    elapsed = time.perf_counter() - t0
    options = dict(opts.to_dict(delay), blocks=blocks, seq_len=seq_len, seed=seed, dtype=dtype)
    Affinity(shape.summary(), delay, edges, tokens=ids.numel(), options=options,
             source=f"{texts.source} seed={seed}").save(out)
    print(f"wrote {out}: {len(edges)} edges, {ids.numel()} tokens ({blocks} x {seq_len}), "
          f"{elapsed:.1f} s on {device}", file=sys.stderr)
    if json:
        import json as _json

        print(_json.dumps({"out": str(out), "model": str(model), "delay": delay, "edges": len(edges),
                           "tokens": int(ids.numel()), "blocks": blocks, "seq_len": seq_len, "seconds": elapsed,
                           "device": str(device), "data": texts.source, "options": options}))
    return 0
