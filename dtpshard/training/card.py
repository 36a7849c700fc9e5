"""The model card (RUN/final/README.md) of a distilled student, written from its run's records:
RUN/config.json, metrics.jsonl, the layout file, the teacher's README front matter (its license)
and the sha256 of the teacher's weight files. A card is made to be uploaded, so it names no place
on the machine it was made on: the teacher by its Hub id or directory name, the run's files
relative to the card, any other file by its name.

Hashing a 70B teacher's weights takes minutes, so it is done once, by rank 0 in a background
thread that runs while the student trains (`TeacherHashes`), and not at all for an experiment's
run: the experiment recorded the same hashes in DIR/provenance.json when it started.
"""
from __future__ import annotations

import os
import re
import threading
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError, first_line
from dtpshard.core.io import file_hashes, load_yaml, read_json_object, read_text
from dtpshard.core.layout import Layout
from dtpshard.model.student import front_matter, usage_section
from dtpshard.model.tensor_files import TensorFiles
from dtpshard.training import rundir

# an experiment's run is DIR/runs/NAME-sSEED beside DIR/config.json of this format and
# DIR/provenance.json (studies/provenance.py; training does not import studies)
_EXPERIMENT_FORMAT, _PROVENANCE, _RUNS, _REPORT = "dtpshard.experiment/", "provenance.json", "runs", "report.md"
CARD_BYTES = 16 << 20  # a model card (README.md) read for its front matter; real ones are < 100 KiB
_LICENSE_KEYS = ("license", "license_name", "license_link")


def experiment_of(run: Path) -> Path | None:
    """The experiment directory a run belongs to, None for a run of its own."""
    top = Path(run).absolute().parent.parent
    if Path(run).absolute().parent.name != _RUNS:
        return None
    try:
        fmt = read_json_object(top / rundir.CONFIG, "experiment config").get("format", "")
    except UserError:
        return None
    return top if str(fmt).startswith(_EXPERIMENT_FORMAT) else None


class TeacherHashes:
    """sha256 of every weight file of the teacher, computed in a thread started now; `result()`
    waits for it. An experiment's run takes them from the experiment's provenance.json."""

    def __init__(self, teacher: Path, run: Path, known: dict[str, str] | None = None):
        """known: the hashes already taken (a run records its teacher's: training/inputs.py)."""
        self.teacher, self.hashes, self.error = Path(teacher), known or None, None
        exp = experiment_of(run)
        if exp is not None and self.hashes is None:
            self.hashes = self._recorded(exp)
        self.thread = None
        if self.hashes is None:
            self.thread = threading.Thread(target=self._hash, name="teacher-sha256", daemon=True)
            self.thread.start()

    def _recorded(self, exp: Path) -> dict[str, str] | None:
        try:
            prov = read_json_object(exp / _PROVENANCE, "provenance")
        except UserError:
            return None
        files = prov.get("model_files") if isinstance(prov, dict) else None
        same = isinstance(prov, dict) and Path(str(prov.get("model", ""))).absolute() == self.teacher.absolute()
        return dict(files) if same and isinstance(files, dict) and files else None

    def _hash(self) -> None:
        try:
            self.hashes = file_hashes(TensorFiles(self.teacher).files)
        except (OSError, UserError) as e:  # the card says so; the student is written anyway
            self.error = first_line(e)

    def result(self) -> dict[str, str] | None:
        if self.thread is not None:
            self.thread.join()
        return self.hashes


def teacher_license(teacher: Path) -> dict[str, Any]:
    """license (and license_name / license_link) from the YAML front matter of the teacher's
    README.md, the Hub's model card; {} when it has none."""
    try:  # a regular file of a sane size, its front matter without YAML aliases, else none
        text = read_text(Path(teacher) / "README.md", CARD_BYTES, "model card")
        end = text.find("\n---", 3) if text.startswith("---") else -1
        meta = load_yaml(text[3:end], "README.md") if end > 0 else None
    except UserError:
        return {}
    return {k: meta[k] for k in _LICENSE_KEYS if isinstance(meta, dict) and meta.get(k) is not None}


_ABSOLUTE = re.compile(r"(?<![\w.~-])/[^\s,;\[\]()`]+")  # a POSIX absolute path inside a line of text


def local_name(path: str | Path, card_dir: Path, root: Path) -> str:
    """How a card in `card_dir` names `path`: relative to it when both lie under `root` (the run,
    or its experiment), else by the file's name alone."""
    path = Path(path).absolute()
    if path.is_relative_to(root.absolute()):
        return os.path.relpath(path, card_dir.absolute())
    return path.name


def _unplaced(text: str, card_dir: Path, root: Path) -> str:
    """`text` (a data source's description) with each absolute path in it named as `local_name` says."""
    return _ABSOLUTE.sub(lambda m: local_name(m.group(0), card_dir, root), text)


def _layout_row(config: dict[str, Any], card_dir: Path, root: Path) -> str:
    path, kind = config.get("layout"), config.get("layout_kind")
    if path is None:
        return "contiguous (no layout file)"
    text = f"`{local_name(path, card_dir, root)}`, kind {kind}, sha256 {config.get('layout_sha256')}"
    try:
        score = Layout.load(path).score
    except UserError:
        return text + " (the file is no longer readable)"
    if isinstance(score.get("J"), (int, float)):
        text += f"; co-located score J = {score['J']:.4g}"
        if isinstance(score.get("random_expectation"), (int, float)):
            text += f" (random expectation {score['random_expectation']:.4g})"
    return text


def _version() -> str:
    try:
        return version("dtpshard")
    except PackageNotFoundError:  # a checkout that was never installed
        return "(not installed)"


def _evals(run: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    rows = [r for r in rundir.read_metrics(run) if r.get("kind") == "eval"]
    first = next((r for r in rows if r.get("step") == 0), None)
    return first, rows[-1] if rows else None


def base_model(teacher: Path) -> str:
    """The Hub id of a teacher read from the Hub's cache (.../models--OWNER--NAME/snapshots/REV),
    else its directory's name."""
    parts = Path(teacher).absolute().parts
    for i, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            return part.removeprefix("models--").replace("--", "/")
    return Path(teacher).name


def _compared(first: dict[str, Any] | None, last: dict[str, Any] | None) -> str:
    """The final held-out numbers and how they compare with the untrained student's (step 0)."""
    if last is None:
        return "not evaluated"
    text = (f"KL(teacher ‖ student) {last['eval_kl']:.4f} nats/token, perplexity {last['eval_ppl']:.3f} "
            f"at step {last['step']}")
    if first is not None and first is not last and first.get("eval_kl"):
        text += (f"; at step 0 (the teacher's weights run as DTP, untrained) {first['eval_kl']:.4f} and "
                 f"{first['eval_ppl']:.3f}: the KL is {last['eval_kl'] / first['eval_kl']:.3f}× step 0's")
    return text


def student_card(run: Path, block: dict[str, Any], hashes: TeacherHashes | None, dtype: str = "float32") -> str:
    """README.md of RUN/final: the Hub's front matter (base model, the teacher's license), what
    the student is, the run (teacher and its sha256, L, δ, stage3, the layout's kind and J, steps,
    tokens, data, the final held-out KL and perplexity against step 0's), how to run it and, for
    an experiment's run, the report it belongs to."""
    run = Path(run)
    config = read_json_object(run / rundir.CONFIG, "run config")
    teacher = Path(config["teacher"])
    exp = experiment_of(run)
    card_dir, root = run / rundir.FINAL, exp if exp is not None else run
    digests = None if hashes is None else hashes.result()
    if digests:
        weights = "<br>".join(f"`{name}` {digest}" for name, digest in sorted(digests.items()))
    else:
        weights = f"not computed ({hashes.error})" if hashes is not None and hashes.error else "not computed"
    steps, per_step = config.get("steps"), config.get("tokens_per_step")
    tokens = steps * per_step if isinstance(steps, int) and isinstance(per_step, int) else None
    rows = [
        ("teacher", f"`{base_model(teacher)}` ({block.get('family')} family)"),
        ("teacher weights, sha256", weights),
        ("DTP settings", f"L = {block.get('devices')}, δ = {block.get('delay')}, stage 3 `{block.get('stage3')}`"),
        ("layout", _layout_row(config, card_dir, root)),
        ("training", (f"{steps} steps × {per_step} tokens = {tokens} tokens (global batch "
                      f"{config.get('global_batch')} × {config.get('seq_len')}), seed {config.get('seed')}, "
                      f"lr {config.get('lr')}, "
                      f"{config.get('precision')}, {config.get('world_size')} process(es)")),
        ("training data", _unplaced(f"{config.get('train_data')}", card_dir, root)),
        ("held-out evaluation", (f"{_unplaced(str(config.get('eval_data')), card_dir, root)}, "
                                 f"{config.get('eval_blocks')} blocks of {config.get('seq_len')} + 1 tokens")),
        ("result", _compared(*_evals(run))),
        ("made by", f"dtpshard {_version()} (`dtpshard distill`)"),
    ]
    if exp is not None:
        report = local_name(exp / _REPORT, card_dir, root)
        rows.append(("experiment report", f"`{report}` (this run is `{run.name}` of that experiment)"))
    table = "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    meta = {"base_model": base_model(teacher), **teacher_license(teacher)}
    return (front_matter(meta) +
            f"\n# DTP student of {base_model(teacher)} (L = {block.get('devices')}, δ = {block.get('delay')})\n\n"
            f"Distilled from `{base_model(teacher)}` by `dtpshard distill` to compute its Delayed Tensor Parallelism "
            f"form (below). The run's own records are `{local_name(run / rundir.CONFIG, card_dir, root)}` and "
            f"`{local_name(run / rundir.METRICS, card_dir, root)}`.\n\n"
            "## The run\n\n" + table + "\n" + usage_section(block, dtype))
