"""A distillation run directory that explains itself and survives a kill at any moment.

    RUN/config.json     the resolved configuration (written once; a rerun must match it)
    RUN/metrics.jsonl   one JSON object per line: {"kind": "train", ...} and {"kind": "eval", ...}
    RUN/checkpoint.pt   the last good checkpoint (one file, replaced atomically by rename)
    RUN/checkpoint.dcp/ instead, with --fsdp: each rank's shards (fsdp.py)
    RUN/final/          the student (DTPModel.save_pretrained), written when training ends
    RUN/memory.json     the memory plan per process and each rank's measured peak per phase
    RUN/DONE            written last, atomically
    RUN/.lock           flock'ed by the one process that owns the run (released when it dies)

A checkpoint records the byte length of metrics.jsonl when it was taken; resuming truncates
the file there, so rows written after the last checkpoint (and a half-written last line) are
dropped and recomputed identically.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dtpshard.core.errors import UserError
from dtpshard.core.io import (
    atomic_path,
    atomic_write_text,
    dumps,
    read_json,
    remove_stale_temporaries,
)
from dtpshard.core.lock import LOCK, is_lock, locked, not_a_lock  # noqa: F401 (a run's lock; importable here)
from dtpshard.core.owned import (
    ID,
    MARK,
    Inside,
    claim,
    is_leftover,
    is_ours,
    own_entries,
    read_mark,
    refuse_linked,
    refuse_other,
    sealed,
)
from dtpshard.core.temporary import temporary_of
from dtpshard.training.metrics import METRICS, METRICS_BYTES, Metrics, NoMetrics, metrics_for, read_metrics  # noqa: F401
from dtpshard.training.settings import FORMAT, compared_keys

CONFIG = "config.json"
CHECKPOINT = "checkpoint.pt"
SHARDED_CHECKPOINT = "checkpoint.dcp"
FINAL = "final"
DONE = "DONE"
MEMORY = "memory.json"
ADAPTERS = "adapters"  # an adapter run's adapters alone (peft's LoRA files), beside the merged student
OWNED = (CONFIG, METRICS, CHECKPOINT, SHARDED_CHECKPOINT, FINAL, ADAPTERS, MEMORY, DONE)


def _show(v: Any) -> str:
    return dumps(v) if not isinstance(v, str) else v


def config_differences(old: dict[str, Any], new: dict[str, Any], keys: list[str]) -> list[str]:
    """'name OLD (now NEW)' for every compared setting that differs. A content hash that differs
    names what it is the hash of and shows both hashes: the file or data may have the same name
    and description and still hold something else."""
    out = []
    for k in keys:
        if old.get(k) == new.get(k):
            continue
        if k == "train_data_sha256" and old.get("train_blocks") != new.get("train_blocks"):
            continue  # the fingerprint covers the blocks a run takes: --steps or the batch moved it, not the corpus
        base = k.removesuffix("_sha256")
        if base != k and base in new:
            hashes = f"sha256 {_show(old.get(k))}, now {_show(new.get(k))}"
            if old.get(base) == new.get(base):
                out.append(f"{base} {_show(new.get(base))}: content changed ({hashes})")
            else:
                out.append(f"{base} content changed ({_show(old.get(base))} vs now {_show(new.get(base))}; {hashes})")
        else:
            out.append(f"{k} {_show(old.get(k))} (now {_show(new.get(k))})")
    return out


def refuse_foreign(out: Path, expect: str = "", what: str = "a distillation run") -> None:
    """--force removes a run's config.json among its files: never one that is not this command's
    (a model directory's, an experiment's when distilling, a run's when running an experiment).
    `expect`: the command's format prefix (default distill's). A damaged config.json may be ours and
    is left to --force."""
    if not expect:
        expect = FORMAT.split("/")[0] + "/"
    if out.is_dir():
        refuse_other(out, expect.removeprefix("dtpshard.").removesuffix("/"))  # its mark: another command's
    try:
        old = read_json(out / CONFIG, "run config")
    except (OSError, UserError):  # damaged, or beyond the bounds of a config: left to --force
        return
    if not isinstance(old, dict):
        return
    fmt = str(old.get("format", ""))
    if not fmt.startswith("dtpshard."):
        raise UserError(f"--out {out}: its {CONFIG} is not a dtpshard run's (a model directory?); "
                        "choose another --out")
    if not fmt.startswith(expect):
        raise UserError(f"--out {out}: is a dtpshard {fmt.split('/')[0].removeprefix('dtpshard.')} directory, "
                        f"not {what}; choose another --out")


def _ours(p: Path, owned: tuple[str, ...]) -> bool:
    """One of the directory's own names: its files, its mark, a lock dtpshard made (a user's own
    `.lock` is the user's content) or a kill's leftover temporary."""
    return p.name in owned or p.name == MARK or p.name == LOCK and is_lock(p) or is_leftover(p.name, owned)


def refuse_unrelated(run: Path, force: bool, owned: tuple[str, ...] = OWNED, what: str = "a dtpshard run",
                     record: str = CONFIG) -> None:
    """A directory without its record (config.json) must be new or empty (but for its own names,
    `owned`): a run's files are never written beside someone else's, unless --force says so."""
    if force or not run.is_dir() or (run / record).exists():
        return
    if os.path.lexists(run / LOCK) and not is_lock(run / LOCK):  # a user's .lock is the user's content
        raise not_a_lock(run / LOCK, run)
    other = sorted(p.name for p in run.iterdir() if not _ours(p, owned))
    if other:
        more = f" and {len(other) - 1} more" if len(other) > 1 else ""
        raise UserError(f"--out {run}: not empty and not {what} (holds {other[0]}{more}); "
                        "choose a new or empty directory, or --force to write beside those files")


def check_run(run: Path, config: dict[str, Any], compared: list[str], force: bool,
              added: dict[str, Any] | None = None) -> bool:
    """Whether RUN already holds this run (resume); refuse a RUN of other settings unless force.
    added: settings newer than some run directories, with the value those runs had implicitly.

    Read-only, so every rank of a data-parallel run can call it and fail the same way. With
    force it always starts over (a damaged checkpoint or config too)."""
    if run.exists() and not run.is_dir():
        raise UserError(f"--out {run}: exists and is not a directory")
    if force:  # distill() has refused another command's directory and unrelated files
        return False
    if run.is_dir():
        refuse_linked(run, (*OWNED, LOCK))
    if not (run / CONFIG).is_file():
        if run.is_dir() and any(p.name in OWNED for p in run.iterdir()):
            raise UserError(f"--out {run}: has run files but no {CONFIG} (use --force to start it over)")
        return False
    try:
        old = read_json(run / CONFIG, "run config")
    except UserError as e:
        raise UserError(f"{e}; use --force to start the run over") from None
    except OSError as e:
        raise UserError(f"{run / CONFIG}: unreadable ({e.strerror}); use --force to start the run over") from None
    if not isinstance(old, dict):
        raise UserError(f"{run / CONFIG}: not a JSON object; use --force to start the run over")
    diff = config_differences({**(added or {}), **old}, config, compared)
    if diff:
        raise UserError(f"--out {run} was made with different settings: {'; '.join(diff)} "
                        "(use --force to start it over, or another --out)")
    if not is_ours(run, "distill", CONFIG):  # a config.json copied or written here is not a run to resume
        raise UserError(f"{run / CONFIG}: was not written by dtpshard distill ({run} carries no {MARK} that it "
                        "agrees with); nothing was touched (choose another --out)")
    return True


def _sharded_checkpoint(d: Path) -> Path | None:
    """checkpoint.dcp/ (training/fsdp.py): LATEST and step directories of torch's sharded files."""
    for p in sorted(d.iterdir()):
        if p.name == "LATEST" and p.is_file() and not p.is_symlink():
            continue
        found = temporary_of(p.name)  # a step being written: core/temporary.py's name of it
        step = found[0] if found is not None else p.name
        if not (step.startswith("step-") and step[5:].isdigit()) or p.is_symlink() or not p.is_dir():
            return p
        inner = next((q for q in sorted(p.iterdir()) if q.is_symlink() or not q.is_file()
                      or not (q.suffix == ".distcp" or q.name in (".metadata", "extra.pt") or ".tmp-" in q.name)), None)
        if inner is not None:
            return inner
    return None


# What --force may remove in a run, at every depth: its own files by name, its student and adapters
# as sealed when they were written, its sharded checkpoint's step directories.
INSIDE: dict[str, Inside] = {FINAL: sealed("distill"), ADAPTERS: sealed("distill"),
                             SHARDED_CHECKPOINT: _sharded_checkpoint}
RUN_TREE = own_entries("distill", CONFIG, OWNED, INSIDE, extra=(LOCK,))  # a run inside another's directory


def start_over(run: Path, owned: tuple[str, ...] = OWNED, inside: dict[str, Inside] | None = None,
               command: str = "distill", record: str = CONFIG) -> str:
    """Remove this run's own files, `owned` (never anything else in the directory), and mark it
    anew: returns its new id, for its record (core/owned.py). Nothing is removed when the
    directory is not the command's own, or anything under one of them is not what the command
    wrote there (`inside`, default a run's INSIDE)."""
    dir_id = claim(run, command, owned, record, True, INSIDE if inside is None else inside)
    clean_temporaries(run, owned)
    return dir_id


def clean_temporaries(run: Path, owned: tuple[str, ...] = OWNED) -> None:
    """Leftovers of a kill during an atomic write (.NAME.tmp-PID files and directories whose
    process is gone; a name no process could have made is left alone)."""
    if not run.is_dir():
        return
    for name in owned:
        remove_stale_temporaries(run / name)


def run_id(run: Path) -> str | None:
    """The id of a run directory that is distill's own (core/owned.py), else None."""
    mark = read_mark(run, "distill")
    return mark["id"] if mark is not None else None


def write_config(run: Path, config: dict[str, Any]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run / CONFIG, dumps(config, indent=1, sort_keys=True) + "\n")


def is_done(run: Path) -> bool:
    return (run / DONE).is_file() and (run / FINAL).is_dir()


def verify_student(path: Path) -> None:
    """A student (or any checkpoint dtpshard wrote) as a stage may skip or publish it: its
    config.json parses as a model's, its weights are all there and their headers read."""
    from dtpshard.model.checkpoint import open_checkpoint

    open_checkpoint(path)


def check_finished(run: Path) -> None:
    """A finished run is reported as finished only if its student is whole (`verify_student`)."""
    try:
        verify_student(run / FINAL)
    except UserError as e:
        raise UserError(f"{run}: marked finished ({DONE}), but its student is damaged ({str(e)[:200]}); "
                        "use --force to train it again") from None


def finish(run: Path, steps: int) -> None:
    """DONE (the last evaluation's numbers), then drop the checkpoint: a kill anywhere here is resumable."""
    last_eval = next((r for r in reversed(read_metrics(run)) if r["kind"] == "eval"), {})
    atomic_write_text(run / DONE, dumps({"steps": steps, "eval_kl": last_eval.get("eval_kl"),
                                         "eval_ppl": last_eval.get("eval_ppl")}) + "\n")
    remove_checkpoint(run)


def save_checkpoint(run: Path, state: dict[str, Any]) -> None:
    """torch.save to a temporary sibling, fsync, rename: the old checkpoint stays until the new one is whole."""
    with atomic_path(run / CHECKPOINT) as tmp:
        torch.save(state, tmp)


def check_state(path: Path, state: dict[str, Any], config: dict[str, Any], steps: int) -> None:
    """A checkpoint's extras (its step, wall time, metrics length, RNG, scheduler and the run's
    config) typed, and the checkpoint bound to this run: the run's settings and its directory's id
    (a checkpoint copied from another run, even of the same teacher, is not resumed), its step
    within --steps. One line naming the file; --force starts over."""
    def bad(why: str) -> UserError:
        return UserError(f"{path}: {why}; use --force to start the run over")

    kinds = {"step": int, "wall": (int, float), "metrics_bytes": int, "rng": dict, "scheduler": dict, "config": dict}
    for key, kind in kinds.items():
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise bad(f"no valid {key!r} (a damaged checkpoint)")
    saved = state["config"]
    if not isinstance(saved.get(ID), str) or not saved[ID]:  # proof of its run, never optional
        raise bad(f"holds no directory id ({ID!r}), so nothing binds it to this run (a checkpoint copied in?)")
    if saved[ID] != config.get(ID):
        raise bad("was written by another run (its directory id differs): a checkpoint copied in")
    diff = config_differences(saved, config, [k for k in compared_keys() if k in saved])
    if diff:
        raise bad(f"was written by a run of other settings ({'; '.join(diff)[:300]})")
    if not 0 < state["step"] <= steps:
        raise bad(f"its step {state['step']} is not within this run's 1..{steps}")
    if not 0 <= state["metrics_bytes"] <= METRICS_BYTES or not 0 <= state["wall"] < float("inf"):
        raise bad("its metrics length or wall time is out of range (a damaged checkpoint)")


def load_checkpoint(run: Path) -> dict[str, Any] | None:
    path = run / CHECKPOINT
    if not os.path.lexists(path):  # anything else there is the reader's to refuse by name
        return None
    from dtpshard.training.trust import load_state

    return load_state(path, "checkpoint")


def remove_checkpoint(run: Path) -> None:
    (run / CHECKPOINT).unlink(missing_ok=True)
    shutil.rmtree(run / SHARDED_CHECKPOINT, ignore_errors=True)
