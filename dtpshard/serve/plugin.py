"""vLLM's `vllm.general_plugins` entry point: what makes vLLM serve a DTP student.

vLLM calls `register()` in every process it starts (the front end, the engine core, each
worker). It registers:
- DTPConfig with transformers' AutoConfig under model_type "dtp", so vLLM reads a student's
  config.json without remote code (`--trust-remote-code` is accepted, not needed);
- the architecture `DTPForCausalLM` with vLLM's ModelRegistry, as a "module:Class" string that
  vLLM imports only when it builds the model;
- a config check vLLM runs in the front end before it starts a worker, so a TP size other than
  L, an incomplete record or an unknown family is refused there, as a ValueError (what vLLM's own
  config errors are); where nothing catches it (the server, `vllm serve`, a script) it is printed
  as one line with exit code 2, instead of the pydantic traceback vLLM wraps it in.

The registry and AutoConfig calls are public API. The config check is not: vLLM has no public
hook for a model to refuse an engine config before the workers start, so it goes where vLLM's own
models' checks go (`vllm.model_executor.models.config.MODELS_CONFIG_MAP`); where that is missing,
the worker refuses the same cases (serve/vllm_model.py), later and inside vLLM's traceback.
"""
from __future__ import annotations

import os
import sys
from typing import Any

ARCHITECTURE = "DTPForCausalLM"
MODEL_CLASS = "dtpshard.serve.vllm_model:DTPForCausalLM"
REFUSAL = "dtpshard refuses to serve this student: "  # finds our line inside vLLM's and pydantic's wrapping


def check_vllm_config(vllm_config: Any) -> None:
    """The student and vLLM's parallel sizes, refused in one line."""
    from dtpshard.core.errors import UserError
    from dtpshard.serve.student import check_parallel, served_student

    parallel = vllm_config.parallel_config
    try:
        check_parallel(served_student(vllm_config.model_config.hf_config), parallel.tensor_parallel_size,
                       parallel.pipeline_parallel_size)
    except UserError as e:
        raise ValueError(REFUSAL + str(e)) from None


def refusal_line(exc: BaseException | None) -> str | None:
    """Our refusal's one line, if `exc` or an exception it was raised from carries one."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        at = text.find(REFUSAL)
        if at >= 0:  # pydantic appends " [type=value_error, input_value=...]" on the same line
            return text[at + len(REFUSAL):].splitlines()[0].split(" [type=")[0].strip()
        exc = exc.__cause__ or exc.__context__
    return None


def _one_line(previous: Any) -> Any:
    def hook(kind: type, value: BaseException, tb: Any) -> None:
        line = refusal_line(value)
        if line is None:
            return previous(kind, value, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(2, f"error: {line}\n".encode())  # to the descriptor: a vLLM worker's sys.stderr may not reach it
        os._exit(2)  # the process ends on this error anyway, before any worker was started

    hook.dtpshard = True  # type: ignore[attr-defined]
    return hook


def register() -> None:
    """Idempotent: vLLM may call it more than once in a process."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from dtpshard.core.shape import STUDENT_TYPE
    from dtpshard.model.student import DTPConfig

    AutoConfig.register(STUDENT_TYPE, DTPConfig, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    if not getattr(sys.excepthook, "dtpshard", False):
        sys.excepthook = _one_line(sys.excepthook)
    try:
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig
    except ImportError:  # the worker's check remains
        return

    class DTPStudentConfig(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config: Any) -> None:
            check_vllm_config(vllm_config)

    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, DTPStudentConfig)
