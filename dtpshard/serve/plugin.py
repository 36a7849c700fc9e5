"""vLLM's `vllm.general_plugins` entry point: what makes vLLM serve a DTP student.

vLLM calls `register()` in every process it starts (the front end, the engine core, each
worker). It registers:
- DTPConfig with transformers' AutoConfig under model_type "dtp", so vLLM reads a student's
  config.json without remote code (`--trust-remote-code` is accepted, not needed);
- the architecture `DTPForCausalLM` with vLLM's ModelRegistry, as a "module:Class" string that
  vLLM imports only when it builds the model;
- a config check vLLM runs in the front end before it starts a worker, so a TP size other than
  L, an incomplete record or an unknown family is refused there in one line.
"""
from __future__ import annotations

from typing import Any

ARCHITECTURE = "DTPForCausalLM"
MODEL_CLASS = "dtpshard.serve.vllm_model:DTPForCausalLM"


def check_vllm_config(vllm_config: Any) -> None:
    """The student and vLLM's parallel sizes, refused in one line (as a ValueError: what vLLM's
    config errors are, so its front end reports the message, not a worker's traceback)."""
    from dtpshard.core.errors import UserError
    from dtpshard.serve.student import check_parallel, served_student

    parallel = vllm_config.parallel_config
    try:
        check_parallel(served_student(vllm_config.model_config.hf_config), parallel.tensor_parallel_size,
                       parallel.pipeline_parallel_size)
    except UserError as e:
        raise ValueError(str(e)) from None


def register() -> None:
    """Idempotent: vLLM may call it more than once in a process."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    from dtpshard.core.shape import STUDENT_TYPE
    from dtpshard.model.student import DTPConfig

    AutoConfig.register(STUDENT_TYPE, DTPConfig, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)

    class DTPStudentConfig(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config: Any) -> None:
            check_vllm_config(vllm_config)

    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, DTPStudentConfig)
