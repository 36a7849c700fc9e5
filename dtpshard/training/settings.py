"""The settings of a distillation run (docs/design.md §4), defined without torch so that the CLI,
a study file and the report read them cheaply: the recipe (Recipe, the paper's by default), a
run's DistillConfig (the recipe and what an experiment sets per arm), what a run's config.json
derives from its inputs (Derived), and each field's role in its metadata. The run itself is in
recipe.py and loop.py.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dtpshard.core.adapters import DEFAULT_ALPHA, DEFAULT_TARGETS, AdapterTarget
from dtpshard.core.errors import UserError
from dtpshard.core.settings import DTP_HELP, DTPSettings
from dtpshard.core.typed import Invalid, check
from dtpshard.core.vocab import (
    Beta,
    CompileMode,
    Count,
    Delay,
    DelayedBy,
    Device,
    Fraction,
    GradAccum,
    LearningRate,
    NonNegativeInt,
    NonNegativeNumber,
    PositiveNumber,
    Seconds,
    Seed,
    SharedBy,
    SharedFraction,
    Stage3,
    Steps,
)
from dtpshard.training.recipes import DEFAULT_RECIPE, RecipeName

Precision = Literal["auto", "fp32", "bf16-mixed"]  # resolved per device by training/precision.py
SaveDType = Literal["auto", "float32", "bfloat16", "float16"]

FORMAT = "dtpshard.distill/1"
# A field's role, in its metadata: OPERATIONAL fields (progress bar, checkpoint cadence, where
# files are, ...) do not change what is computed, so a resumed run may change them; every other
# field of DistillConfig and Derived is compared (compared_keys). A study's [training] table may
# set exactly the fields of Recipe; DistillConfig's own are what the experiment sets per arm.
COMPARED = "compared"
OPERATIONAL = {COMPARED: False}


@dataclass(kw_only=True)
class Recipe:
    """The training recipe, the paper's by default (docs/design.md §4): every field is a flag of
    `dtpshard distill` and a key of an experiment's [training] table (every arm trains with it).

    Args:
        steps: optimizer steps
        seq_len: tokens per sequence (blocks hold seq_len + 1 tokens)
        micro_batch: sequences per forward pass (per process)
        grad_accum: micro-batches accumulated per optimizer step
        lr: peak learning rate (AdamW)
        warmup: linear warm-up steps
        min_lr_ratio: the cosine decay ends at this fraction of --lr
        weight_decay: AdamW weight decay (matrices only; norms are never decayed)
        adam_beta1: AdamW β1
        adam_beta2: AdamW β2
        clip: gradient-norm clip (0: none)
        ce_weight: weight of the next-token cross-entropy added to the KL
        recipe: what each step trains on (training/recipes.py): paper (KL + CE on the logits, the paper's), streams
            (each device's residual stream matched to the teacher's after every module for the first 20% of the
            steps, then paper), curriculum (δ ramped from 0 over the first 30%), layerwise (paper + stream matching
            at every step)
        eval_every: evaluate every this many steps (and at step 0 and at the end)
        text: local .txt/.jsonl/.json/.parquet training files (their held-out share is never trained on)
        dataset: training dataset: a save_to_disk directory, a parquet file or directory, or a hub name (fineweb-edu,
            ...); default the offline corpus
        grad_checkpointing: recompute each module's activations in backward (less memory)
        compile: torch.compile the student: on (a bare --compile), off (--no-compile), or auto (on CUDA, and on CPU
            for runs of 200+ steps; never with --fsdp)
        precision: fp32, or bf16-mixed (bf16 forward and backward, fp32 master weights and gradient reduction); auto:
            bf16-mixed on CUDA, fp32 on the CPU
        checkpoint_every: write a checkpoint every this many steps
        checkpoint_minutes: and whenever this many minutes passed since the last one
        nproc: data-parallel processes to spawn on this machine (gloo on CPU, NCCL on GPUs); 1: this one
        fsdp: shard the student (weights, gradients, optimizer state) and the teacher across the processes (FSDP2)
        timeout: seconds a process waits for the others before the run fails
        progress: show a progress bar with ETA
        adapters: train low-rank adapters of this rank over the frozen permuted weights (one copy of the weights: the
            teacher is the same weights with the adapters off, run dense); the student is saved merged
        adapter_alpha: the adapters' α: each projection is W + (α/rank)·B·A
        adapter_targets: the projections that get adapters
    """

    steps: Steps = 1000
    seq_len: Count = 1024
    micro_batch: Count = 4
    grad_accum: GradAccum = 4
    lr: LearningRate = 5e-5
    warmup: NonNegativeInt = 100
    min_lr_ratio: Fraction = 0.1
    weight_decay: NonNegativeNumber = 0.0
    adam_beta1: Beta = 0.9
    adam_beta2: Beta = 0.95
    clip: NonNegativeNumber = 1.0
    ce_weight: NonNegativeNumber = 0.1
    recipe: RecipeName = DEFAULT_RECIPE
    eval_every: Count = 100
    text: list[str] | None = field(default=None, metadata=OPERATIONAL)  # data changes show in the data hashes
    dataset: str | None = None
    grad_checkpointing: bool = field(default=False, metadata=OPERATIONAL)
    compile: CompileMode = field(default="auto", metadata=OPERATIONAL)  # model/compiled.py: auto compiles where it pays
    precision: Precision = "auto"
    checkpoint_every: Count = field(default=100, metadata=OPERATIONAL)
    checkpoint_minutes: PositiveNumber = field(default=30.0, metadata=OPERATIONAL)
    nproc: Count = field(default=1, metadata=OPERATIONAL)
    fsdp: bool = False
    timeout: Seconds = field(default=600.0, metadata=OPERATIONAL)
    progress: bool = field(default=True, metadata=OPERATIONAL)
    adapters: Count | None = None  # None: every weight trains (full distillation)
    adapter_alpha: PositiveNumber = DEFAULT_ALPHA
    adapter_targets: list[AdapterTarget] = field(default_factory=lambda: list(DEFAULT_TARGETS))


# what a run's config.json held implicitly before adapters (and recipes) existed (rundir.check_run's `added`)
BEFORE_ADAPTERS = {"adapters": None, "adapter_alpha": DEFAULT_ALPHA, "adapter_targets": list(DEFAULT_TARGETS),
                   "recipe": DEFAULT_RECIPE, "delayed": None}


@dataclass
class _Teacher:
    teacher: Path  # DistillConfig's first field: `dtpshard distill TEACHER`, its positional argument


@dataclass(kw_only=True)
class DistillConfig(Recipe, _Teacher):
    """One distillation run: the recipe (Recipe) and what an experiment sets for each arm itself.

    Each field is a flag of `dtpshard distill`.

    Args:
        teacher: the dense Hugging Face checkpoint directory
        out: the run directory (created; an existing one is resumed if its settings match)
        layout: layout JSON (dtpshard.layout/1) to permute the student by; none: contiguous
        delayed: the modules delayed by δ, the rest plain tensor parallel (module 2i is layer i's attention); default
            the layout's (`dtpshard layout --delayed`), else a student teacher's record, else every module
        eval_blocks: held-out evaluation blocks of seq_len + 1 tokens
        eval_micro_batch: blocks per evaluation forward pass (default: --micro-batch)
        eval_text: local evaluation files (their held-out share is used)
        eval_dataset: evaluation dataset, as --dataset (wikitext-2 is the paper's); default the offline corpus
        text_field: the column or JSON field that holds the text
        tokenizer: tokenizer directory, where TEACHER has no tokenizer files
        seed: data-order seed
        teacher_cache: a `dtpshard teacher-cache` directory: train on its top-k KL + tail instead of running the teacher
        tensorboard: also write the metrics as TensorBoard events to this directory (metrics.jsonl stays the record)
        force: start the run directory over (its checkpoint, metrics and student are deleted)
        max_shard_size: the student's safetensors files are at most this large (5GB, 500MB, 2GIB, or bytes), as
            transformers' save_pretrained
        save_dtype: the student's saved weights: auto (the teacher's dtype), float32, bfloat16 or float16
        plan: print the memory plan per process (from config.json alone) and exit; refused in one line if the run cannot
            fit
        plan_world: --plan for this many processes (default: --nproc, or torchrun's WORLD_SIZE)
        plan_memory: plan (and refuse the run) against this much memory per process, e.g. 80GB (default: this
            machine's GPU memory, or its share of the RAM)
    """

    out: Path = field(metadata=OPERATIONAL)
    layout: Path | None = field(default=None, metadata=OPERATIONAL)  # its content is compared: Derived.layout_sha256
    devices: Count | None = None  # None: resolve_dtp's (the teacher's record, the layout's, the default)
    delay: Delay | None = None
    stage3: Stage3 | None = None
    delayed: list[NonNegativeInt] | None = None  # None: resolve_dtp's (layout, record, all)
    eval_blocks: Count = 16
    eval_micro_batch: Count | None = field(default=None, metadata=OPERATIONAL)
    eval_text: list[str] | None = field(default=None, metadata=OPERATIONAL)
    eval_dataset: str | None = None
    text_field: str = field(default="text", metadata=OPERATIONAL)
    tokenizer: Path | None = field(default=None, metadata=OPERATIONAL)  # None: the teacher's
    seed: Seed = 0
    # train on a teacher cache's top k (teacher_cache.py), not the teacher; compared by what it holds
    teacher_cache: Path | None = field(default=None, metadata=OPERATIONAL)
    device: Device = field(default="auto", metadata=OPERATIONAL)
    tensorboard: Path | None = field(default=None, metadata=OPERATIONAL)
    force: bool = field(default=False, metadata=OPERATIONAL)
    max_shard_size: str = field(default="5GB", metadata=OPERATIONAL)
    save_dtype: SaveDType = field(default="auto", metadata=OPERATIONAL)
    plan: bool = field(default=False, metadata=OPERATIONAL)
    plan_world: Count | None = field(default=None, metadata=OPERATIONAL)
    plan_memory: str | None = field(default=None, metadata=OPERATIONAL)

    @property
    def dtp(self) -> DTPSettings:
        """The run's DTP settings, once recipe.resolve has filled devices and delay (resolve_dtp)."""
        if self.devices is None or self.delay is None:
            raise ValueError("DistillConfig.dtp: resolve the config first (training.recipe.resolve)")
        return DTPSettings(self.devices, self.delay, self.stage3, None if self.delayed is None else tuple(self.delayed))

    @property
    def adapter_settings(self) -> Any:
        """model.adapters.AdapterSettings of an adapter run, None for full distillation."""
        if self.adapters is None:
            return None
        from dtpshard.core.adapters import AdapterSettings

        return AdapterSettings(self.adapters, float(self.adapter_alpha), tuple(dict.fromkeys(self.adapter_targets)))


# devices, delay and stage3 are helped as every command helps them (core/settings.py DTP_HELP)
DistillConfig.__doc__ = (DistillConfig.__doc__ or "").rstrip() + "\n" + "".join(
    f"        {k}: {v}\n" for k, v in DTP_HELP.items()) + "    "


@dataclass(kw_only=True)
class Derived:
    """What a run's config.json records besides its DistillConfig: values derived from the inputs
    (run_config fills them)."""

    format: str = field(default=FORMAT, metadata=OPERATIONAL)
    model: dict[str, Any]
    layout_kind: str = field(metadata=OPERATIONAL)
    layout_sha256: str | None
    world_size: int
    global_batch: int = field(metadata=OPERATIONAL)
    tokens_per_step: int = field(metadata=OPERATIONAL)
    device_type: str
    train_data: str = field(metadata=OPERATIONAL)
    train_blocks: int = field(metadata=OPERATIONAL)
    train_data_sha256: str
    eval_data: str = field(metadata=OPERATIONAL)
    eval_data_sha256: str
    teacher_cache_id: Any  # a cached teacher is recorded by what it holds, not where
    torch: str = field(metadata=OPERATIONAL)
    # the intra-op threads each process computed with: the order of a parallel sum, so its rounding
    # (1e-7 relative), which a long or unstable run can grow; another machine may resume with others
    threads: int = field(default=0, metadata=OPERATIONAL)


@dataclass(frozen=True, kw_only=True)
class Sharing:
    """Shared neurons in `convert`'s layout (docs/design.md §6; `dtpshard layout --shared`).

    Args:
        shared: fraction of each layer's neurons replicated on every device, rounded up to leave the rest divisible
            by --devices (0: none); the contiguous and random layouts it is compared with share the same ones
        shared_by: the shared neurons: the top by up-edge affinity mass (fo, the seed code's), by down-edge mass (dn),
            or random
    """

    shared: SharedFraction = 0.0
    shared_by: SharedBy = "fo"


NO_SHARING = Sharing()


@dataclass(frozen=True)
class Delaying:
    """A partial student from `convert` (docs/design.md §1, per-module delay; `dtpshard layout --delayed`).

    Args:
        delayed: delay only some modules, the rest plain tensor parallel: a share of them written with a decimal point
            (0.5), or module indices (10-59; module 2i is layer i's attention); default every module
        delayed_by: which modules a share delays: least measured sensitivity (the default: KL to the dense model with
            that module alone delayed, under the optimised layout, on the calibration blocks), the upper ones, or random
    """

    delayed: str | None = None
    delayed_by: DelayedBy | None = None


EVERY_MODULE = Delaying()


def compared_fields(cls: type) -> list[str]:
    """The fields of a settings dataclass that a resumed run must match (the rest are operational)."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get(COMPARED, True)]


def require_tensorboard() -> None:
    """--tensorboard's optional dependency, checked with the flags (check_config) and by the writer:
    importable as the writer imports it (a directory named tensorboard in the working directory is
    found as a namespace package, and fails only when the first event is written)."""
    import importlib.util

    spec = importlib.util.find_spec("tensorboard")
    if spec is None or spec.origin is None:
        raise UserError("--tensorboard needs the tensorboard package (pip install tensorboard)")
    try:
        import torch.utils.tensorboard  # noqa: F401 (the writer's import, done now)
    except ImportError as e:
        raise UserError(f"--tensorboard: the tensorboard package does not load ({e}); reinstall it") from None


def check_config(cfg: Recipe) -> None:
    """A recipe (or DistillConfig) built in Python checked as the CLI and a study file check it
    while reading: every field against its type (counts >= 1, finite numbers, the choices), and
    the combinations that are not supported."""
    hints = typing.get_type_hints(type(cfg), include_extras=True)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "compile" and isinstance(value, bool):  # from Python, True and False mean on and off
            continue
        try:
            check(hints[f.name], value)
        except Invalid as e:
            raise UserError(f"--{f.name.replace('_', '-')} {value}: must be {e.wants}") from None
    if getattr(cfg, "timeout", None) is not None:  # a study file's recipe does not pass through the CLI's check
        from dtpshard.core.launch_checks import check_timeout

        check_timeout(cfg.timeout)
    if getattr(cfg, "max_shard_size", None) is not None:  # flags with a syntax of their own, and optional
        from dtpshard.model.shards import parse_size  # dependencies: checked before the first byte is written

        parse_size(cfg.max_shard_size)
    if getattr(cfg, "tensorboard", None) is not None:
        require_tensorboard()
    if cfg.fsdp and cfg.compile in ("on", True):  # auto stays eager under --fsdp
        raise UserError("--compile on with --fsdp: not supported (torch.compile over FSDP2 modules is untested); "
                        "drop one")
    if cfg.fsdp and getattr(cfg, "teacher_cache", None) is not None:
        raise UserError("--teacher-cache with --fsdp: not supported yet (the cached path is untested sharded); "
                        "drop one")


def compared_keys() -> list[str]:
    """The keys of a run's config.json that a resumed run must match."""
    return compared_fields(DistillConfig) + compared_fields(Derived)
