"""`dtpshard permute`: a layout-permuted copy of a Hugging Face checkpoint, streamed tensor by tensor.

A permutation changes no tensor's name, dtype, shape or size, so every weight file is rewritten
as itself: the same header bytes (names, dtypes, shapes, offsets, metadata), then each tensor's
bytes gathered by the layout or copied. One tensor is in memory at a time, whatever the model's
size. Every other file (index, config, tokenizer, README...) is copied byte for byte: sending
config.json through transformers would modernise it (rope_scaling -> rope_parameters, torch_dtype
-> dtype), which an older transformers, as inference servers often pin, silently misreads.
"""
from __future__ import annotations

import json as _json
import os
from pathlib import Path

import torch

from dtpshard.core.errors import UserError, explain, first_line
from dtpshard.core.guard import check_outputs, check_replaceable
from dtpshard.core.io import (
    ANY_SIZE,
    atomic_dir,
    check_writable_dir,
    dumps,
    open_regular,
    open_safetensors,
)
from dtpshard.core.layout import PERMUTE_COMMAND, PERMUTED_JSON, Layout, is_layout_file
from dtpshard.core.lock import one_writer
from dtpshard.core.memory import size_text
from dtpshard.core.owned import MARK, read_mark, refuse, refuse_link, seal, sealed
from dtpshard.core.permutation import stored_indices
from dtpshard.core.signals import exit_on_sigterm
from dtpshard.model.checkpoint import is_student, open_checkpoint
from dtpshard.model.dense_only import dense_only
from dtpshard.model.tensor_files import canonical, tensor_names

COMMAND = PERMUTE_COMMAND  # its output directory's mark (core/owned.py)
LAYOUT_JSON = PERMUTED_JSON  # the applied layout, saved next to the permuted weights
CHECK_TOL = 1e-4  # --check logits: max |Δlogits| relative to max |logit|, fp32 (docs/design.md §3)
_CHUNK = 16 << 20  # bytes per read when copying or comparing an unpermuted tensor
OTHER_BYTES = 1 << 40  # a file copied beside the weights (an original/*.pth may be large, none is a TiB)

Gathers = dict[str, tuple[int, torch.Tensor]]


def is_permuted_checkpoint(path: Path) -> bool:
    """Whether `path` is a directory `permute` wrote (its mark, core/owned.py, and a dtpshard
    layout.json): the only kind of directory `permute --force` replaces."""
    return read_mark(Path(path), COMMAND) is not None and is_layout_file(Path(path) / LAYOUT_JSON)


def _refuse_foreign_files(out: Path) -> None:
    """--force swaps the whole directory out: refused, naming it, when anything in it, at any
    depth, is not a file permute wrote there (one its mark does not list), or `out` is a link."""
    if out.is_symlink():
        raise refuse_link(out)
    first = sealed(COMMAND)(out) if out.is_dir() and read_mark(out, COMMAND) is not None else None
    if first is not None:
        raise refuse(first, f"the {MARK} of {out} does not list it")


@one_writer
def permute(model: Path, layout: Path, out: Path, force: bool = False, check: str = "construction",
            check_tokens: int = 256, tolerance: float = CHECK_TOL) -> dict:
    """`dtpshard permute`: write the permuted checkpoint of `model` under `layout` into `out`,
    checked as `check` says before it is renamed into place -> {model, layout, out, kind, devices,
    layout_sha256, weight_files, bytes, check: {kind, passed, ...}, said: [lines to print]}."""
    model, layout_path, out = Path(model), Path(layout), Path(out)
    if check_tokens < 1:
        raise UserError(f"--check-tokens {check_tokens}: must be at least 1")
    if not 0 < tolerance < float("inf"):
        raise UserError(f"--tolerance {tolerance}: must be a positive number")
    check_outputs({"--out": out}, {"the source model directory": model, "the layout": layout_path})
    if out.exists() and not out.is_dir():  # refused before the (long) read of the weights
        raise UserError(f"output {out} exists and is not a directory")
    if force:
        _refuse_foreign_files(out)
    check_replaceable(out, is_permuted_checkpoint, f"a permuted checkpoint (with a {LAYOUT_JSON})", force=force)
    ckpt = dense_only(open_checkpoint(model), "the model")
    lay = Layout.load(layout_path, ckpt.shape)
    lay.check_model(ckpt.shape, where=f"layout {layout_path} (model {model})")
    if ckpt.shape.shared:  # its shared neurons are last already: another permutation would move them
        raise UserError(f"{model} already holds {ckpt.shape.shared} shared neurons a layer, last; permute the dense "
                        "model it was made from")
    check_writable_dir(out, create=False)
    gathers = stored_indices(ckpt.shape, lay, fused=not is_student(ckpt.hf_config))
    weights = ckpt.files.files
    said: list[str] = []  # printed once the output is in place: a refused publish reports no success
    say = said.append
    try:
        # atomic_dir also removes what killed runs left behind; SIGTERM removes this run's temporary.
        with exit_on_sigterm(), atomic_dir(out, force=force) as tmp:
            others = copy_other_files(model, tmp, skip=set(weights) | {out})
            counts = [0, 0]
            for src in weights:
                for i, n in enumerate(permute_file(src, tmp / src.name, gathers)):
                    counts[i] += n
            (tmp / LAYOUT_JSON).write_text(dumps(lay.to_json(), indent=1) + "\n")
            seal(tmp, COMMAND)  # what a later --force may replace
            if check == "construction":
                for src in weights:
                    check_file(src, tmp / src.name, gathers)
                summary = {"kind": "construction", "tensors": sum(counts), "gathered": counts[0], "copied": counts[1],
                           "other_files": others}
                say(f"check: all {sum(counts)} tensors of {len(weights)} weight file(s) read back equal, bit for "
                      f"bit, to the source ({counts[0]} gathered by the layout's indices, {counts[1]} copied); "
                      f"{others} other file(s) copied byte for byte")
            elif check == "logits":
                summary = check_logits(model, tmp, ckpt, check_tokens, tolerance, say)
            else:
                summary = {"kind": "none"}
                say("check: none (--check none): nothing was read back")
    except OSError as e:
        raise UserError(explain(e) or f"cannot write {out}: {e}") from None
    size = sum(f.stat().st_size for f in weights)
    said.append(f"{lay.kind} layout (L = {lay.devices}) applied to {model} -> {out} "
                f"({len(weights)} weight file(s), {size_text(size)})")
    return {"model": str(model), "layout": str(layout_path), "out": str(out), "kind": lay.kind,
            "devices": lay.devices, "layout_sha256": lay.content_sha256(), "weight_files": len(weights),
            "bytes": size, "check": {**summary, "passed": True}, "said": said}


# -- the weights, one tensor at a time ----------------------------------------------------------
def read_header(file: Path) -> tuple[bytes, list[tuple[str, int, int]]]:
    """A safetensors file's header as stored (length prefix included) and its tensors as (name,
    start, end) byte ranges of the data section, in file order. The file is first opened with
    safetensors itself, which refuses a damaged one."""
    names = tensor_names(file)
    with open_regular(file, ANY_SIZE, "weight file") as f:
        n = int.from_bytes(f.read(8), "little")  # the format: u64 little-endian length, JSON, data
        head = f.read(n)
    entries = _json.loads(head)
    ranges = sorted((entries[k]["data_offsets"][0], entries[k]["data_offsets"][1], k) for k in names)
    return len(head).to_bytes(8, "little") + head, [(k, a, b) for a, b, k in ranges]


def permute_file(src: Path, dst: Path, gathers: Gathers) -> tuple[int, int]:
    """Write safetensors file `src` to `dst` with each tensor named in `gathers` permuted and the
    rest copied; returns (permuted, copied) tensor counts. Peak memory: about the largest
    permuted tensor twice (its source pages and its gathered copy)."""
    head, ranges = read_header(src)
    counts = [0, 0]
    with open_regular(src, ANY_SIZE, "weight file") as fin, open(dst, "wb") as fout:
        fout.write(head)
        for name, start, end in ranges:
            if fout.tell() != len(head) + start:  # safetensors stores tensors back to back
                raise UserError(f"{src}: tensor {name} is not stored where the previous one ends")
            gather = gathers.get(canonical(name))
            if gather is None:
                fin.seek(len(head) + start)
                _copy_bytes(fin, fout, end - start)
            else:
                # A handle per tensor: the pages it maps are released when it closes.
                with open_safetensors(src) as st:
                    t = st.get_tensor(name).index_select(*gather)
                    fout.write(_as_bytes(t).numpy())
                    del t
            counts[gather is None] += 1
        fout.flush()
        os.fsync(fout.fileno())
    return counts[0], counts[1]


def check_file(src: Path, dst: Path, gathers: Gathers) -> None:
    """`dst` read back has `src`'s header (names, dtypes, shapes, offsets, metadata), its copied
    tensors byte for byte and its permuted ones equal, bit for bit, to the source's gathered by
    the layout's indices; else UserError. Memory: the largest permuted tensor three times."""
    head, ranges = read_header(src)
    if read_header(dst)[0] != head:
        raise UserError(f"{dst.name}: its header differs from {src}'s; nothing written")
    with open_regular(src, ANY_SIZE, "weight file") as a, open_regular(dst, ANY_SIZE, "weight file") as b:
        for name, start, end in ranges:
            gather = gathers.get(canonical(name))
            if gather is None:
                a.seek(len(head) + start)
                b.seek(len(head) + start)
                same = _same_bytes(a, b, end - start)
            else:
                with open_safetensors(src) as s, open_safetensors(dst) as d:
                    want = s.get_tensor(name).index_select(*gather)
                    same = torch.equal(_as_bytes(d.get_tensor(name)), _as_bytes(want))
            if not same:
                raise UserError(f"{dst.name}: tensor {name} read back differs from the source gathered by the "
                                "layout; nothing written")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (bf16 and fp8 have no numpy dtype; bytes compare NaNs and -0 exactly)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _copy_bytes(fin, fout, count: int) -> None:  # binary files
    buf = memoryview(bytearray(min(_CHUNK, count)))
    while count:
        n = fin.readinto(buf[:min(len(buf), count)])
        if not n:
            raise UserError(f"{fin.name}: file ends before its header says")
        fout.write(buf[:n])
        count -= n


def _same_bytes(a, b, count: int) -> bool:  # binary files
    while count:
        n = min(_CHUNK, count)
        if a.read(n) != b.read(n):
            return False
        count -= n
    return True


# -- every other file, byte for byte ----------------------------------------------------------------
def copy_other_files(src: Path, dst: Path, skip: set[Path]) -> int:
    """Copy every file under `src` but the weight files (and a --out inside it) byte for byte;
    hidden folders (.git, huggingface_hub's .cache) stay behind. Returns the number copied."""
    skip_resolved = {p.resolve() for p in skip}
    copied = 0
    for root, dirs, files in os.walk(src, followlinks=True):
        here = Path(root)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and (here / d).resolve() not in skip_resolved)
        for name in sorted(files):
            if (here / name).resolve() in skip_resolved:
                continue
            rel = (here / name).relative_to(src)
            target = dst / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            # follows links (a hub snapshot's files are links to blobs); a FIFO or a device is refused
            with open_regular(here / name, OTHER_BYTES, "file beside the weights", f"{src}: {rel}") as fin, \
                    open(target, "wb") as fout:
                _copy_bytes(fin, fout, os.fstat(fin.fileno()).st_size)
            copied += 1
    return copied


# -- the optional forward check ------------------------------------------------------------------
def check_logits(original: Path, permuted: Path, ckpt, tokens: int, tolerance: float,
                 say=print) -> dict:
    tokens = min(tokens, getattr(ckpt.hf_config, "max_position_embeddings", None) or tokens)
    diff, scale = dense_logits_diff(original, permuted, tokens, ckpt.shape.vocab)
    rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
    say(f"check: max |logits(permuted) - logits(original)| = {diff:.3g} = {rel:.3g} x max |logit| {scale:.3g} "
          f"over {tokens} tokens (fp32, relative tolerance {tolerance:g})")
    if not diff <= tolerance * scale:  # also catches NaN
        raise UserError(f"permuted logits differ from the original by {diff:.3g} = {rel:.3g} x max |logit| "
                        f"{scale:.3g} > --tolerance {tolerance:g}; nothing written")
    return {"kind": "logits", "max_abs_diff": diff, "max_abs_logit": scale, "tokens": tokens, "tolerance": tolerance}


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

    from dtpshard.model.pretrained import load

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the check's output is its one printed line
    hf_logging.disable_progress_bar()
    try:
        hf = load(AutoModelForCausalLM, path, dtype=torch.float32, attn_implementation="eager")
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        first = first_line(e)
        raise UserError(f"transformers cannot load {what} ({first})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    with torch.inference_mode():
        return hf.eval()(ids).logits.float()  # [1, T, V]
