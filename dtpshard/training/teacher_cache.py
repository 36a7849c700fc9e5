"""A teacher cache: the dense teacher's top-k log-probabilities of the training blocks, computed once.

The teacher's forward is a third of a distillation step and the same for every arm of a study
that trains on the same blocks. `dtpshard teacher-cache TEACHER --out DIR` (or an experiment)
runs it once and stores, per block of seq_len + 1 tokens and per position t < seq_len:

    top_ids [k] (int32), top_logp [k] (fp16 or bf16): the teacher's k most likely next tokens
    tail_logp (fp32): log of the probability mass outside them, log Σ_{v∉K} p_v

`distill --teacher-cache DIR` then trains with the top-k KL plus the tail bucket
(losses.topk_kl_ce_sums states the formula) instead of running the teacher; evaluation still
uses the exact KL. DIR:

    DIR/manifest.json          format, k, dtype, seq_len, blocks, the teacher's and tokenizer's hashes,
                               the shards; written last (a cache without it is unfinished)
    DIR/plan.json              what is being built (an interrupted build resumes when it matches)
    DIR/shard-NNNNN.safetensors  blocks [n, seq_len + 1] (int32) and their top_ids/top_logp/tail_logp

Blocks are looked up by content, so one cache serves every run whose blocks it holds (each arm
seed's shuffled blocks, any micro-batch split), and a run asking for a block it lacks, or a
different teacher, is refused in one line.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from dtpshard.core.devices import DTYPES, pick_device
from dtpshard.core.errors import UserError
from dtpshard.core.family import logits
from dtpshard.core.guard import check_outputs, check_replaceable, local_paths
from dtpshard.core.io import (
    atomic_path,
    atomic_write_text,
    dumps,
    files_id,
    open_safetensors,
    read_json_object,
    short_sha256,
)
from dtpshard.core.owned import ID, claim, is_ours, own_entries
from dtpshard.data.stream import BlockStream
from dtpshard.model.checkpoint import TOKENIZER_FILES, Checkpoint, open_checkpoint
from dtpshard.model.dtp import DTPModel
from dtpshard.training.losses import chunk_tokens, teacher_topk
from dtpshard.training.precision import autocast_for
from dtpshard.training.recipe import DistillConfig, train_blocks_for
from dtpshard.training.rundir import LOCK, locked

FORMAT = "dtpshard.teacher-cache/1"
COMMAND = "teacher-cache"  # its directory's mark (core/owned.py)
MANIFEST, PLAN = "manifest.json", "plan.json"
PLAN_KEYS = {"format", "k", "dtype", "seq_len", "blocks", "teacher_sha256", "tokenizer_sha256", "blocks_sha256", ID}
MANIFEST_KEYS = PLAN_KEYS | {"shards"}
SHARD_BLOCKS = 256
HALF = ("float16", "bfloat16")  # what the cache may store


def teacher_hashes(teacher: Path, tokenizer: Path | None = None) -> dict[str, str]:
    """Content hashes of the teacher's weights + config and of its tokenizer files (in `tokenizer`,
    else in the teacher's directory)."""
    teacher, tok_dir = Path(teacher), Path(tokenizer or teacher)
    weights = [p for p in teacher.iterdir() if p.suffix in (".safetensors", ".bin") or p.name == "config.json"]
    tok = [tok_dir / n for n in TOKENIZER_FILES if (tok_dir / n).is_file()]
    return {"teacher_sha256": files_id(weights), "tokenizer_sha256": files_id(tok)}


def block_key(block: torch.Tensor) -> bytes:
    return hashlib.sha1(block.to(torch.int64).numpy().tobytes()).digest()


def unique_blocks(blocks: torch.Tensor) -> torch.Tensor:
    seen, keep = set(), []
    for i, b in enumerate(blocks):
        key = block_key(b)
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return blocks[keep]


@torch.no_grad()
def teacher_targets(teacher: Any, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cached quantities for ids [B, T] (the blocks without their last token)."""
    h = teacher.hidden(ids)
    flat, w = h.reshape(-1, h.shape[-1]), teacher.head_weight
    c = chunk_tokens(w.shape[0])  # never all [B, T, V] logits at once
    parts = [teacher_topk(logits(flat[a:a + c], w), k) for a in range(0, flat.shape[0], c)]
    B, T = ids.shape
    return (torch.cat([x[0] for x in parts]).view(B, T, -1), torch.cat([x[1] for x in parts]).view(B, T, -1),
            torch.cat([x[2] for x in parts]).view(B, T))


def build_cache(teacher: Path | Checkpoint, blocks: torch.Tensor, out: Path, k: int = 64, dtype: str = "float16",
                micro_batch: int = 4, device: str = "cpu", precision: str = "auto", progress: bool = True,
                force: bool = False, tokenizer: Path | None = None) -> Path:
    """Write (or finish, or keep) the cache of `blocks` [n, seq_len + 1] under `out`."""
    if k < 1:
        raise UserError(f"--k {k}: must be at least 1")
    if dtype not in HALF:
        raise UserError(f"--dtype {dtype!r}: must be float16 or bfloat16")
    ckpt = opened(teacher)  # its weights checked as data (headers) before the plan is written
    out, blocks = Path(out), unique_blocks(blocks.to(torch.int64))
    plan = {"format": FORMAT, "k": k, "dtype": dtype, "seq_len": int(blocks.shape[1]) - 1,
            "blocks": int(blocks.shape[0]), **teacher_hashes(ckpt.path, tokenizer),
            "blocks_sha256": short_sha256(blocks.numpy().tobytes())}
    if (out / MANIFEST).is_file() and _holds(_read(out, MANIFEST), plan) and is_ours(out, COMMAND, PLAN):
        return out
    with locked(out):  # one builder at a time: a second is refused ("in use by process PID")
        same = (out / PLAN).is_file() and _holds(_read(out, PLAN), plan)
        if not same and not force and any(p.name != LOCK for p in out.iterdir()):
            raise UserError(f"--out {out}: exists and holds something else (use --force to rebuild it)")
        names = (PLAN, MANIFEST, *sorted(p.name for p in out.glob("shard-*.safetensors")))
        plan[ID] = claim(out, COMMAND, names, PLAN, force=not same)  # only a cache of ours is resumed or cleared
        atomic_write_text(out / PLAN, dumps(plan, indent=1) + "\n")
        return _build(ckpt, blocks, out, plan, k, dtype, micro_batch, device, precision, progress)


def _holds(old: dict[str, Any], plan: dict[str, Any]) -> bool:
    """Whether a cache's plan or manifest `old` is of the cache `plan` describes."""
    return {key: old.get(key) for key in plan if key != ID} == {k: v for k, v in plan.items() if k != ID}


def _read(out: Path, name: str) -> dict[str, Any]:
    keys = MANIFEST_KEYS if name == MANIFEST else PLAN_KEYS
    return read_json_object(out / name, f"teacher cache {name}", keys=keys)


def CACHE_TREE(d: Path) -> Path | None:  # an owned.Inside, named as rundir.RUN_TREE
    """A teacher cache inside another command's directory (an experiment's): its own, holding only
    its plan, manifest and shards (and the lock, or a kill's leftovers of them)."""
    shards = [p.name for p in d.glob("shard-*.safetensors")]
    return own_entries(COMMAND, PLAN, (PLAN, MANIFEST, *shards), extra=(LOCK,))(d)


def is_cache(path: Path) -> bool:
    """Whether `path` is a teacher cache (its plan or manifest says so): what --force rebuilds."""
    return any((Path(path) / n).is_file() and _read(Path(path), n).get("format") == FORMAT for n in (PLAN, MANIFEST))


def _build(ckpt: Checkpoint, blocks: torch.Tensor, out: Path, plan: dict[str, Any], k: int, dtype: str,
           micro_batch: int, device: str, precision: str, progress: bool) -> Path:
    # dense fp32, as distill's teacher
    teacher = DTPModel.from_checkpoint(ckpt, devices=1, delay=0, dtype=torch.float32, device=device).eval()
    k = min(k, teacher.shape.vocab)
    shards = []
    bar = tqdm(total=int(blocks.shape[0]), desc="teacher cache", unit="block", disable=not progress)
    for s, a in enumerate(range(0, blocks.shape[0], SHARD_BLOCKS)):
        part = blocks[a:a + SHARD_BLOCKS]
        name = f"shard-{s:05d}.safetensors"
        shards.append({"file": name, "blocks": int(part.shape[0])})
        if not (out / name).is_file():  # shards are written whole (rename), so a present one is good
            _write_shard(out / name, teacher, part, k, DTYPES[dtype], micro_batch, device,
                         lambda: autocast_for(device, precision))
        bar.update(int(part.shape[0]))
    bar.close()
    atomic_write_text(out / MANIFEST, dumps({**plan, "k": k, "shards": shards}, indent=1) + "\n")
    return out


def _write_shard(path: Path, teacher: Any, part: torch.Tensor, k: int, dtype: torch.dtype, micro_batch: int,
                 device: str, autocast_for: Any) -> None:
    ids, logp, tail = [], [], []
    for a in range(0, part.shape[0], micro_batch):
        with autocast_for():
            i, lp, t = teacher_targets(teacher, part[a:a + micro_batch, :-1].to(device), k)
        ids.append(i.to(torch.int32).cpu())
        logp.append(lp.to(dtype).cpu())
        tail.append(t.float().cpu())
    tensors = {"blocks": part.to(torch.int32).contiguous(), "top_ids": torch.cat(ids), "top_logp": torch.cat(logp),
               "tail_logp": torch.cat(tail)}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))


class TeacherCache:
    """A finished cache, opened for reading: look blocks up by content."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not (self.path / MANIFEST).is_file():
            why = "unfinished (rerun the teacher-cache command)" if (self.path / PLAN).is_file() else "no cache there"
            raise UserError(f"--teacher-cache {self.path}: {why}")
        self.manifest = m = _read(self.path, MANIFEST)
        if m.get("format") != FORMAT:
            raise UserError(f"--teacher-cache {self.path}: format {m.get('format')!r}, expected {FORMAT}")
        self.k, self.seq_len = m["k"], m["seq_len"]
        self._files = [open_safetensors(self.path / s["file"]) for s in m["shards"]]
        self.index: dict[bytes, tuple[int, int]] = {}
        for f, st in enumerate(self._files):
            for r, b in enumerate(st.get_tensor("blocks")):
                self.index[block_key(b)] = (f, r)

    def identity(self) -> dict[str, Any]:
        """What a run directory records (and a resumed run must match)."""
        return {key: self.manifest[key] for key in ("k", "dtype", "teacher_sha256", "tokenizer_sha256")}

    def check_for(self, teacher: Path, seq_len: int, tokenizer: Path | None = None) -> None:
        """Refuse a cache of another teacher, tokenizer or seq_len (what the flags tell, before any work)."""
        where = f"--teacher-cache {self.path}"
        if seq_len != self.seq_len:
            raise UserError(f"{where}: built for seq_len {self.seq_len}, the run uses {seq_len}")
        now = teacher_hashes(teacher, tokenizer)
        for key, what in (("teacher_sha256", "weights"), ("tokenizer_sha256", "tokenizer")):
            if now[key] != self.manifest[key]:
                raise UserError(f"{where}: built for another teacher ({what} hash {self.manifest[key]}, "
                                f"{teacher} has {now[key]})")

    def check(self, teacher: Path, blocks: BlockStream | torch.Tensor, tokenizer: Path | None = None) -> None:
        """Refuse a cache of another teacher or tokenizer, seq_len, or one that lacks a block of the run."""
        where = f"--teacher-cache {self.path}"
        self.check_for(teacher, (blocks.seq_len if isinstance(blocks, BlockStream) else blocks.shape[1]) - 1, tokenizer)
        if len(blocks) > len(self.index):  # before a block is made: the run needs more than the cache holds
            raise UserError(f"{where}: holds {len(self.index)} blocks, the run trains on {len(blocks)} (build it with "
                            "this run's data, seq-len, steps, batch and seed)")
        for k, chunk in enumerate(blocks.chunks() if isinstance(blocks, BlockStream) else blocks.split(1024)):
            for i, b in enumerate(chunk):
                if block_key(b) not in self.index:
                    raise UserError(f"{where}: built for other training blocks (block {k * 1024 + i} of this run is "
                                    "not in it; build it with this run's data, seq-len, steps, batch and seed)")

    def lookup(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top_ids [b, T, k] int64, top_logp [b, T, k], tail_logp [b, T]) of blocks [b, T + 1]."""
        rows = [self.index[block_key(b)] for b in blocks]

        def get(name: str) -> torch.Tensor:
            return torch.cat([self._files[f].get_slice(name)[r:r + 1] for f, r in rows])

        return get("top_ids").long(), get("top_logp"), get("tail_logp")


# -- `dtpshard teacher-cache`'s work (the command: dtpshard/commands/training.py) ------------------
def cache_teacher(teacher: Path, out: Path, k: int = 64, dtype: str = "float16", seeds: list[int] | None = None,
                  steps: int = 1000, seq_len: int = 1024, micro_batch: int = 4, grad_accum: int = 4, nproc: int = 1,
                  text: list[str] | None = None, dataset: str | None = None, text_field: str = "text",
                  tokenizer: Path | None = None, device: str = "auto", progress: bool = True,
                  force: bool = False) -> tuple[Path, int]:
    """The teacher's top-k cache of the training blocks of distill runs with these settings, built
    or resumed in `out` -> (its path, the blocks it holds)."""
    check_outputs({"--out": out}, {"the teacher directory": teacher, "the tokenizer directory": tokenizer,
                                   "the training text": text, "the dataset": local_paths([dataset])})
    if Path(out).is_dir() and any(Path(out).iterdir()) and force:  # --force rebuilds only a teacher cache
        check_replaceable(Path(out), is_cache, "a teacher cache (with a plan.json or manifest.json)", force=True)
    ckpt = open_checkpoint(teacher)  # config.json read once, for the blocks and the cache alike
    blocks = cache_blocks(ckpt, seeds or [0], steps, seq_len, micro_batch, grad_accum, nproc, text, dataset,
                          text_field, tokenizer)
    path = build_cache(ckpt, blocks, Path(out), k, dtype, micro_batch, pick_device(device), "auto", progress,
                       force, tokenizer)
    return path, len(unique_blocks(blocks))


def cache_blocks(teacher: Path | Checkpoint, seeds: list[int], steps: int, seq_len: int, micro_batch: int,
                 grad_accum: int, nproc: int, text: list[str] | None, dataset: str | None, text_field: str = "text",
                 tokenizer: Path | None = None) -> torch.Tensor:
    """Every training block of the distill runs with these settings, one run per seed (tokenized as
    distill tokenizes them: the tokenizer picked by the teacher's config)."""
    ckpt = opened(teacher)
    tok = ckpt.tokenizer(tokenizer)
    parts = []
    for seed in seeds:
        cfg = DistillConfig(teacher=ckpt.path, out=Path("."), steps=steps, seq_len=seq_len,
                            micro_batch=micro_batch, grad_accum=grad_accum, text=text, dataset=dataset, seed=seed,
                            text_field=text_field, tokenizer=None if tokenizer is None else Path(tokenizer))
        stream = train_blocks_for(cfg, nproc, tok, ckpt)[0]
        parts.append(stream.window(0, len(stream)))
    return torch.cat(parts)


def opened(teacher: Path | Checkpoint) -> Checkpoint:
    """The teacher as an open Checkpoint: the command's own, or opened now from its directory."""
    return teacher if isinstance(teacher, Checkpoint) else open_checkpoint(teacher)
