"""`dtpshard experiment`: a whole study (the paper's section 5) from one config file, resumably.

The config (TOML, or YAML for files ending .yaml/.yml) names the model, L, δ, the calibration and
evaluation data, the training recipe and the arms. Every key is checked: an unknown key or a bad
value is refused with the key named. Example (the paper's study: dtpshard/configs/qwen3_0.6b_paper.toml)::

    model = "/models/Qwen3-0.6B"   # a local HF checkpoint dir, or an HF id already in the HF cache
    devices = 4
    delay = 1
    text_field = "text"            # the column / JSON field of every text source; tokenizer = DIR if the model has none
    teacher_cache_k = 0            # K > 0: every arm trains on one cache of the teacher's top K (top-K KL + tail)
    proxies = ["first-order"]      # + "group-unit", "exact-jacobian", "ablation": one affinity pass each, same tokens
    [calibration]                  # text = [files] | dataset = "fineweb-edu" | neither: offline corpus
    blocks = 64
    seq_len = 1024
    [evaluation]                   # text | dataset; seq_len is the training one
    blocks = 16
    [training]                     # DistillConfig fields (docs/design.md §4 recipe by default)
    steps = 1000
    [[arms]]
    kind = "optimised"             # optimised contiguous random anti heads-only neurons-only
    seeds = [0, 1, 2]              # training seeds; [] scores the layout (J, zero-shot KL) only
    [[arms]]
    kind = "random"
    layout_seeds = [0, 1, 2, 3]    # one layout per seed
    [[arms]]
    kind = "optimised"
    layers = 4                     # only 4 evenly spaced layers optimised
    [[arms]]
    kind = "optimised"
    proxy = "ablation"             # optimised under another listed proxy (named optimised-ablation)

Relative paths (model, text files) are read from the working directory, as on the command line.
[training] defaults to the calibration data when it names neither text nor dataset.

The experiment directory DIR:

    DIR/config.json              the resolved config (a rerun must match it, unless --force)
    DIR/provenance.json          versions (and the git commit), the model files' sha256, data and token counts
    DIR/affinity.safetensors     the calibration pass of the first proxy (dtpshard affinity)
    DIR/affinity-PROXY.safetensors  the other proxies' passes, on the same tokens
    DIR/layouts/NAME.json        every layout, scored (J and its per-layer parts, under its own proxy)
    DIR/scores.json              J of every layout under every proxy
    DIR/timings.json             wall seconds per phase (affinity per proxy, layouts, zero-shot, cache, each run)
    DIR/zeroshot.json            per layout: KL and perplexity of the untrained student (step 0)
    DIR/teacher-cache/           with teacher_cache_k = K > 0: the teacher's top-K log-probabilities of
                                 every arm's training blocks, computed once and read by every arm
                                 (dtpshard teacher-cache; the arms train on the top-K KL + tail)
    DIR/runs/NAME-sSEED/         one distillation run directory per arm (dtpshard distill)
    DIR/report.md, DIR/figures/  the report (dtpshard report DIR)

Each stage is skipped when its output exists, and a run with a DONE marker is not touched, so
rerunning the same command after an interruption continues where it stopped (an interrupted
run resumes from its last checkpoint).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from dtpshard.affinity.file import Affinity
from dtpshard.core.errors import UserError, check_result
from dtpshard.core.guard import check_outputs, local_paths
from dtpshard.core.io import atomic_write_text, dumps, read_json, read_json_object
from dtpshard.core.layout import Layout
from dtpshard.core.owned import ID, claim
from dtpshard.core.reading import read_text
from dtpshard.core.settings import DENSE
from dtpshard.layouts.make import make_layout
from dtpshard.layouts.score import colocated_score
from dtpshard.studies import downstream
from dtpshard.studies.arms import shared_suffix
from dtpshard.studies.config import (  # noqa: F401
    FORMAT,
    OPTIMISING,
    Experiment,
    Overrides,
    check_config,
    load_config,
    read_record,
    record,
    resolve_model,
)
from dtpshard.studies.provenance import (
    LAYOUT_DIR,
    PROVENANCE,
    RUNS,
    SCORES,
    SENSITIVITY,
    TEACHER_CACHE,
    TIMINGS,
    ZEROSHOT,
    write_provenance,
)
from dtpshard.studies.provenance import timed as _timed
from dtpshard.studies.report import write_report
from dtpshard.studies.smollm2 import MODEL_KEY
from dtpshard.studies.study import CLEARABLE
from dtpshard.training.distill import DistillConfig, distill
from dtpshard.training.settings import Recipe, compared_fields

AFFINITY = "affinity.safetensors"


def affinity_name(cfg: Experiment, proxy: str) -> str:
    """The first proxy's pass is affinity.safetensors (what the optimised arms read); the others
    are affinity-PROXY.safetensors."""
    return AFFINITY if proxy == cfg.proxies[0] else f"affinity-{proxy}.safetensors"


# -- the pipeline ------------------------------------------------------------------------------
def _say(msg: str) -> None:  # progress goes to stderr; stdout is the report's path alone
    print(f"[experiment] {msg}", file=sys.stderr, flush=True)


def _compared(data: dict[str, Any]) -> dict[str, Any]:
    """The settings a resumed experiment must share, from a config.json record read as its typed
    Experiment (so a record from before a key existed reads as that key's default): all of them
    but the recipe's operational ones (progress bar, checkpoint cadence, ...), which do not change
    what is computed, and the arms: arms may be added to a study (a recipe study is planned from
    its learning-rate sweep), and each run refuses to resume with settings other than its own."""
    out = dataclasses.asdict(read_record(data))
    out["training"] = {k: v for k, v in out["training"].items() if k in compared_fields(Recipe)}
    out.pop("arms", None)
    out.pop("eval", None)  # benchmarks change nothing that is trained: a finished study may add them
    return out


def _check_inputs(cfg: Experiment, model: Path) -> None:
    """Every input an experiment reads, read once before anything is written: the weights (headers
    and shapes), the tokenizer and every local text file."""
    from dtpshard.data.blocks import read_text_files
    from dtpshard.model.checkpoint import load_tokenizer, open_checkpoint

    open_checkpoint(model)
    load_tokenizer(model)
    for where, text in (("calibration.text", cfg.calibration.text), ("evaluation.text", cfg.evaluation.text),
                        ("training.text", cfg.training.text)):
        if text:
            try:
                read_text_files(text)
            except UserError as e:
                raise UserError(f"{where}: {e}") from None


EXPERIMENT_DIR = "an experiment directory"  # what the refusals call it


def _prepare_dir(out: Path, cfg: Experiment, force: bool) -> None:
    """config.json in place: a rerun of the same experiment resumes (in a directory that is its
    own); --force starts one over, removing only the experiment's own files (core/owned.py)."""
    saved = out / "config.json"  # run_experiment has refused another command's or unrelated files
    data = record(cfg)
    names = (LAYOUT_DIR, ZEROSHOT, RUNS, TEACHER_CACHE, SCORES, SENSITIVITY, TIMINGS, PROVENANCE, "report.md",
             "figures", downstream.ROWS, downstream.KEPT,
             *sorted(p.name for p in out.glob("affinity*.safetensors")), "config.json")
    if saved.is_file() and not force:
        try:
            old = _compared(read_json(saved))
        except (OSError, UserError):  # unreadable, or not an experiment's record: every setting differs
            old = {}
        new = _compared(data)
        if old != new:
            diff = [k for k in sorted(set(new) | set(old)) if old.get(k) != new.get(k)]
            raise UserError(f"--out {out}: an experiment with other settings ({', '.join(diff)}) is there "
                            "(use --force to start it over)")
    elif out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    data[ID] = claim(out, "experiment", names, "config.json", force, CLEARABLE)
    text = dumps(data, indent=1) + "\n"
    if not saved.is_file() or force or read_text(saved, 1 << 24, "experiment record") != text:  # arms added
        atomic_write_text(saved, text)


def _affinity(cfg: Experiment, model: Path, out: Path) -> dict[str, Path]:
    """One calibration pass per proxy, on the same tokens (same source, blocks and seed)."""
    paths = {}
    for proxy in cfg.proxies:
        path = paths[proxy] = out / affinity_name(cfg, proxy)
        if path.is_file():
            _say(f"affinity ({proxy}): {path} (done before)")
            continue
        from dtpshard.affinity.calibrate import CalibrationData, PassSettings, calibrate

        cal = cfg.calibration
        _say(f"affinity ({proxy}): {cal.blocks} blocks x {cal.seq_len} tokens")
        tokenizer = None if cfg.tokenizer is None else Path(cfg.tokenizer)
        data = CalibrationData(cal.text, cal.dataset, cfg.text_field, tokenizer, cal.blocks, cal.seq_len, cal.seed)
        with _timed(out, f"affinity {proxy}"):
            calibrate(model, path, data, delay=cfg.delay, proxy=proxy,
                      run=PassSettings(micro_batch=cal.micro_batch, device=cfg.device), progress=cfg.training.progress)
    return paths


class _Affinities(dict):
    """proxy -> its Affinity, each file read once, when first asked for (layouts, then scores)."""

    def __init__(self, paths: dict[str, Path]):
        super().__init__()
        self.paths = paths

    def __missing__(self, proxy: str) -> Any:
        self[proxy] = affinity = Affinity.load(self.paths[proxy])
        return affinity


def _layouts(cfg: Experiment, affinities: _Affinities, out: Path, model: Path) -> dict[str, Path]:
    paths = {}
    (out / LAYOUT_DIR).mkdir(exist_ok=True)
    for spec in (s for arm in cfg.arms for s in arm.layouts):
        path = paths[spec.name] = out / LAYOUT_DIR / f"{spec.name}.json"
        if path.is_file():
            continue
        proxy = spec.proxy or cfg.proxies[0]
        affinity = affinities[proxy]
        lay = cfg.layouts
        optimising = spec.kind in OPTIMISING
        with _timed(out, "layouts"):
            layout = make_layout(affinity.model, cfg.dtp, spec.kind, affinity=affinity,
                                 layers=spec.layers, restarts=lay.restarts if optimising else 1,
                                 seed=spec.seed, kv_search=lay.kv_search, max_sweeps=lay.max_sweeps,
                                 shared=spec.shared, shared_by=spec.shared_by)
        if optimising and proxy != cfg.proxies[0]:  # its own group in the report
            layout.kind = f"{layout.kind}-{proxy}"
        layout.kind += shared_suffix(spec.shared)  # so is a shared fraction
        if spec.delayed is not None:
            from dtpshard.layouts.delayed import partial_layout
            from dtpshard.layouts.delayed import suffix as partial_suffix
            from dtpshard.studies.delayed import study_sensitivity

            by_sensitivity = spec.delayed_by == "sensitivity"
            base = spec.name.removesuffix(partial_suffix(spec.delayed, spec.delayed_by))  # chosen under this one
            sens = study_sensitivity(cfg, model, out, base, layout, _say) if by_sensitivity else None
            with _timed(out, "layouts"):
                layout = partial_layout(layout, float(spec.delayed), spec.delayed_by, affinity=affinity,
                                        sensitivity=sens, seed=spec.seed, kv_search=lay.kv_search,
                                        max_sweeps=lay.max_sweeps)
        layout.score["name"] = spec.name
        layout.score["proxy"] = proxy if optimising else None
        layout.save(path)
        s = layout.score
        _say(f"layout {spec.name}: J = {s['J']:.4f} ({s['ratio_to_random']:.3f}x random), {s['seconds']:.1f} s")
    return paths


def _proxy_scores(cfg: Experiment, affinities: _Affinities, layouts: dict[str, Path], out: Path) -> None:
    """DIR/scores.json: J of every layout under every proxy, {layout: {proxy: J}}."""
    path = out / SCORES
    done = read_json_object(path, "proxy scores") if path.is_file() else {}
    # an entry that is not a number (a hand edit) is scored again
    done = {n: {p: v for p, v in t.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for n, t in done.items() if isinstance(t, dict)}
    todo = [(n, p) for n in layouts for p in cfg.proxies if p not in done.get(n, {})]
    if not todo:
        return
    with _timed(out, "proxy scores"):
        loaded = {name: Layout.load(layouts[name]) for name in dict.fromkeys(n for n, _ in todo)}
        for name, proxy in todo:
            done.setdefault(name, {})[proxy] = colocated_score(affinities[proxy], loaded[name])["J"]
        atomic_write_text(path, dumps(done, indent=1, sort_keys=True) + "\n")


class _CachedTeacher:
    """The dense teacher's LM-head input, computed once per evaluation batch and reused for
    every layout (the teacher does not depend on the layout): half the zero-shot cost."""

    def __init__(self, model: Any):
        self.model, self.head_weight, self._h = model, model.head_weight, {}

    def hidden(self, ids: Any) -> Any:
        key = (tuple(ids.shape), ids.cpu().numpy().tobytes())
        if key not in self._h:
            self._h[key] = self.model.hidden(ids)
        return self._h[key]


def _zero_shot(cfg: Experiment, model: Path, layouts: dict[str, Path], out: Path) -> None:
    """KL and perplexity of every layout's untrained student on the evaluation blocks (step 0)."""
    path = out / ZEROSHOT
    done = read_json_object(path, "zero-shot results") if path.is_file() else {}
    todo = [n for n in layouts if n not in done]
    if not todo:
        return
    import torch

    from dtpshard.core.devices import pick_device
    from dtpshard.model.checkpoint import load_tokenizer, open_checkpoint
    from dtpshard.model.dtp import DTPModel
    from dtpshard.training.evaluate import eval_blocks_for, evaluate

    dev = pick_device(cfg.device)
    ckpt = open_checkpoint(model)
    sd = ckpt.state_dict(torch.float32)
    teacher = _CachedTeacher(DTPModel.from_state_dict(ckpt.hf_config, sd, settings=DENSE).to(dev).eval())
    ev, train = cfg.evaluation, cfg.training
    blocks, _ = eval_blocks_for(model, ev.text, ev.dataset, ev.blocks, train.seq_len,
                                load_tokenizer(cfg.tokenizer or model), cfg.text_field, named=cfg.tokenizer)
    micro = ev.micro_batch or train.micro_batch
    for name in todo:
        with _timed(out, "zero-shot"):
            student = DTPModel.from_state_dict(ckpt.hf_config, sd, layout=Layout.load(layouts[name]),
                                               settings=cfg.dtp).to(dev)
            result = evaluate(student, teacher, blocks, micro, train.precision)
            check_result({k: result[k] for k in ("kl", "ppl", "top1")}, f"zero-shot {name}")
            done[name] = result
            del student
            atomic_write_text(path, dumps(done, indent=1) + "\n")
        _say(f"zero-shot {name}: KL {done[name]['kl']:.4f}, ppl {done[name]['ppl']:.2f}")


def _teacher_cache(cfg: Experiment, model: Path, out: Path, runs: list[tuple[str, int]]) -> Path | None:
    """One cache of every arm's training blocks (each seed's), so the teacher runs once per block."""
    if not cfg.teacher_cache_k or not runs:
        return None
    from dtpshard.core.devices import pick_device
    from dtpshard.model.checkpoint import open_checkpoint
    from dtpshard.training.teacher_cache import build_cache, cache_blocks

    t = cfg.training
    seeds = sorted({seed for _, seed in runs})
    tokenizer = None if cfg.tokenizer is None else Path(cfg.tokenizer)
    _say(f"teacher cache: top {cfg.teacher_cache_k} of the training blocks of seeds {seeds}")
    teacher = open_checkpoint(model)  # config.json read once for the blocks and the cache
    blocks = cache_blocks(teacher, seeds, t.steps, t.seq_len, t.micro_batch, t.grad_accum, t.nproc,
                          t.text, t.dataset, cfg.text_field, tokenizer)
    with _timed(out, "teacher cache"):
        return build_cache(teacher, blocks, out / TEACHER_CACHE, cfg.teacher_cache_k, micro_batch=t.micro_batch,
                           device=pick_device(cfg.device), precision=t.precision, progress=t.progress,
                           tokenizer=tokenizer, force=True)  # arms added with new seeds: the study's own cache
                                                             # grows (claim clears only a cache of ours)


def _arms(cfg: Experiment, model: Path, layouts: dict[str, Path], out: Path,
          tensorboard: Path | None = None) -> None:
    from dtpshard.training.rundir import is_done

    ev = cfg.evaluation
    recipe = {f.name: getattr(cfg.training, f.name) for f in dataclasses.fields(cfg.training)}
    runs = [(spec.name, seed, arm) for arm in cfg.arms for spec in arm.layouts for seed in arm.seeds]
    todo = [r for r in runs if not is_done(out / RUNS / r[2].run_name(r[0], r[1]))]
    cache = _teacher_cache(cfg, model, out, [r[:2] for r in runs]) if todo else None  # every seed's blocks: one plan
    for k, (name, seed, arm) in enumerate(runs, 1):
        run = out / RUNS / arm.run_name(name, seed)
        if is_done(run):
            _say(f"arm {k}/{len(runs)} {run.name}: done before")
            continue
        _say(f"arm {k}/{len(runs)} {run.name}: distilling")
        with _timed(out, f"run {run.name}"):
            distill(DistillConfig(
                teacher=model, out=run, layout=layouts[name], **cfg.dtp.to_json(), seed=seed, device=cfg.device,
                eval_blocks=ev.blocks,
                eval_text=ev.text, eval_dataset=ev.dataset, eval_micro_batch=ev.micro_batch,
                text_field=cfg.text_field, tokenizer=cfg.tokenizer,
                tensorboard=None if tensorboard is None else tensorboard / run.name,
                teacher_cache=cache, **{**recipe, "adapters": arm.adapters, "lr": arm.lr or recipe["lr"],
                                         "recipe": arm.recipe or recipe["recipe"],
                                         "ce_weight": recipe["ce_weight"] if arm.ce_weight is None else arm.ce_weight}))


def run_experiment(cfg: Experiment, out: Path, force: bool = False, tensorboard: Path | None = None,
                   study: Path | None = None) -> Path:
    """Every stage of a checked config (`check_config`) into `out`; returns the report path.
    study: the study file it came from (an input like the model and the text files)."""
    from dtpshard.model.checkpoint import read_shape
    from dtpshard.training.rundir import locked, refuse_foreign, refuse_unrelated

    out = Path(out)
    cal, ev, tr = cfg.calibration, cfg.evaluation, cfg.training
    inputs = {"the model directory": local_paths([cfg.model if cfg.model != MODEL_KEY else None]),
              "the study file": study, "the tokenizer": cfg.tokenizer, "the calibration text": cal.text,
              "the evaluation text": ev.text, "the training text": tr.text,
              "the dataset": local_paths([cal.dataset, ev.dataset, tr.dataset])}
    outputs = {"--out": out, "--tensorboard": tensorboard}
    check_outputs(outputs, inputs)  # first: the most precise refusal, and nothing read yet
    refuse_unrelated(out, force, ("config.json",), EXPERIMENT_DIR)  # before any model is read
    model = resolve_model(cfg.model)
    check_outputs(outputs, {"the model directory": model})  # a hub id or the demo's key, now a directory
    shape = read_shape(model)

    cfg.dtp.check(shape)
    refuse_foreign(out, FORMAT.split("/")[0] + "/", EXPERIMENT_DIR)  # another command's directory
    _check_inputs(cfg, model)
    with locked(out):
        _prepare_dir(out, cfg, force)
        write_provenance(cfg, model, out)
        affinities = _Affinities(_affinity(cfg, model, out))
        layouts = _layouts(cfg, affinities, out, model)
        _proxy_scores(cfg, affinities, layouts, out)
        _zero_shot(cfg, model, layouts, out)
        _arms(cfg, model, layouts, out, tensorboard)
        if cfg.eval.tasks:  # every arm's final student, its untrained form and the teacher, on the same items
            downstream.for_experiment(cfg, model, layouts, out)
        report = write_report(out)
    _say(f"report: {report}")
    return report
