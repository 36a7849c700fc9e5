"""Serving a DTP student in vLLM at tensor-parallel size L (docs/serving.md).

`plugin.register` is vLLM's `vllm.general_plugins` entry point (pyproject.toml): it makes
vLLM read a student's config.json (model_type "dtp") and build `DTPForCausalLM`
(vllm_model.py) from vLLM's own layers. `student.py` checks a student's record without vLLM;
`env.py` builds the vLLM environment the tests and the benchmark use. Importing this package
imports no vLLM.
"""
from dtpshard.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {"served_student": "student", "check_parallel": "student",
                                              "register": "plugin"})
