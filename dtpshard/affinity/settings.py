"""What a calibration pass reads and how it runs, without torch: the one definition of those
settings, taken whole by `dtpshard affinity` and `convert` (their flags) and by a study's
[calibration] table (its defaults)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dtpshard.core.vocab import AffinityDType, Count, Device, NonNegativeInt, NonNegativeNumber, Seed


@dataclass(frozen=True)
class CalibrationData:
    """What the pass scores: `blocks` blocks of `seq_len` tokens of --text files, a --dataset, or
    (neither) the built-in offline corpus, in a document order seeded by `seed`.

    Args:
        text: calibration text files or directories (.txt split at blank lines, .jsonl/.json records, .parquet)
        dataset: a save_to_disk directory, a parquet file or directory, or a hub name: fineweb-edu, wikitext-2,
            owner/name[:config]
        text_field: the column or JSON field that holds the text
        tokenizer: tokenizer directory, where MODEL has no tokenizer files
        blocks: number of calibration blocks
        seq_len: tokens per block
        seed: seed of the document order
    """

    text: list[str] | None = None
    dataset: str | None = None
    text_field: str = "text"
    tokenizer: Path | None = None  # None: the model's
    blocks: Count = 64
    seq_len: Count = 1024
    seed: Seed = 0


@dataclass(frozen=True)
class PassSettings:
    """How the pass runs; none of it changes the scores beyond float rounding.

    Args:
        micro_batch: sequences per module call (memory)
        chunk: cap on tokens per score chunk; 0 = automatic (memory)
        dtype: compute dtype of the calibration pass (sums are always accumulated in float64)
        offload: --offload reads one decoder layer at a time from the checkpoint, --no-offload holds the whole model;
            default: offload only when the model does not fit --memory-budget
        memory_budget: GiB the pass may hold (model and calibration hidden states); 0 = 0.8 x the memory available
            now (RAM, or the GPU's free memory)
        spill_dir: directory for the hidden states that do not fit the budget, in anonymous temporary files
            (default: the directory of --out)
    """

    micro_batch: Count = 4
    chunk: NonNegativeInt = 0
    device: Device = "auto"
    dtype: AffinityDType = "float32"
    offload: bool | None = None
    memory_budget: NonNegativeNumber = 0.0
    spill_dir: Path | None = None


CALIBRATION_DATA, PASS_SETTINGS = CalibrationData(), PassSettings()  # the defaults, as argument defaults
