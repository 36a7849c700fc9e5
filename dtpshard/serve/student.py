"""What vLLM needs to know about a DTP student, checked in one place and without vLLM.

A student served at tensor-parallel size L is rank l = device l: its config.json's `dtp` block
must name the family and give L, δ and the stage-3 scale (the layout's hash is informational),
and vLLM's TP size must be L. Anything else is refused in one line; a student is never served
as its dense family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtpshard.core.errors import UserError
from dtpshard.core.settings import DTPSettings, read_record, resolve_dtp
from dtpshard.core.shape import STUDENT_TYPE, ModelShape, shape_from_hf_config
from dtpshard.model.delay import Schedule, schedule_for

REQUIRED = ("family", "devices", "delay", "stage3")  # what a complete dtp record gives


@dataclass(frozen=True)
class ServedStudent:
    """A student as a vLLM rank runs it: its shape, settings and delay schedule."""

    family_config: Any  # the base family's transformers config (LlamaConfig, Qwen3Config, ...)
    shape: ModelShape
    settings: DTPSettings
    schedule: Schedule  # per module m: s_m and the arrivals (model/delay.py)


def served_student(hf_config: Any) -> ServedStudent:
    """The student behind a model_type "dtp" config, refused in one line when its record is
    incomplete or its family unknown."""
    if getattr(hf_config, "model_type", None) != STUDENT_TYPE:
        raise UserError(f"DTPForCausalLM serves model_type {STUDENT_TYPE!r} students, not "
                        f"model_type {getattr(hf_config, 'model_type', None)!r}")
    block = getattr(hf_config, "dtp", None)
    record = read_record(block, "config.json dtp")
    missing = [k for k in REQUIRED if k not in (record or {})]
    if missing:
        raise UserError(f"config.json dtp: the DTP record is incomplete (missing {', '.join(missing)}); "
                        "vLLM cannot serve it as DTP and will not serve it as a dense model")
    shape = shape_from_hf_config(hf_config)
    settings = resolve_dtp(shape, record=record)
    return ServedStudent(hf_config.base_config(), shape, settings, schedule_for(shape.modules, settings))


def check_parallel(student: ServedStudent, tensor_parallel: int, pipeline_parallel: int = 1) -> None:
    """Rank l is device l: vLLM's TP size must be the student's L, with no pipeline stages."""
    L = student.settings.devices
    if tensor_parallel != L:
        raise UserError(f"this DTP student runs on L = {L} devices: serve it with --tensor-parallel-size {L} "
                        f"(not {tensor_parallel})")
    if pipeline_parallel != 1:
        raise UserError(f"a DTP student is served with --pipeline-parallel-size 1, not {pipeline_parallel}")
