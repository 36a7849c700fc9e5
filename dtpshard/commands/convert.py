"""`dtpshard convert`, over dtpshard/training/convert.py. Its flags are the distillation's but
--layout (convert makes its own), with convert's own help where the words differ, and the
calibration pass's own settings (the ones it shares with the distillation are the distillation's
flags and set both)."""
from __future__ import annotations

import dataclasses
import os
from typing import Annotated, Any

from cyclopts import Parameter

from dtpshard.affinity.settings import CalibrationData, PassSettings
from dtpshard.commands.schema import values, view
from dtpshard.core.io import dumps
from dtpshard.core.settings import DEFAULT
from dtpshard.core.vocab import Count
from dtpshard.training.settings import EVERY_MODULE, NO_SHARING, Delaying, DistillConfig, Sharing

ConvertFlags = view("ConvertFlags", DistillConfig, drop={"layout", "delayed"}, positional=("teacher",),
                    doc="What convert takes of a distillation's flags.",
                    helps={"teacher": "the dense Hugging Face checkpoint directory to convert",
                           "out": "the convert directory DIR (created; rerun the same command to resume)",
                           "devices": f"L, the devices the layout and the student are for; default {DEFAULT.devices}",
                           "delay": f"δ in modules; default {DEFAULT.delay}",
                           "force": "start DIR over (only what convert made in it is removed)"})
# the calibration pass's own settings (--blocks, --chunk, --dtype, ...)
CalibrationFlags = view("CalibrationFlags", CalibrationData, PassSettings,
                        drop={f.name for f in dataclasses.fields(DistillConfig)},
                        doc="The calibration pass's own settings.")
CALIBRATION_FLAGS = CalibrationFlags()


def convert_cmd(flags: Annotated[ConvertFlags, Parameter(name="*")],  # type: ignore[valid-type]
                calibration: Annotated[CalibrationFlags, Parameter(name="*")] = CALIBRATION_FLAGS, *,  # type: ignore[valid-type]
                sharing: Annotated[Sharing, Parameter(name="*")] = NO_SHARING,
                delaying: Annotated[Delaying, Parameter(name="*")] = EVERY_MODULE, tasks: list[str] | None = None,
                limit: Count | None = None, json: bool = False) -> int:
    """Turn the dense checkpoint TEACHER into a DTP student ready to serve, in DIR (--out): the
    calibration pass (--blocks blocks of --seq-len tokens of the training data), the optimised
    layout for L = --devices and δ = --delay (with J of the contiguous and a random layout beside
    it), the distillation under it (every distill flag: --steps, --lr, --nproc K, --fsdp, or
    `torchrun --nproc-per-node K -m dtpshard convert ...`), then DIR/student/ with its card. Ends by
    printing the commands that serve the student. Rerun the same command to resume where it stopped; --plan prints each
    stage's memory and expected time from config.json alone.

    Args:
        tasks: benchmark the student against its teacher on these tasks once it is made (as `eval --tasks`:
            lm-eval's names, or default), into DIR/downstream.json, convert.json and the student's card
        limit: with --tasks, each task's first N items
        json: print one JSON object {out, student, J, kl, seconds, serve, downstream, ...} instead of text
    """
    from dtpshard.training import convert_plan
    from dtpshard.training.convert import (
        _signals_end_in_one_line,
        calibration_settings,
        check_delaying,
        check_sharing,
        convert,
        resolved,
        resolved_delaying,
        summary,
    )

    cfg = DistillConfig(**values(flags))
    with _signals_end_in_one_line():  # the whole command: one signal, one line, whenever it comes
        teacher = cfg.teacher
        data, run = calibration_settings(cfg, values(calibration))
        if cfg.plan:
            planned = resolved(teacher, cfg)
            check_sharing(planned, sharing)
            removed = check_delaying(planned, resolved_delaying(delaying))
            plans = convert_plan.plan_convert(planned, data, run, timed=True)
            rows = [s.to_json() for s in plans]
            for row in rows:  # the share of syncs removed is the layout's: said with its stage
                if row.get("stage") == "layout":
                    row.update({k: v for k, v in removed.items() if k != "describe"})
            print(dumps(rows) if json else "\n".join([*(s.describe() for s in plans), removed["describe"]]))
            convert_plan.refuse_unless_fits(plans)
            return 0
        p = convert(teacher, cfg, data, run, sharing, delaying, tasks, limit)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
        result = summary(p, resolved(teacher, cfg))
        print(dumps(result) if json else describe(result))
        return 0


def describe(result: dict[str, Any]) -> str:
    j, kl, serve, L = result["J"], result["kl"], result["serve"], result["devices"]
    return (f"student: {result['student']}\n"
            f"J = {j['optimised']:.4f} optimised, {j['contiguous']:.4f} contiguous, {j['random']:.4f} random; "
            f"held-out KL {kl['step_0']:.4f} at step 0, {kl['final']:.4f} at step {kl['final_step']}\n\n"
            f"serve it:\n"
            f"  vLLM, tensor parallel over L = {L} GPUs (needs dtpshard installed beside vllm):\n    {serve['vllm']}\n"
            f"  vLLM's CPU build, L = {L} processes on this machine:\n    {serve['vllm_cpu']}\n"
            f"  transformers, one device:\n    {serve['transformers']}\n"
            f"  dtpshard's runtime, one process per device:\n    {serve['dtpshard']}"
            + ("" if result.get("downstream") is None else
               "\n\nbenchmarks, the student against its teacher:\n" + _table(result["downstream"])))


def _table(downstream: dict[str, Any]) -> str:
    from dtpshard.downstream.evaluate import table

    return table(downstream)
