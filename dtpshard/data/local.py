"""Data a user already has on disk, named by `--dataset PATH`: a directory written by `datasets`'
`save_to_disk`, one parquet file, or a directory of parquet files.

A `save_to_disk` DatasetDict with a held-out split gives the roles by split, as WikiText-2 does
(eval: `test`, else `validation`; calibration/train: `train`); any other source gives its documents,
and the caller holds out by content hash (blocks.is_eval_doc).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dtpshard.core.errors import UserError, first_line
from dtpshard.core.reading import open_regular

EVAL_SPLITS = ("test", "validation")
_SAVED_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")
# one --text or parquet file, held in memory whole (a text) or column by column (parquet): more is
# not text for a calibration or a distillation run, and a device or a FIFO is never read at all
TEXT_BYTES = 16 << 30


def is_local_dataset(name: str) -> bool:
    return Path(name).expanduser().exists()


def read_parquet(path: Path, field: str, where: str | None = None) -> list[str]:
    """The string values of column `field` of one parquet file (a regular file of at most TEXT_BYTES)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading parquet needs pyarrow (pip install 'dtpshard[hf]' or pyarrow)") from None
    with open_regular(path, TEXT_BYTES, "text file", where) as f:  # pyarrow reads the file we checked
        try:
            table = pq.ParquetFile(f)
            names = table.schema_arrow.names
        except Exception as e:  # pyarrow raises its own exception types
            raise UserError(f"{path}: not a readable parquet file ({first_line(e, named=True)})") from None
        if field not in names:
            raise UserError(f"{path}: no column {field!r} (columns: {', '.join(names)}); pick one with --text-field")
        kind = table.schema_arrow.field(field).type
        if not _is_text(kind):
            raise UserError(f"{path}: column {field!r} holds {kind}, not text; pick a text column with --text-field")
        try:  # a page's data is read only now: a corrupt one fails here, in pyarrow's own words
            column = table.read(columns=[field]).column(field)
        except Exception as e:
            raise UserError(f"{path}: column {field!r} is unreadable ({first_line(e, named=True)}): a damaged "
                            "parquet file") from None
    return [d for d in column.to_pylist() if isinstance(d, str)]


def _is_text(kind: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind) \
        or pa.types.is_dictionary(kind) and _is_text(kind.value_type)


def _column(ds, field: str, where: str) -> list[str]:
    if field not in ds.column_names:
        raise UserError(f"{where}: no column {field!r} (columns: {', '.join(ds.column_names)}); "
                        "pick one with --text-field")
    return [d for d in ds[field] if isinstance(d, str)]


def _saved(path: Path, role: str, field: str) -> tuple[list[str], str, bool]:
    try:
        import datasets
    except ImportError:
        raise UserError(f"--dataset {path}: a save_to_disk directory needs the `datasets` package "
                        "(pip install 'dtpshard[hf]')") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises many types for a damaged directory
        raise UserError(f"--dataset {path}: cannot load it with datasets.load_from_disk "
                        f"({first_line(e, named=True)})") from None
    if not isinstance(ds, datasets.DatasetDict):
        return _column(ds, field, str(path)), f"dataset:{path}", False
    held_out = next((s for s in EVAL_SPLITS if s in ds), None)
    if held_out is not None and "train" in ds and role != "all":
        split = held_out if role == "eval" else "train"
        return _column(ds[split], field, f"{path} [{split}]"), f"dataset:{path}/{split}", True
    docs = [d for s in sorted(ds) for d in _column(ds[s], field, f"{path} [{s}]")]
    return docs, f"dataset:{path} (splits {', '.join(sorted(ds))})", False


def read_local_dataset(name: str, role: str, field: str = "text") -> tuple[list[str], str, bool]:
    """(documents, source description, whether the role was chosen by split) of a dataset on disk."""
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".parquet":
            raise UserError(f"--dataset {path}: a file must be .parquet (use --text for .txt/.jsonl/.json files)")
        return read_parquet(path, field), f"dataset:{path}", False
    if any((path / m).is_file() for m in _SAVED_MARKERS):
        return _saved(path, role, field)
    files = sorted(p for p in path.rglob("*.parquet") if p.is_file())
    if not files:
        raise UserError(f"--dataset {path}: neither a save_to_disk directory nor a directory of parquet files")
    docs = [d for f in files for d in read_parquet(f, field)]
    return docs, f"dataset:{path} ({len(files)} parquet files)", False
