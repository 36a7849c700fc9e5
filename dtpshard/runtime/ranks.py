"""DTP across processes on torch.distributed: one rank is one device of docs/design.md §1.

The model definition (dtpshard.model) has no distributed code; this file is the runtime. Rank l
reads only its own slices of the checkpoint (its KV groups' q/k/v rows and o_proj columns, its
neurons' gate/up rows and down_proj columns; a layout's permutation is applied while reading),
keeps its own residual stream x_l [B, T, D], and after module m posts its partial p_l^m as an
asynchronous all-reduce. The sum is waited for only where the delay schedule lands it, δ modules
later, so the transfer overlaps δ modules of compute; the others' share is Σ_j p_j^m - p_l^m.
(An all-reduce rather than an all-gather: the same collective as the baseline, and less traffic
for L ≥ 3.) Every rank issues the same collectives in the same order: the schedule decides them.
δ = 0 is ordinary tensor parallelism, the baseline: a blocking all-reduce after every module.
The end is the mean (docs/design.md §1) over ranks of FinalNorm(x_l) (one all-reduce), then the LM head.

Start: `torchrun --nproc-per-node L -m dtpshard run MODEL --prompt TEXT --delay D`, or
`dtpshard run MODEL ... --nproc L`, which spawns L local gloo processes itself.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtpshard.model.checkpoint import Checkpoint, open_checkpoint
from dtpshard.core.shape import check_context, check_delay, check_devices
from dtpshard.model.delay import schedule
from dtpshard.core.errors import UserError
from dtpshard.core.devices import pick_device
from dtpshard.core.vocab import Count, Delay, Device, DType, NonNegativeInt, NonNegativeNumber, Seconds, Stage3
from dtpshard.core.launch import (RankExit, RankFailure, cause, launch_local, process_group, root_cause, set_threads,
                                  world_from_env)
from dtpshard.core.layout import Layout, as_layout, units
from dtpshard.model.attention import attend
from dtpshard.model.dtp import KVCache, rotary_for, rms_norm, rotate_half
from dtpshard.core.permutation import permutation_spec, unit_index



# -- refusing a bad world size before any collective ---------------------------------------
def check_world(model: Path, world: int, layout: Path | Layout | None = None,
                delay: float = 1) -> tuple[Checkpoint, Layout | None]:
    """Open the checkpoint (headers only) and refuse a shape or layout that `world` ranks cannot run."""
    ckpt = open_checkpoint(model)
    try:
        check_devices(ckpt.shape, world)
    except UserError as e:
        raise UserError(f"world size {world} does not fit {model}: {e}") from None
    check_delay(ckpt.shape, delay)
    lay = as_layout(layout)
    if lay is not None:
        lay.check_model(ckpt.shape.summary(), where=f"layout {layout}")
        if lay.devices != world:
            raise UserError(f"layout {layout} was made for devices={lay.devices}, the world size is {world}")
    return ckpt, lay


# -- reading only this rank's slices ---------------------------------------------------------
def _runs(idx: np.ndarray) -> list[slice]:
    """Consecutive runs of an index list as slices, in order: [3, 4, 5, 9] -> [3:6, 9:10]."""
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    return [slice(int(r[0]), int(r[-1]) + 1) for r in np.split(idx, breaks)]


def read_units(ckpt: Checkpoint, name: str, idx: np.ndarray, axis: int) -> torch.Tensor:
    """Rows (axis 0) or columns (axis 1) `idx` of tensor `name`, read run by run from the file."""
    from safetensors import safe_open

    key = ckpt.files.alias[name]
    with safe_open(str(ckpt.files.where[key]), framework="pt") as st:
        sl = st.get_slice(key)
        parts = [sl[r] if axis == 0 else sl[:, r] for r in _runs(idx)]
    return torch.cat(parts, axis)


def load_shard(ckpt: Checkpoint, rank: int, world: int, layout: Layout | None,
               dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Rank `rank`'s state dict: its 1/world of every sharded tensor (after the layout's permutation:
    position p holds original unit perm[p], rank l the positions [l·U/L, (l+1)·U/L)), the rest whole."""
    s = ckpt.shape
    spec = permutation_spec(s)
    out = {}
    for name in ckpt.files.keys():
        if name.endswith("rotary_emb.inv_freq") or (s.tied and name == "lm_head.weight"):
            continue
        if name not in spec:  # embedding, norms, LM head: every rank needs them whole
            out[name] = ckpt.files.get(name).to(dtype)
            continue
        m, axis, rows = spec[name]
        n = units(s.summary(), m)
        perm = np.arange(n) if layout is None else np.asarray(layout.perm(m))
        own = perm[rank * n // world:(rank + 1) * n // world]
        out[name] = read_units(ckpt, name, unit_index(own, rows).numpy(), axis).to(dtype)
    return out


# -- transfers -------------------------------------------------------------------------------
class Link:
    """This rank's transfers: sums over ranks, posted now and taken later (DTP) or at once (TP).

    `latency` (seconds) and `bandwidth` (bytes/s, 0: unlimited) emulate a slower link: a sum of
    n bytes is available latency + n / bandwidth after the local transfer itself completed. The
    emulated wire time is in series with the transfer's own cost (gloo's copies and sums on the
    host), as a real link's is with the collective's software; taking the later of the two instead
    would let a slow loopback transfer hide the added latency from δ = 0. A blocking transfer
    therefore waits all of it; one taken δ modules later waits only for what the compute in
    between has not covered.
    """

    def __init__(self, rank: int, timeout: float, latency: float = 0.0, bandwidth: float = 0.0):
        self.rank, self.latency, self.bandwidth = rank, latency, bandwidth
        self.timeout = datetime.timedelta(seconds=timeout)
        self.pending: dict[int, list[Any]] = {}  # module -> [work, sum buffer, own partial, completed at, others]
        from dtpshard.core.launch import at_shutdown

        at_shutdown(self.close)  # process_group closes it before it ends the group

    def _completion(self, work: Any) -> list[float]:
        """[t]: set to the time the transfer completes (by the backend's thread), when a link is emulated."""
        done = [0.0]
        if self.latency > 0 or self.bandwidth > 0:
            work.get_future().add_done_callback(lambda _: done.__setitem__(0, time.perf_counter()))
        return done

    def _wait(self, work: Any, done: list[float], what: str, nbytes: int = 0) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise RankFailure(f"rank {self.rank}: {what} failed ({cause(e)}); another rank died, hung "
                              "or was stopped") from None
        if self.latency <= 0 and self.bandwidth <= 0:
            return
        wire = nbytes / self.bandwidth if self.bandwidth > 0 else 0.0
        left = (done[0] or time.perf_counter()) + self.latency + wire - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def reduce(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Σ over ranks of t, blocking (t is summed in place)."""
        work = dist.all_reduce(t, async_op=True)
        self._wait(work, self._completion(work), what, t.numel() * t.element_size())
        return t

    def post(self, m: int, p: torch.Tensor) -> None:
        buf = p.clone()  # summed in place by the backend while this rank computes on
        work = dist.all_reduce(buf, async_op=True)
        self.pending[m] = [work, buf, p, self._completion(work), None]

    def others(self, m: int) -> torch.Tensor:
        """Σ_{j≠l} p_j^m: the other ranks' partials of module m (waits for them if needed)."""
        entry = self.pending[m]
        if entry[4] is None:  # a fractional δ lands the same sum twice: wait once
            self._wait(entry[0], entry[3], f"the transfer of module {m}'s partials",
                       entry[1].numel() * entry[1].element_size())
            entry[4] = entry[1] - entry[2]
        return entry[4]

    def drop(self, m: int) -> None:
        self.pending.pop(m, None)

    def close(self, wait: bool = True) -> bool:
        """Forget every posted transfer, first waiting for each if `wait` (a clean end) -> whether none
        is still in flight: a group with one in flight cannot be destroyed without waiting on it."""
        works, self.pending = [e[0] for e in self.pending.values()], {}
        for work in works if wait else ():
            self._wait(work, [0.0], "a transfer posted before the end")
        return wait or all(work.is_completed() for work in works)


# -- the per-rank model ----------------------------------------------------------------------
class RankModel:
    """Device `rank` of a DTP model with `world` devices. Calling it is collective: every rank must
    make the same calls in the same order (same input shapes), as with any tensor-parallel model."""

    def __init__(self, ckpt: Checkpoint, rank: int, world: int, layout: Layout | None = None, delay: float = 1,
                 stage3: str = "sqrt", dtype: torch.dtype = torch.float32, timeout: float = 60, latency: float = 0,
                 device: str | torch.device = "cpu"):
        self.shape, self.rank, self.world = ckpt.shape, rank, world
        self.w = {k: v.to(device) for k, v in load_shard(ckpt, rank, world, layout, dtype).items()}
        self.sharded = set(permutation_spec(self.shape)) & set(self.w)
        self.rotary = rotary_for(ckpt.hf_config).to(device)
        self.link = Link(rank, timeout, latency)
        self.lm_head = self.w["model.embed_tokens.weight" if self.shape.tied else "lm_head.weight"]
        self.set_delay(delay, stage3)

    def set_delay(self, delay: float, stage3: str = "sqrt") -> None:
        """Change δ (and the stage-3 rule); the weights stay. Collective order follows the schedule."""
        check_delay(self.shape, delay)
        self.delay, self.stage3 = delay, stage3
        self.steps = schedule(self.shape.modules, self.world, delay, stage3)
        # Only broadcasts that land are sent (stage 3's never do); the last module that uses each:
        self.last_use = {k: m for m, st in enumerate(self.steps) for k, _ in st.arrivals}

    def sharded_bytes(self) -> int:
        return sum(self.w[n].numel() * self.w[n].element_size() for n in self.sharded)

    def new_cache(self) -> KVCache:
        return KVCache(self.shape.layers)

    def _attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache | None) -> torch.Tensor:
        """x [B, T, D] -> this rank's partial [B, T, D]: its heads through its o_proj columns."""
        s, w, pre = self.shape, self.w, f"model.layers.{i}."
        h = rms_norm(x, w[pre + "input_layernorm.weight"], s.rms_eps)
        B, T, _ = h.shape
        q, k, v = (F.linear(h, w[pre + f"self_attn.{n}_proj.weight"], w.get(pre + f"self_attn.{n}_proj.bias"))
                   .view(B, T, -1, s.head_dim).transpose(1, 2) for n in "qkv")  # [B, heads here, T, hd]
        if s.qk_norm:
            q = rms_norm(q, w[pre + "self_attn.q_norm.weight"], s.rms_eps)
            k = rms_norm(k, w[pre + "self_attn.k_norm.weight"], s.rms_eps)
        q = q * cos + rotate_half(q) * sin  # cos/sin [1, 1, T, hd]
        k = k * cos + rotate_half(k) * sin
        o, kv = attend(q, k, v, s.heads_per_group, None if cache is None else cache.kv[i])
        if cache is not None:
            cache.kv[i] = kv
        return F.linear(o.transpose(1, 2).reshape(B, T, -1), w[pre + "self_attn.o_proj.weight"])

    def _ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> this rank's partial [B, T, D]: its neurons through its down_proj columns."""
        w, pre = self.w, f"model.layers.{i}."
        h = rms_norm(x, w[pre + "post_attention_layernorm.weight"], self.shape.rms_eps)
        act = F.silu(F.linear(h, w[pre + "mlp.gate_proj.weight"])) * F.linear(h, w[pre + "mlp.up_proj.weight"])
        return F.linear(act, w[pre + "mlp.down_proj.weight"])

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, cache: KVCache | None = None,
                 logits_to_keep: int = 0) -> torch.Tensor:
        """input_ids [B, T] (the same on every rank) -> logits [B, T, V] (or the last `logits_to_keep`)."""
        x = F.embedding(input_ids, self.w["model.embed_tokens.weight"])  # x_l starts as the embedding
        start = 0 if cache is None else cache.length
        cos, sin = self.rotary(x, torch.arange(start, start + x.shape[1], device=x.device)[None])  # [1, T, hd]
        cos, sin = cos[:, None], sin[:, None]
        link = self.link
        for m, step in enumerate(self.steps):
            i = m // 2
            p = self._ffn(i, x) if m % 2 else self._attention(i, x, cos, sin, cache)
            if self.delay == 0:  # tensor parallelism: x_l ← x_l + Σ_j p_j^m, blocking
                x = x + link.reduce(p, f"the all-reduce of module {m}")
                continue
            if m in self.last_use:
                link.post(m, p)
            x = x + p if step.own_scale == 1 else x + step.own_scale * p
            for k, wt in step.arrivals:  # x_l += Σ_{j≠l} p_j^k, which left δ modules ago
                x = x + link.others(k) if wt == 1 else x + wt * link.others(k)
                if self.last_use[k] == m:
                    link.drop(k)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        h = rms_norm(x, self.w["model.norm.weight"], self.shape.rms_eps)
        if self.delay != 0 and self.world > 1:  # h = mean_l FinalNorm(x_l); under TP the x_l are equal
            h = link.reduce(h, "the final mean over ranks") / self.world
        return F.linear(h, self.lm_head)


# -- the command ------------------------------------------------------------------------------
def run_cmd(model: Path, *, prompt: str, delay: Delay | None = None, layout: Path | None = None,
            max_new_tokens: Count = 40, timeout: Seconds = 600, stage3: Stage3 = "sqrt",
            latency_ms: NonNegativeNumber = 0, dtype: DType = "float32", device: Device = "auto", nproc: Count = 1,
            threads: NonNegativeInt = 0, tokenizer: Path | None = None, json: bool = False,
            cuda_graphs: bool = False) -> int:
    """Greedy continuation of PROMPT with MODEL run as DTP across processes, one rank per device
    (start it with torchrun --nproc-per-node L, or pass --nproc L). Rank 0 prints the text.

    Args:
        model: Hugging Face checkpoint directory (the world size L must divide its KV groups and neurons)
        prompt: the text to continue
        delay: δ in modules (fractional allowed); 0 is tensor parallelism with a blocking all-reduce; default a student's recorded δ, else 1
        layout: a layout JSON made for L devices, applied while each rank reads its slices
        max_new_tokens: how many tokens to generate
        timeout: seconds to wait for the ranks to join and for any one transfer before giving up
        stage3: own-partial scale for the last δ modules: sqrt (√L, the paper's) or one
        latency_ms: extra latency per transfer, emulating a slower link
        dtype: weights and activations
        device: auto (cuda if available, else cpu), cpu (gloo) or cuda (NCCL, one GPU per rank: cuda:LOCAL_RANK)
        nproc: spawn this many local ranks; 1: this process is one rank of a torchrun
        threads: torch threads per rank (0: the cores divided by the local ranks, less two for the transfers)
        tokenizer: tokenizer directory, where MODEL has no tokenizer files
        json: rank 0 prints one JSON object {text, completion, new_token_ids, ...} instead of the text
        cuda_graphs: decode each token as one CUDA-graph replay (device cuda; runtime/graphs.py)
    """
    from dtpshard.core.devices import DTYPES

    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens}: must be at least 1")
    if device.startswith("cuda:"):
        raise UserError(f"--device {device}: each rank uses cuda:LOCAL_RANK; give --device cuda")
    device = pick_device(device)
    if cuda_graphs and device != "cuda":
        raise UserError("--cuda-graphs: only with --device cuda")
    if device == "cuda" and latency_ms:
        raise UserError("latency_ms emulates a link with host-side waits: only with device=cpu")
    if latency_ms / 1000 >= timeout:
        raise UserError(f"--latency-ms {latency_ms:g}: every transfer would outlast --timeout {timeout:g} s")
    delay = _student_delay(model, delay, nproc if nproc > 1 else int(os.environ.get("WORLD_SIZE", "1")))
    kwargs = dict(model=model, prompt=prompt, delay=delay, layout=layout, max_new_tokens=max_new_tokens,
                  timeout=timeout, stage3=stage3, latency_ms=latency_ms, dtype=dtype, device=device, threads=threads,
                  tokenizer=tokenizer, json=json, cuda_graphs=cuda_graphs)
    if nproc > 1 and "RANK" not in os.environ:  # the launcher: refuse before spawning anything
        ckpt, _ = check_world(model, nproc, layout, delay)
        _prompt_ids(model, prompt, tokenizer, ckpt.hf_config, max_new_tokens)
        exits = launch_local(nproc, _run_rank, (kwargs,), grace=timeout, who="dtpshard run")
        if any(e.said or e.traceback for e in exits):  # a rank raised: say that one (ranks that lost a
            # collective have already said so themselves)
            raise RankFailure(root_cause([e if e.said or e.traceback else RankExit(e.rank, 0) for e in exits]))
        bad = [f"rank {e.rank} exit {e.code}" for e in exits if e.code]
        if bad:
            raise RankFailure(f"the run failed ({', '.join(bad)})")
        return 0
    rank, world = world_from_env()
    ckpt, lay = check_world(model, world, layout, delay)  # before any collective
    from dtpshard.model.decode import generate_ids

    tok, ids = _prompt_ids(model, prompt, tokenizer, ckpt.hf_config, max_new_tokens)
    set_threads(threads)
    dev = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if device == "cuda" else "cpu"
    with process_group(timeout, "nccl" if device == "cuda" else "gloo") as (rank, world):
        net = RankModel(ckpt, rank, world, lay, delay, stage3, DTYPES[dtype], timeout, latency_ms / 1000, dev)
        if cuda_graphs:
            from dtpshard.runtime.graphs import GraphDecoder

            net = GraphDecoder(net, ids.shape[0], ids.shape[1] + max_new_tokens)
        out = generate_ids(net, ids.to(dev), max_new_tokens, eos_id=tok.eos_token_id)
        if rank == 0:
            new = out[0, ids.shape[1]:]
            completion = tok.decode(new, skip_special_tokens=True)
            if json:
                import json as _json

                print(_json.dumps({"model": str(model), "devices": world, "delay": delay, "stage3": stage3,
                                   "prompt": prompt, "completion": completion, "text": prompt + completion,
                                   "prompt_ids": ids[0].tolist(), "new_token_ids": new.tolist()}), flush=True)
            else:
                print(prompt + completion, flush=True)
    return 0


def _prompt_ids(model: Path, prompt: str, tokenizer: Path | None, hf_config: Any, max_new_tokens: int) -> tuple:
    """(tokenizer, ids [1, T]) of the prompt; refuses one that encodes to nothing or would run past the
    model's context. The launcher calls it too, so that it refuses before spawning any rank."""
    from dtpshard.model.checkpoint import load_tokenizer

    tok = load_tokenizer(tokenizer or model)
    ids = tok(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise UserError("the prompt encodes to no tokens")
    check_context(hf_config, ids.shape[1], max_new_tokens)
    return tok, ids


def _student_delay(model: Path, delay: float | None, world: int) -> float:
    """A DTP student's recorded δ unless one is given (1 for a dense checkpoint); one warning line
    when a student runs at another L or δ than it was distilled for."""
    from dtpshard.model.checkpoint import load_hf_config
    from dtpshard.model.hf import log, recorded_dtp

    block = recorded_dtp(load_hf_config(model))
    if block is None:
        return 1 if delay is None else delay
    delay = block.get("delay", 1) if delay is None else delay
    if (world, delay) != (block.get("devices"), block.get("delay")) and os.environ.get("RANK", "0") == "0":
        log.warning(f"warning: {model} is a DTP student distilled for devices={block.get('devices')}, "
                    f"delay={block.get('delay')}; running it with {world} ranks, delay={delay} computes another function")
    return delay


def _run_rank(kwargs: dict[str, Any]) -> int:
    return run_cmd(**kwargs)


if __name__ == "__main__":
    from dtpshard import cli

    sys.exit(cli.main(["run"] + sys.argv[1:]))
