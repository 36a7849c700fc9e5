"""`dtpshard affinity`, over dtpshard/affinity/calibrate.py."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

from cyclopts import Parameter

from dtpshard.affinity.settings import CALIBRATION_DATA, PASS_SETTINGS, CalibrationData, PassSettings
from dtpshard.core.io import dumps
from dtpshard.core.settings import DEFAULT
from dtpshard.core.vocab import Delay, Proxy


def affinity_cmd(model: Path, *, out: Path, data: Annotated[CalibrationData, Parameter(name="*")] = CALIBRATION_DATA,
                 delay: Delay = DEFAULT.delay, proxy: Proxy = "first-order",
                 run: Annotated[PassSettings, Parameter(name="*")] = PASS_SETTINGS, progress: bool = True,
                 json: bool = False) -> int:
    """Score how much every unit depends on every co-located unit (docs/design.md §2), in one pass.

    Calibration text (--text files, or --dataset, or by default the built-in offline corpus) is
    tokenised and packed into --blocks blocks of --seq-len tokens; the dense model runs over them
    once, layer by layer, and every edge (a, b) that delay δ creates gets a score matrix
    [units(a), units(b)], the mean over tokens accumulated in float64. The default proxy is the
    paper's: the up edge is first order through SwiGLU per query head, summed per KV group, with ρ
    held at its dense value; the down edge is the additive q/k/v score.

    A model that does not fit --memory-budget is streamed: one decoder layer at a time is read
    from the checkpoint, all calibration tokens go through it, its edges are accumulated and it is
    dropped (the scores are the same as in memory); calibration hidden states beyond what is left
    of the budget are kept in temporary files.

    Args:
        model: Hugging Face checkpoint directory of a supported family (core/family.py: llama, qwen2, ...)
        out: affinity file to write (required; safetensors, format dtpshard.affinity/1)
        delay: DTP delay δ; every edge b-δ <= a <= b-1 is scored (δ >= 2 adds attention->attention, FFN->FFN, ...)
        proxy: the score: first-order (the paper's), group-unit (a KV group's heads summed before squaring),
            exact-jacobian (ρ moves with the contribution), ablation (the contribution actually removed, norm and
            unit recomputed)
        progress: show a progress bar
        json: print one JSON object {out, edges, tokens, seconds, ...} on stdout
    """
    from dtpshard.affinity.calibrate import plan_calibration, run_calibration
    from dtpshard.core.lock import locked_output

    with locked_output(out):  # a second writer of --out is refused before the pass, not at the rename
        pass_ = plan_calibration(model, out, data, delay=delay, run=run)
        print(pass_.describe(), file=sys.stderr)
        result = run_calibration(pass_, proxy, progress)
    print(f"wrote {out}: {result.edges} edges, {result.tokens} tokens ({data.blocks} x {data.seq_len}), "
          f"{result.seconds:.1f} s on {result.device}", file=sys.stderr)
    if json:
        print(dumps(result.to_json(model, delay, data)))
    return 0
