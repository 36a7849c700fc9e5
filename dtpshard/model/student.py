"""The student format: a DTP student's config (`DTPConfig`, model_type "dtp"), the remote-code
files written beside its weights, and the part of its model card every student shares.

A student computes the DTP function (L devices, delay δ), not its base family's dense one, so its
config.json says model_type "dtp" and transformers loads it only through dtpshard's classes, with
`trust_remote_code=True`: the student's directory holds configuration_dtp.py and modeling_dtp.py,
which define nothing but subclasses of the classes in model/remote.py (`REMOTE_CODE`), so there
is one DTP implementation and the remote files need dtpshard installed (transformers' import
check says so). They are subclasses, not re-exports, because transformers' save_pretrained
copies the file that defines the class: the thin file, never dtpshard's.

DTPConfig is flat: the base family's config fields as they are (hidden_size, rope_parameters,
...) plus the `dtp` block, which names the family (`dtp["family"]`) besides L, δ, stage3 and the
layout's hash. `base_config()` rebuilds the family's config, which is what dtpshard reads
(core.shape.family_config). This module needs no model code (checkpoint reading imports it);
DTPForCausalLM is in model/remote.py.
"""
from __future__ import annotations

import shlex
from typing import Any

import yaml
from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from dtpshard.core.delayed import compact
from dtpshard.core.errors import UserError
from dtpshard.core.shape import FAMILIES, FAMILY, STUDENT_TYPE, family_config

ARCHITECTURE = "DTPForCausalLM"
AUTO_MAP = {"AutoConfig": "configuration_dtp.DTPConfig", "AutoModelForCausalLM": "modeling_dtp.DTPForCausalLM"}
# keys of a student's config that are not its base family's
_OWN_KEYS = ("model_type", "architectures", "auto_map", "dtp", "transformers_version")

REMOTE_CODE = {
    "configuration_dtp.py": '''"""A DTP student's config for transformers (trust_remote_code): the class is dtpshard's.

Needs `pip install dtpshard`. Defined here, as a subclass, so that transformers' save_pretrained
copies this file and not dtpshard's source."""
from dtpshard.model.remote import DTPConfig as _DTPConfig


class DTPConfig(_DTPConfig):
    """dtpshard.model.remote.DTPConfig: the base family's config and the `dtp` block."""
''',
    "modeling_dtp.py": '''"""A DTP student for transformers (trust_remote_code): the model is dtpshard's DTPModel.

Needs `pip install dtpshard`. Defined here, as a subclass, so that transformers' save_pretrained
copies this file and not dtpshard's source."""
from dtpshard.model.remote import DTPForCausalLM as _DTPForCausalLM


class DTPForCausalLM(_DTPForCausalLM):
    """dtpshard.model.remote.DTPForCausalLM: DTPModel's forward (L devices, delay δ) behind
    transformers' PreTrainedModel and GenerationMixin."""
''',
}


class DTPConfig(PretrainedConfig):
    """A student's config: its base family's fields, flat, and the `dtp` block (family, devices,
    delay, stage3, layout_sha256). No __init__ of its own: the block is an extra attribute, so
    transformers 4.x and 5.x (where configs are dataclasses) build it alike."""

    model_type = STUDENT_TYPE

    def _block(self) -> dict[str, Any]:
        block = getattr(self, "dtp", None)
        return block if isinstance(block, dict) else {}  # a hand-edited non-object block: refused by family

    @property
    def family(self) -> str:
        family = self._block().get("family")
        if family not in FAMILIES:
            raise UserError(f"model_type={STUDENT_TYPE!r} config: its dtp block's family must be one of "
                            f"{', '.join(FAMILIES)}, not {family!r}")
        return family

    def base_config(self) -> PretrainedConfig:
        """The base family's config (LlamaConfig, Qwen3Config, ...) these fields came from."""
        from dtpshard.core.errors import typed_config

        fields = {k: v for k, v in self.to_dict().items() if k not in _OWN_KEYS}
        return typed_config(CONFIG_MAPPING[self.family], fields, f"model_type {STUDENT_TYPE!r} config.json")

    def to_diff_dict(self) -> dict[str, Any]:
        """What config.json holds: the keys the base family's own config.json would (a diff
        against the family's defaults, not against this class's, which would drop e.g. a
        tie_word_embeddings equal to the generic default), and this config's own keys."""
        own = super().to_diff_dict()
        if self._block().get("family") not in FAMILIES:  # not a student's (yet): repr must work
            return own
        return {**self.base_config().to_diff_dict(), **{k: own[k] for k in _OWN_KEYS if k in own},
                "model_type": STUDENT_TYPE}

    @classmethod
    def for_student(cls, hf_config: Any, block: dict[str, Any]) -> DTPConfig:
        """A student's config from its teacher's (a family config, or another student's) and the
        settings it runs with (DTPModel.dtp_block)."""
        base = family_config(hf_config)
        fields = {k: v for k, v in base.to_dict().items() if k not in _OWN_KEYS}
        return cls.from_dict({**fields, "dtp": {"family": base.model_type, **block}, "architectures": [ARCHITECTURE],
                              "auto_map": dict(AUTO_MAP)})


TAGS = ["dtp", "delayed-tensor-parallelism", "dtpshard", "custom_code"]
# what vLLM's CPU build needs to start here: a KV cache of this many GiB (its default sizes the cache
# from all of the machine's memory and refuses to start when less is free), no core pinning
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def serving_commands(student: Any, devices: int, dtype: str, python: str = "python") -> dict[str, str]:
    """The commands that serve a student, written once: convert prints them, its card and the README
    show them, tests/test_vllm.py runs the CPU one. `--dtype` is the stored dtype: without it vLLM
    serves an fp32 student in bf16, which changes its tokens (docs/serving.md)."""
    vllm_args = f"--tensor-parallel-size {devices} --dtype {dtype}"
    cpu_env = " ".join(f"{k}={v}" for k, v in VLLM_CPU_ENV.items())
    path = shlex.quote(str(student))  # a shell word whatever the path holds (a space, a quote, `$(...)`)
    return {"vllm": f"vllm serve {path} {vllm_args}",
            "vllm_cpu": f"{cpu_env} $({python} -m dtpshard.serve.env) -m vllm.entrypoints.openai.api_server "
                        f"--model {path} {vllm_args}",
            "transformers": f"AutoModelForCausalLM.from_pretrained({str(student)!r}, trust_remote_code=True)",
            "dtpshard": f"torchrun --nproc-per-node {devices} -m dtpshard run {path} --prompt TEXT"}


def front_matter(extra: dict[str, Any] | None = None) -> str:
    """The model card's YAML header: the Hub reads the base model, library, pipeline, tags and the
    license from it (`extra`: base_model, license, ... where known)."""
    meta = {**(extra or {}), "library_name": "transformers", "pipeline_tag": "text-generation", "tags": TAGS}
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n"


def usage_section(block: dict[str, Any], dtype: str = "float32") -> str:
    """What a student is, the ways to run it, and why not as its base family: the part of
    the model card every student shares."""
    L, delay, family = block.get("devices"), block.get("delay"), block.get("family")
    dense = FAMILY[family].causal_lm if family in FAMILY else "its family's class"
    cmds = serving_commands("DIR", L, dtype)
    delayed = block.get("delayed")
    which = ("" if delayed is None else f" Only {len(delayed)} modules are delayed ({compact(tuple(delayed), 0)}; "
             "module 2i is layer i's attention, 2i + 1 its FFN); every other module sums its partials at once, as "
             "tensor parallelism does.")
    return f"""## What this model is

A Delayed Tensor Parallelism (DTP) student: its {family} weights are split over L = {L} devices,
each of which adds its own partial output at once and the other devices' partials δ = {delay}
modules later (stage-3 scale `{block.get("stage3")}`), so no layer waits for an all-reduce.{which} It was
distilled to compute exactly that function, which run as a dense model it does not: its logits
would be off by O(1).

## How to run it

1. transformers, on one device, with remote code (`pip install dtpshard`: the two .py files here
   only import it):
   `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` (the tokenizer likewise:
   `AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)`), then `generate()` as usual;
   greedy decoding gives the tokens `dtpshard generate` gives.
2. `dtpshard generate DIR --prompt TEXT`: the L devices simulated on one machine (also
   `DTPModel.from_pretrained(DIR)` and `dtpshard eval DIR` in Python and on the command line).
3. Across L processes, one device each:
   `torchrun --nproc-per-node {L} -m dtpshard run DIR --prompt TEXT` (or `dtpshard run DIR --nproc {L}`).
4. vLLM, at tensor-parallel size L (`pip install dtpshard` beside vLLM: its plugin registers the
   model): `{cmds["vllm"]}` or `LLM(model=DIR, tensor_parallel_size={L}, dtype="{dtype}")`; on a
   CPU, with vLLM's CPU build: `{cmds["vllm_cpu"]}`. Rank l holds device l's shard and each
   module's sum lands δ modules later. Another TP size is refused.

All of them read L, δ and the stage-3 scale from the `dtp` block of config.json.

## Why it does not load as a {dense}

The weights keep the {family} family's tensor names and shapes, so {dense} (and an engine
that reads {family} checkpoints) would load them without an error if config.json said
model_type `{family}`, and would compute the dense function, which is not this model. Its
config.json says model_type `dtp` so that transformers refuses it without
`trust_remote_code=True` and no engine takes it for a dense model. Engines with their own model
code other than vLLM (TGI, SGLang, ...) do not run DTP: use one of the ways above.
"""


def usage_card(config: DTPConfig, dtype: str = "float32") -> str:
    """The model card of a student saved without a run's records (DTPModel.save_pretrained)."""
    block = config.dtp
    return (front_matter() + f"\n# DTP student ({block.get('family')}, L = {block.get('devices')}, "
            f"δ = {block.get('delay')})\n\n" + usage_section(block, dtype))
