"""`dtpshard convert`'s work (the command: dtpshard/commands/convert.py): from a dense checkpoint
to a DTP student ready to serve, as the library's stages in a row, each published atomically in DIR:

    DIR/convert.json          the settings of every stage (a rerun must match those of the stages begun)
    DIR/affinity.safetensors  1. the calibration pass (affinity/calibrate.py; one layer at a time when the
                                 model does not fit)
    DIR/layout.json           2. the optimised layout; its score also holds J of the contiguous layout and
                                 of a random one (seeded by --seed)
    DIR/run/                  3. the distillation run under that layout (training/distill.py: one process,
                                 --nproc K, --fsdp or torchrun; it resumes from its last checkpoint)
    DIR/student/              4. the student and its model card: hard links to DIR/run/final's files, and
                                 the card with the layout's J and the commands that serve it
    DIR/timings.json          seconds per stage

A rerun does the stages whose output is missing, stage 3 from its last checkpoint. A setting of a
stage that has begun (its output, or the run's config.json, exists) must be the same, or the
rerun is refused naming it; a stage is skipped only over output checked to be what it made
(training/convert_state.py); --force starts over, removing only convert's own files. Everything
the flags, the teacher's config.json and headers and the evaluation text can tell is checked
before stage 1 (`preflight`).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dtpshard.affinity.settings import CalibrationData, PassSettings
from dtpshard.core.delayed import check_delayed, parse_spec, resolve_delayed_by
from dtpshard.core.devices import config_dtype
from dtpshard.core.errors import UserError
from dtpshard.core.guard import check_outputs, local_paths
from dtpshard.core.io import (
    atomic_write_text,
    copy_regular,
    dumps,
    read_json,
    read_json_object,
    read_text,
)
from dtpshard.core.owned import ID, MARK, replacing
from dtpshard.model.student import serving_commands
from dtpshard.training import convert_state as state
from dtpshard.training.convert_downstream import benchmark_stage, check_tasks, kept_result, summary_of
from dtpshard.training.convert_state import (  # noqa: F401 (importable here)
    AFFINITY,  # noqa: F401 (importable here)
    CARD_BYTES,
    OWNED,
    STAGES,
    Paths,
    check_record,
)
from dtpshard.training.settings import (
    EVERY_MODULE,
    NO_SHARING,
    Delaying,
    DistillConfig,
    Sharing,
    check_config,
)

PROXY = "first-order"  # the paper's affinity: the layout optimises J under it


def _say(msg: str) -> None:  # progress on stderr; stdout is the result
    print(f"[convert] {msg}", file=sys.stderr, flush=True)


# -- the stages -------------------------------------------------------------------------------
@contextmanager
def _stage(p: Paths, k: int, what: str) -> Iterator[None]:
    name = STAGES[k - 1]
    _say(f"stage {k}/4 {name}: {what}")
    t0 = time.perf_counter()
    yield
    seconds = time.perf_counter() - t0
    times = read_json_object(p.timings, "timings") if p.timings.is_file() else {}
    before = times.get(name)
    times[name] = seconds + (before if isinstance(before, (int, float)) and not isinstance(before, bool) else 0.0)
    atomic_write_text(p.timings, dumps(times, indent=1) + "\n")
    _say(f"stage {k}/4 {name}: done in {seconds:.1f} s")


def calibrate_stage(p: Paths, pass_: Any, progress: bool) -> None:
    from dtpshard.affinity.calibrate import run_calibration

    with _stage(p, 1, pass_.describe()):
        run_calibration(pass_, PROXY, progress)




def layout_stage(p: Paths, cfg: DistillConfig, progress: bool, sharing: Sharing = NO_SHARING,
                 delaying: Delaying = EVERY_MODULE, data: CalibrationData | None = None) -> None:
    """The optimised layout from the published affinity file (float32 as saved, so a resumed run
    optimises the same numbers), with J of the contiguous layout and of a random one (each sharing
    the same neurons, where some are). A partial student (`delaying`): the modules chosen under the
    optimised layout (by sensitivity: measured on the first affinity.sensitivity.SENSITIVITY_BLOCKS calibration blocks),
    the layout refined for them, and the other two scored over the same modules' edges."""
    from dataclasses import replace

    from tqdm import tqdm

    from dtpshard.affinity.file import Affinity
    from dtpshard.layouts.make import make_layout
    from dtpshard.layouts.score import colocated_score

    with _stage(p, 2, f"optimised layout for L = {cfg.devices}, δ = {cfg.delay}"):
        affinity = Affinity.load(p.affinity, delay=cfg.delay)
        made = {}
        for kind in tqdm(("optimised", "contiguous", "random"), desc="layout", disable=not progress):
            made[kind] = make_layout(affinity.model, cfg.dtp, kind, affinity=affinity, seed=cfg.seed,
                                     shared=sharing.shared, shared_by=sharing.shared_by)
        if delaying.delayed is not None:
            from dtpshard.layouts.delayed import measure_for_layout, partial_layout

            sens = None
            if delaying.delayed_by == "sensitivity":  # resolved: a share's rule
                from dtpshard.affinity.sensitivity import SENSITIVITY_BLOCKS
                from dtpshard.layouts.delayed import sensitivity_ids

                d = data or calibration_settings(cfg)[0]
                ids = sensitivity_ids(cfg.teacher, d.text, d.dataset, blocks=min(d.blocks, SENSITIVITY_BLOCKS),
                                      seq_len=d.seq_len, seed=d.seed, text_field=d.text_field, tokenizer=d.tokenizer)
                _say(f"sensitivity: one forward per module on {len(ids)} blocks")
                sens = measure_for_layout(cfg.teacher, made["optimised"], cfg.dtp, ids, progress=progress)
            made["optimised"] = partial_layout(made["optimised"], delaying.delayed, delaying.delayed_by,
                                               affinity=affinity, sensitivity=sens, seed=cfg.seed)
            for kind in ("contiguous", "random"):  # scored over the same delayed modules' edges
                made[kind] = replace(made[kind], delayed=made["optimised"].delayed)
                made[kind].score["J"] = colocated_score(affinity, made[kind])["J"]
        layout = made["optimised"]
        layout.score.update(affinity=AFFINITY, contiguous_J=made["contiguous"].score["J"],
                            random_J=made["random"].score["J"], random_seed=cfg.seed)
        layout.save(p.layout)
        s = layout.score
        _say(f"J = {s['J']:.4f} optimised, {s['contiguous_J']:.4f} contiguous, {s['random_J']:.4f} random "
             f"(expectation {s['random_expectation']:.4f})")


def distill_stage(p: Paths, cfg: DistillConfig) -> None:
    from dtpshard.training.distill import distill

    with _stage(p, 3, f"{cfg.steps} steps under the layout, into {p.run}"):
        distill(run_config(p, cfg))


def run_config(p: Paths, cfg: DistillConfig) -> DistillConfig:
    """The distillation's settings: the command's, with the layout of stage 2 and its own directory."""
    return dataclasses.replace(cfg, out=p.run, layout=p.layout, force=False, plan=False)


def _place(src: Path, dst: Path) -> None:
    """A hard link (no second copy of the weights), a copy across file systems."""
    try:
        os.link(src, dst)
    except OSError:
        copy_regular(src, dst)


def student_stage(p: Paths, cfg: DistillConfig) -> None:
    """DIR/student/: the run's final/ (checked whole first: rundir.check_finished), hard-linked,
    with its card extended by the layout's J and the serving commands."""
    from dtpshard.core.layout import Layout
    from dtpshard.training.rundir import FINAL, check_finished

    final = p.run / FINAL
    check_finished(p.run)  # nothing is published that is not whole
    with _stage(p, 4, f"{p.student}"), replacing(p.student, state.COMMAND) as tmp:  # sealed: what --force may remove
        for f in sorted(final.iterdir()):
            if f.name in ("README.md", MARK):
                continue
            if f.is_dir():
                shutil.copytree(f, tmp / f.name, copy_function=_place)
            else:
                _place(f, tmp / f.name)
        score = Layout.load(p.layout).score
        card = read_text(final / "README.md", CARD_BYTES, "model card") if (final / "README.md").is_file() else ""
        (tmp / "README.md").write_text(card + _card_section(score, final), encoding="utf-8")


def serving(student: Path) -> dict[str, str]:
    """The commands that serve the student (model/student.py), for its L and stored dtype."""
    config = read_json_object(student / "config.json", "config")
    dtype = str(config_dtype(config) or "float32")
    return serving_commands(student, config["dtp"]["devices"], dtype)


def _card_section(score: dict[str, Any], student: Path) -> str:
    cmds = {k: v.replace(str(student), ".") for k, v in serving(student).items()}
    return (f"\n## Made by `dtpshard convert`\n\nThe layout optimised the co-located score J = {score['J']:.4f} "
            f"(contiguous {score['contiguous_J']:.4f}, random {score['random_J']:.4f}, random expectation "
            f"{score['random_expectation']:.4f}). Served from this directory:\n\n"
            f"- vLLM at tensor-parallel size L (dtpshard installed beside vllm): `{cmds['vllm']}`; with vLLM's "
            f"CPU build: `{cmds['vllm_cpu']}`\n"
            f"- transformers, one device: `{cmds['transformers']}`\n- dtpshard's runtime: `{cmds['dtpshard']}`\n")


# -- the command ------------------------------------------------------------------------------
@contextmanager
def _signals_end_in_one_line() -> Iterator[None]:
    """SIGTERM ends the run as Ctrl-C does (KeyboardInterrupt: the CLI's one line, exit 130), so
    each stage's temporaries are removed on the way out."""
    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop) if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN else None
    try:
        yield
    except SystemExit as e:  # SIGTERM inside an atomic write (core.signals.exit_on_sigterm), its temporary removed
        if e.code != 128 + signal.SIGTERM:
            raise
        raise KeyboardInterrupt from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def resolved(teacher: Path, cfg: DistillConfig) -> DistillConfig:
    """cfg with the teacher, L, δ and stage 3 resolved from config.json (no weight read)."""
    from dtpshard.core.settings import resolve_dtp
    from dtpshard.model.checkpoint import read_shape

    if cfg.layout is not None:
        raise UserError("--layout: convert makes its own layout (stage 2); drop --layout, or run distill")
    cfg = dataclasses.replace(cfg, teacher=Path(teacher).absolute(), out=Path(cfg.out).absolute())
    check_config(cfg)
    dtp = resolve_dtp(read_shape(cfg.teacher), devices=cfg.devices, delay=cfg.delay, stage3=cfg.stage3)
    return dataclasses.replace(cfg, devices=dtp.devices, delay=dtp.delay, stage3=dtp.stage3)


def resolved_delaying(delaying: Delaying) -> Delaying:
    """--delayed-by as it applies: a share's rule (by sensitivity when not given), None where nothing
    is chosen; a rule given where it would change nothing is refused (core/delayed.py)."""
    return dataclasses.replace(delaying, delayed_by=resolve_delayed_by(delaying.delayed, delaying.delayed_by))


def check_delaying(cfg: DistillConfig, delaying: Delaying) -> dict[str, Any]:
    """--delayed refused before stage 1 (cfg and `delaying` resolved): a share outside (0, 1],
    indices the teacher has not; returns the share of syncs the student removes (what --plan shows)."""
    from dtpshard.core.delayed import share_count
    from dtpshard.model.checkpoint import read_shape

    by = delaying.delayed_by
    M = read_shape(cfg.teacher).modules
    if delaying.delayed is None:
        count = M
    else:
        spec = parse_spec(delaying.delayed)
        count = len(check_delayed(spec, M) or range(M)) if isinstance(spec, tuple) else share_count(spec, M)
    how = "" if by is None else f" (chosen by {by})"
    return {"delayed": count, "modules": M, "syncs_removed": count / M,
            "describe": f"syncs removed: {count} of {M} modules delayed, {100 * count / M:.0f}% of the all-reduces"
                        f"{how}"}


def check_sharing(cfg: DistillConfig, sharing: Sharing) -> None:
    """--shared and --shared-by refused before stage 1 (cfg resolved): a fraction outside [0, 1), a
    count that leaves no sharded neuron or one --devices does not divide, an unknown rule."""
    from dtpshard.core.shape import check_shared, shared_count
    from dtpshard.layouts.make import SHARED_BY
    from dtpshard.model.checkpoint import read_shape

    if sharing.shared_by not in SHARED_BY:
        raise UserError(f"--shared-by {sharing.shared_by!r}: one of {', '.join(SHARED_BY)}")
    neurons = read_shape(cfg.teacher).neurons
    check_shared(neurons, cfg.devices, shared_count(neurons, cfg.devices, sharing.shared), "--shared: ")


def preflight(cfg: DistillConfig) -> None:
    """What stages 1 to 3 would refuse, refused before stage 1 (cfg resolved): the teacher's
    weights as data (their headers), --seq-len within its context, its tokenizer, the evaluation
    blocks (an empty --eval-text), the teacher cache and its fit to this teacher."""
    from dtpshard.core.shape import check_seq_len
    from dtpshard.model.checkpoint import open_checkpoint
    from dtpshard.training.evaluate import eval_blocks_for

    ckpt = open_checkpoint(cfg.teacher)
    check_seq_len(ckpt.hf_config, cfg.seq_len)
    tok = ckpt.tokenizer(cfg.tokenizer)
    eval_blocks_for(ckpt, cfg.eval_text, cfg.eval_dataset, cfg.eval_blocks, cfg.seq_len, tok, cfg.text_field,
                    named=cfg.tokenizer)
    if cfg.teacher_cache is not None:
        from dtpshard.training.teacher_cache import TeacherCache

        TeacherCache(cfg.teacher_cache).check_for(cfg.teacher, cfg.seq_len, cfg.tokenizer)


def convert(teacher: Path, cfg: DistillConfig, data: CalibrationData | None = None,
            run: PassSettings | None = None, sharing: Sharing = NO_SHARING,
            delaying: Delaying = EVERY_MODULE, tasks: list[str] | None = None, limit: int | None = None) -> Paths:
    """Every stage not done yet into cfg.out (DIR); returns its paths. Under torchrun every rank
    calls it: rank 0 runs stages 1, 2 and 4 while the others wait for the layout. data, run:
    the calibration's (default: calibration_settings's, from cfg); sharing: the layout's shared
    neurons; delaying: a partial student's modules; tasks, limit: benchmark the student against its
    teacher once it is published (benchmark_stage)."""
    from dtpshard.affinity.calibrate import plan_calibration
    from dtpshard.training import convert_plan
    from dtpshard.training.rundir import locked

    default_data, default_run = calibration_settings(cfg)
    data, run = data or default_data, run or default_run
    cfg = resolved(teacher, cfg)
    check_sharing(cfg, sharing)
    delaying = resolved_delaying(delaying)
    check_delaying(cfg, delaying)
    check_tasks(tasks, limit)  # an unknown task or a missing wheel is refused before hours of work
    p = Paths(cfg.out)
    check_outputs({"--out": p.out, "--tensorboard": cfg.tensorboard, "--spill-dir": run.spill_dir},
                  {"the teacher directory": cfg.teacher, "the tokenizer directory": cfg.tokenizer,
                   "the teacher cache": cfg.teacher_cache, "the training text": cfg.text,
                   "the evaluation text": cfg.eval_text, "the dataset": local_paths([cfg.dataset, cfg.eval_dataset])})
    state.check_dir(p.out, cfg.force)
    convert_plan.refuse_unless_fits(convert_plan.plan_convert(cfg, data, run, timed=False))
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: the layout comes from rank 0
        while not p.layout.is_file():
            time.sleep(1.0)
        from dtpshard.training.distill import distill

        distill(run_config(p, cfg))
        return p
    preflight(cfg)
    settings = state.record(cfg, data, run, PROXY, sharing, delaying)
    with locked(p.out):
        # other settings: refused before the directory is claimed (without a record, claim names what is there)
        old = check_record(p, settings) if not cfg.force and p.record.is_file() else None
        settings[ID] = state.claim(p, cfg.force)  # convert.json holds DIR's id: DIR is convert's own
        trust = state.trusted(p, old, cfg.teacher, cfg.tokenizer)  # every file a skip relies on, checked
        pass_ = None if p.affinity.is_file() else plan_calibration(cfg.teacher, p.affinity, data, delay=cfg.delay,
                                                                    run=run)  # every input checked, then written
        state.save(p, settings, trust)
        distilled = state.distilled(p, cfg.teacher, cfg.tokenizer)
        stages = [(pass_ is None, lambda: calibrate_stage(p, pass_, cfg.progress), state.AFFINITY),
                  (p.layout.is_file(), lambda: layout_stage(p, cfg, cfg.progress, sharing, delaying, data),
                   state.LAYOUT),
                  (distilled, lambda: distill_stage(p, cfg), None),
                  (state.student_done(p, distilled), lambda: student_stage(p, cfg), None)]
        for k, (done, run_stage, made) in enumerate(stages, 1):
            if done:
                _say(f"stage {k}/4 {STAGES[k - 1]}: done before")
                continue
            run_stage()
            if made is not None:  # what a rerun will skip this stage over, recorded by content
                state.save(p, settings, trust, made)
        if tasks is not None:
            trust["downstream"] = summary_of(benchmark_stage(p, cfg, tasks, limit))
            state.save(p, settings, trust)
    return p


def summary(p: Paths, cfg: DistillConfig) -> dict[str, Any]:
    """What --json prints: the paths, J of the three layouts, the held-out KL at step 0 and at the
    end, the seconds per stage, and the commands that serve the student."""
    from dtpshard.core.layout import Layout
    from dtpshard.training.rundir import read_metrics

    score = Layout.load(p.layout).score
    evals = [r for r in read_metrics(p.run) if r.get("kind") == "eval"]
    times = read_json(p.timings, "timings") if p.timings.is_file() else {}
    return {"out": str(p.out), "affinity": str(p.affinity), "layout": str(p.layout), "run": str(p.run),
            "student": str(p.student), "devices": cfg.devices, "delay": cfg.delay,
            "J": {"optimised": score.get("J"), "contiguous": score.get("contiguous_J"),
                  "random": score.get("random_J"), "random_expectation": score.get("random_expectation")},
            "kl": {"step_0": evals[0]["eval_kl"] if evals else None, "final": evals[-1]["eval_kl"] if evals else None,
                   "final_step": evals[-1]["step"] if evals else None},
            "seconds": {s: times.get(s) for s in STAGES}, "serve": serving(p.student),
            "downstream": kept_result(p)}



def calibration_settings(cfg: DistillConfig,
                         own: dict[str, Any] | None = None) -> tuple[CalibrationData, PassSettings]:
    """The calibration stage's CalibrationData and PassSettings: the pass's own settings from `own`
    (by name; default theirs), the ones it shares with the distillation (data, --seq-len, --seed,
    --micro-batch, --device) from cfg."""
    own = own or {}

    def build(cls: type) -> Any:
        shared = {f.name for f in dataclasses.fields(DistillConfig)}
        return cls(**{f.name: own[f.name] if f.name in own else getattr(cfg, f.name)
                      for f in dataclasses.fields(cls) if f.name in own or f.name in shared})

    return build(CalibrationData), build(PassSettings)
