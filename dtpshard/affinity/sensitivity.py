"""How much each module's delay costs: the measurement that chooses which modules a partial
student delays (docs/design.md §1, per-module delay; `--delayed-by sensitivity`).

Module m's sensitivity is KL(dense ‖ model with only module m delayed), a mean over the tokens of
calibration blocks, under the layout the student will have: one forward per module, each against
the dense logits computed once. It is the quantity a partial student pays, measured rather than
guessed from the affinity (which scores which units should share a device, not how much a
module's delay moves the output): delaying the modules of least sensitivity together is the
student that starts closest to its teacher, to first order in the modules' interactions.

Cost: M + 1 forwards over the calibration tokens (M modules, and the dense one). For SmolLM2-135M
(M = 60) on 8 × 256 tokens, about a minute on a 2-core CPU; for a 70B model (M = 160) on 64 × 1024
tokens, 161 forwards of 65 536 tokens, about 1.5·10^18 FLOP: ten minutes on one 8-GPU node, far
less than the distillation it saves. Modules before m run as plain tensor parallelism, where every
device's stream equals the dense one, so each forward resumes from the dense stream at module m:
M/2 forwards' work in all, which halves the figures above.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from dtpshard.core.settings import DTPSettings

SENSITIVITY_BLOCKS = 8  # calibration blocks a study or convert measures on: the ranking, not a precise KL


def _kl_sum(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> float:
    """Σ over positions of KL(teacher ‖ student), in float64 accumulation."""
    t = torch.log_softmax(teacher_logits.float(), -1)
    s = torch.log_softmax(student_logits.float(), -1)
    return float((t.exp() * (t - s)).sum(-1).double().sum())


@torch.no_grad()
def module_sensitivity(model: Any, ids: torch.Tensor, settings: DTPSettings, micro_batch: int = 4,
                       progress: bool = False) -> dict[str, Any]:
    """Per module m, KL(dense ‖ only m delayed) on `ids` [blocks, T]: `model` is a DTPModel holding
    the layout's permuted weights; it is left at `settings` afterwards. Returns {"kl": [M floats],
    "tokens", "seconds"}.

    Every module before m is plain, so every device's stream entering m is the dense stream: the
    dense walk's streams are kept, and module m's forward starts from them at m (M/2 forwards in
    all, not M); tests/test_partial.py holds it to the full forwards."""
    from dtpshard.model.delay import schedule_for
    from dtpshard.model.exchange import DeviceAxis, Exchange

    t0 = time.perf_counter()
    M, L = model.shape.modules, settings.devices
    device = next(model.parameters()).device
    model.eval()
    kl = np.zeros(M)
    schedules = [schedule_for(M, replace(settings, delayed=(m,))) for m in range(M)]
    batches = [ids[i:i + micro_batch].to(device) for i in range(0, len(ids), micro_batch)]
    bar = tqdm(total=len(batches) * M, desc="sensitivity", disable=not progress)
    for b in batches:
        emb = model.embed(b)
        cos, sin, mask = model._rope(emb, L, None, None)
        entering = [emb.unsqueeze(0)]  # the dense stream entering module m, [1, B, T, D]
        dense = Exchange(model.dense_steps, DeviceAxis(), 1)
        x = model.walk(entering[0], cos, sin, dense, after=lambda m, x, into=entering: into.append(x))
        teacher = model.logits(model.head_input(x, dense))
        for m in range(M):
            exchange = Exchange(schedules[m], DeviceAxis(), L)
            x = model.walk(entering[m].expand(L, *emb.shape), cos, sin, exchange, modules=range(m, M))
            kl[m] += _kl_sum(teacher, model.logits(model.head_input(x, exchange)))
            bar.update()
    bar.close()
    tokens = int(ids.numel())
    return {"kl": [float(v) for v in kl / tokens], "tokens": tokens, "seconds": time.perf_counter() - t0}
