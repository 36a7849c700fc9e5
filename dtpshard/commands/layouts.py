"""`dtpshard layout`, `dtpshard score` and `dtpshard permute`, over dtpshard/layouts/."""
from __future__ import annotations

from pathlib import Path

from dtpshard.core.io import dumps
from dtpshard.core.layout import HASH_KEY
from dtpshard.core.settings import DEFAULT
from dtpshard.core.vocab import (
    Count,
    Delay,
    DelayedBy,
    KvSearch,
    LayoutKind,
    PermuteCheck,
    PositiveNumber,
    Seed,
    SharedBy,
    SharedFraction,
)

CHECK_TOL = 1e-4  # --check logits' default: layouts/permute.py CHECK_TOL (not imported: --help reads no torch)


def layout_cmd(source: Path, *, out: Path, devices: Count = DEFAULT.devices, delay: Delay = DEFAULT.delay,
               kind: LayoutKind = "optimised", layers: Count | None = None, restarts: Count = 1, seed: Seed = 0,
               kv_search: KvSearch = "assignment", max_sweeps: Count = 20, shared: SharedFraction = 0.0,
               shared_by: SharedBy = "fo", delayed: str | None = None, delayed_by: DelayedBy | None = None,
               model: Path | None = None, text: list[str] | None = None, blocks: Count = 8, seq_len: Count = 256,
               json: bool = False) -> int:
    """Make a layout (docs/design.md §3) and write it as JSON; prints J, its random expectation and the time.

    Args:
        source: a model directory (contiguous and random only) or an affinity file
        out: the layout file to write
        devices: number of devices L (must divide the KV groups and the neurons)
        delay: the delay δ the layout is for; the affinity must hold every edge it needs
        kind: layout family; anti minimises J, heads-only/neurons-only leave the other side contiguous
        layers: optimise only k evenly spaced layers round(j·n/k), j < k; the rest stay contiguous
        restarts: keep the best of this many starts (the first contiguous, the rest random)
        seed: seed of the random layout, or of the random restarts
        kv_search: KV-group block update: exact assignment, or the paper's exhaustive search over labelled partitions
        max_sweeps: stop after this many sweeps even if J still grows by more than 1e-9
        shared: fraction of each layer's neurons replicated on every device (docs/design.md §6), rounded up to
            leave the rest divisible by L
        shared_by: the shared neurons: the top by up-edge affinity mass (fo), by down-edge mass (dn), or random
        delayed: delay only some modules, the rest plain tensor parallel (docs/design.md §1): a share of them written
            with a decimal point (0.5, 1.0), or module indices (10-59, 0,2,10-19; module 2i is layer i's attention)
        delayed_by: which modules a share delays: least measured sensitivity (the default: KL to the dense model with
            that module alone delayed, under this layout; needs --model), the upper ones, or random (seeded by --seed)
        model: the dense checkpoint sensitivity is measured on (default: SOURCE when it is a model directory)
        text: sensitivity's calibration text files or directories (default: the offline corpus)
        blocks: sensitivity's calibration blocks
        seq_len: tokens per sensitivity block
        json: print one JSON object {out, kind, devices, delay, seed, shared, shared_by, delayed, layout_sha256, score:
            {J, ...}}
            instead of text
    """
    from dtpshard.layouts.make import describe, write_layout

    layout = write_layout(source, out, devices, delay, kind, layers, restarts, seed, kv_search, max_sweeps,
                          shared, shared_by, delayed, delayed_by, model, text, blocks, seq_len)
    if json:
        print(dumps({"out": str(out), "kind": layout.kind, "devices": layout.devices, "delay": layout.delay,
                     "seed": layout.seed, "shared": layout.shared, "shared_by": layout.shared_by,
                     "delayed": None if layout.delayed is None else list(layout.delayed),
                     HASH_KEY: layout.content_sha256(), "score": layout.score}))
    else:
        print(f"{describe(layout)} -> {out}")
    return 0


def score_cmd(affinity: Path, layout: Path, *, json: bool = False) -> int:
    """Co-located score J of a layout under an affinity file (docs/design.md §3).

    Args:
        affinity: affinity file (safetensors) from `dtpshard affinity`
        layout: layout file (JSON) from `dtpshard layout`
        json: print the score and its parts (per edge, per layer up/down) as JSON
    """
    from dtpshard.layouts.score import format_score, score_file

    score = score_file(affinity, layout)
    print(dumps(score) if json else format_score(score))
    return 0


def permute_cmd(model: Path, layout: Path, *, out: Path, force: bool = False,
                check: PermuteCheck = "construction", check_tokens: Count = 256,
                tolerance: PositiveNumber = CHECK_TOL, json: bool = False) -> int:
    """Write a permuted Hugging Face checkpoint that any tensor-parallel engine loads as is.

    Device d of an L-way contiguous split of the output holds the units the layout gives it.
    Weights are streamed one tensor at a time into shards mirroring the input's (same files,
    index, dtypes and metadata); every other file is copied byte for byte. Nothing is renamed
    into place before the check passes. The default check reads every written tensor back and
    compares it bit for bit with the source gathered by the layout's indices (no forward pass,
    any model size). `--check logits` instead compares transformers' fp32 logits of both
    checkpoints: the permutation is exact, the difference is fp32 rounding of reordered sums
    (grows with depth), while a wrong permutation differs by the logits' own scale.

    Args:
        model: the source Hugging Face checkpoint directory (safetensors)
        layout: the layout file (dtpshard.layout/1), made for this model
        out: the directory to write (weights, index, every other source file, layout.json)
        force: replace --out if it is a permuted checkpoint (one this command wrote)
        check: construction (tensors read back, compared exactly), logits (fp32 forward of both), or none
        check_tokens: sequence length of --check logits (random token ids, seeded)
        tolerance: --check logits: largest max |Δlogits| / max |logit| accepted
        json: print one JSON object {out, check: {kind, passed, ...}} instead of text
    """
    from dtpshard.layouts.permute import permute

    result = permute(model, layout, out, force, check, check_tokens, tolerance)
    said = result.pop("said")
    print(dumps(result) if json else "\n".join(said))  # stdout with --json: the one JSON object only
    return 0
