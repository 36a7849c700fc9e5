"""A `convert` directory as data, and what a rerun trusts in it (training/convert.py runs the stages).

DIR/convert.json records the settings of every stage under the first stage whose result it
changes (a rerun must match those of the stages begun), the teacher's weight files by content,
and each file stage 1 and 2 published (the affinity file, the layout) by content
(training/inputs.py). A rerun skips a stage only over output it checked: a published file must
hash as recorded, the run's own record (RUN/config.json) must match the teacher and the layout
now, a finished run's student must be whole (rundir.verify_student). Anything else is one line
naming the file, before any stage runs.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from dtpshard.affinity.calibrate import CalibrationData, PassSettings
from dtpshard.core import owned
from dtpshard.core.errors import UserError
from dtpshard.core.io import atomic_write_text, dumps, read_json_object
from dtpshard.training import inputs
from dtpshard.training.settings import DistillConfig, compared_fields

FORMAT = "dtpshard.convert/1"
RECORD, AFFINITY, LAYOUT, RUN, STUDENT, TIMINGS = ("convert.json", "affinity.safetensors", "layout.json", "run",
                                                   "student", "timings.json")
CARD_BYTES = 16 << 20  # a model card, read to extend it
DOWNSTREAM = "downstream.json"  # `--tasks`: the student's benchmark accuracy against its teacher, per item
OWNED = (RECORD, AFFINITY, LAYOUT, RUN, STUDENT, TIMINGS, DOWNSTREAM)
STAGES = ("calibration", "layout", "distillation", "student")
WHAT = "a dtpshard convert directory"
COMMAND = "convert"
INPUTS, OUTPUTS = "inputs", "outputs"  # convert.json's records of the teacher and of stages 1 and 2's files


class Paths:
    """DIR's files."""

    def __init__(self, out: Path):
        self.out = Path(out)
        (self.record, self.affinity, self.layout, self.run, self.student, self.timings,
         self.downstream) = (self.out / n for n in OWNED)

    def begun(self) -> int:
        """How many stages have begun (their output, or for the distillation its config.json, exists)."""
        marks = [self.affinity, self.layout, self.run / "config.json", self.student]
        return max((i + 1 for i, p in enumerate(marks) if os.path.lexists(p)), default=0)

    def published(self) -> dict[str, Path]:
        """Stage 1 and 2's files, by their key in the record."""
        return {AFFINITY: self.affinity, LAYOUT: self.layout}


# -- the settings record ----------------------------------------------------------------------
def _absolute(p: Any) -> str | None:
    return None if p is None else str(Path(p).absolute())


def _absolutes(paths: list[str] | None) -> list[str] | None:
    return None if paths is None else [str(_absolute(t)) for t in paths]


def record(cfg: DistillConfig, data: CalibrationData, run: PassSettings, proxy: str,
           sharing: Any = None, delaying: Any = None) -> dict[str, Any]:
    """Every compared setting, in the section of the first stage whose result it changes (cfg
    resolved: L and δ given). A setting shared by stages (--seq-len, --seed, the data) is in the
    first. `sharing`: convert.Sharing, recorded where some neurons are shared (a directory made
    before --shared existed shares none)."""
    calibration = {"teacher": _absolute(cfg.teacher), "delay": cfg.delay, "proxy": proxy, "dtype": run.dtype,
                   **dataclasses.asdict(data), "text": _absolutes(data.text), "tokenizer": _absolute(data.tokenizer)}
    layout = {"devices": cfg.devices}
    if sharing is not None and sharing.shared:
        layout.update(shared=sharing.shared, shared_by=sharing.shared_by)
    if delaying is not None and delaying.delayed is not None:  # a directory made before --delayed delays all
        layout.update(delayed=delaying.delayed)
        if delaying.delayed_by is not None:  # a share's rule (a listed set has none)
            layout.update(delayed_by=delaying.delayed_by)
    earlier = set(calibration) | set(layout)
    distillation = {k: getattr(cfg, k) for k in compared_fields(DistillConfig) if k not in earlier}
    distillation.update(save_dtype=cfg.save_dtype, max_shard_size=cfg.max_shard_size,
                        eval_text=_absolutes(cfg.eval_text))
    return json.loads(dumps({"format": FORMAT, "calibration": calibration, "layout": layout,
                             "distillation": distillation}))


def check_record(p: Paths, new: dict[str, Any]) -> dict[str, Any] | None:
    """The record of DIR's stages begun (None: none has); a rerun whose settings differ in a stage
    that has begun is refused in one line naming them."""
    from dtpshard.training.rundir import config_differences

    begun = p.begun()
    if not begun:
        return None
    if not p.record.is_file():
        raise UserError(f"--out {p.out}: has convert's files but no {RECORD} (use --force to start it over)")
    try:
        old = read_json_object(p.record, "convert record")
    except UserError as e:
        raise UserError(f"{e}; use --force to start over") from None
    if old.get("format") != FORMAT:
        raise UserError(f"{p.record}: format {old.get('format')!r}, not {FORMAT!r}; use --force to start over")
    sections = ("calibration", "layout", "distillation")[:begun]  # the student stage has no settings of its own

    def flat(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for s in sections if isinstance(r.get(s), dict) for k, v in r[s].items()}

    diff = config_differences(flat(old), flat(new), list(flat(new)))
    if diff:
        raise UserError(f"--out {p.out} was made with different settings: {'; '.join(diff)} "
                        "(use --force to start it over, or another --out)")
    return old


def check_dir(out: Path, force: bool) -> None:
    """DIR is new, empty or convert's own; another command's directory is never taken for one."""
    from dtpshard.training.rundir import refuse_foreign, refuse_unrelated

    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    refuse_foreign(out, FORMAT.split("/")[0] + "/", WHAT)  # a model's, a run's or an experiment's config.json
    if (out / "config.json").exists():
        raise UserError(f"--out {out}: holds a config.json, so it is not {WHAT}; choose another --out")
    refuse_unrelated(out, force, OWNED, WHAT, record=RECORD)


def claim(p: Paths, force: bool) -> str:
    """DIR's id (core/owned.py): its own when DIR is convert's; a new one when DIR holds none of
    convert's files yet, or after --force removed them (only from a DIR that is convert's own)."""
    from dtpshard.training.rundir import RUN_TREE, start_over

    inside = {RUN: RUN_TREE, STUDENT: owned.sealed(COMMAND)}  # what --force may remove, at every depth
    if force:
        return start_over(p.out, OWNED, inside, command=COMMAND, record=RECORD)
    return owned.claim(p.out, COMMAND, OWNED, RECORD, False, inside)


# -- what a rerun trusts ------------------------------------------------------------------------
def trusted(p: Paths, old: dict[str, Any] | None, teacher: Path, tokenizer: Path | None = None) -> dict[str, Any]:
    """{inputs, outputs} to record: the teacher's weight files (checked against `old`, the record
    of a rerun, else hashed now) and stage 1 and 2's published files, each checked against its
    recorded hash. A published file the record does not hold yet (a kill between its publication
    and the record's) is checked as its stage's output and recorded now."""
    files = inputs.run_files(teacher, None, tokenizer)
    if old is None:
        return {INPUTS: inputs.record(files), OUTPUTS: {}}
    inputs.check_unchanged(old.get(INPUTS), files, str(p.out))
    outputs = dict(old.get(OUTPUTS) or {})
    for key, path in p.published().items():
        if not os.path.lexists(path):
            outputs.pop(key, None)
        elif key in outputs:
            inputs.check_unchanged({key: outputs[key]}, {key: path}, str(p.out))
        else:
            verify_output(p, key)
            outputs.update(inputs.record({key: path}))
    return {INPUTS: old[INPUTS], OUTPUTS: outputs}


def verify_output(p: Paths, key: str) -> None:
    """Stage 1 or 2's file, read as the next stage reads it: the affinity file's header, the layout whole."""
    if key == AFFINITY:
        from dtpshard.affinity.file import is_affinity_file

        if not is_affinity_file(p.affinity):
            raise UserError(f"{p.affinity}: not an affinity file; use --force to start over")
    else:
        from dtpshard.core.layout import Layout

        Layout.load(p.layout)


def save(p: Paths, settings: dict[str, Any], state: dict[str, Any], published: str | None = None) -> None:
    """convert.json: the settings and `state` (`trusted`'s), with the file stage `published` now
    made recorded by content."""
    if published is not None:
        state[OUTPUTS].update(inputs.record({published: p.published()[published]}))
    atomic_write_text(p.record, dumps({**settings, **state}, indent=1) + "\n")


def distilled(p: Paths, teacher: Path, tokenizer: Path | None = None) -> bool:
    """Whether stage 3 is done: a finished run whose student is whole, made from this teacher and
    this layout file (its config.json's record of them checked now)."""
    from dtpshard.training.rundir import check_finished, is_done

    if not is_done(p.run):
        return False
    check_finished(p.run)
    inputs.run_inputs(p.run, True, teacher, p.layout, True, tokenizer)
    return True


def student_done(p: Paths, run_done: bool) -> bool:
    """Whether stage 4 is done: DIR/student is there, whole, and its run finished."""
    from dtpshard.training.rundir import verify_student

    if not os.path.lexists(p.student):
        return False
    if not run_done:
        raise UserError(f"{p.student}: exists but {p.run} is not finished; use --force to start over")
    try:
        verify_student(p.student)
    except UserError as e:
        raise UserError(f"{p.student}: is damaged ({str(e)[:200]}); use --force to start over") from None
    return True
