"""Every data source a user may already have, built here: --text .txt/.jsonl/.json/.parquet,
--dataset as a save_to_disk directory, a parquet file, a directory of parquet files; --text-field;
and the offline corpus as the one default (no hub attempt) for every command."""
import json

import pytest

from dtpshard.cli import main
from dtpshard.core.errors import UserError
from dtpshard.data.blocks import is_eval_doc, load_texts, read_text_files

DOCS = [f"document number {i} about {w} and more words" for i, w in enumerate(["cats", "dogs", "owls"] * 20)]
TRAIN = [d for d in DOCS if not is_eval_doc(d)]


@pytest.fixture
def no_hub(monkeypatch):
    """Any attempt to reach the hub fails the test (the default must be the offline corpus)."""
    datasets = pytest.importorskip("datasets")

    def refuse(*a, **k):
        raise AssertionError(f"hub access attempted: {a}")

    monkeypatch.setattr(datasets, "load_dataset", refuse)


def test_text_file_kinds(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    (tmp_path / "a.txt").write_text("\n\n".join(DOCS[:2]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS[2:4]))
    (tmp_path / "c.json").write_text(json.dumps([{"body": d, "n": 1} for d in DOCS[4:6]]))
    (tmp_path / "d.json").write_text(json.dumps(DOCS[6:8]))  # an array of strings
    pq.write_table(pa.table({"body": DOCS[8:10], "n": [1, 2]}), tmp_path / "e.parquet")
    assert read_text_files([tmp_path / "a.txt"]) == DOCS[:2]
    got = read_text_files([tmp_path / n for n in ("b.jsonl", "c.json", "d.json", "e.parquet")], text_field="body")
    assert got == DOCS[2:10]
    # JSON lines named .json
    (tmp_path / "f.json").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:2]))
    assert read_text_files([tmp_path / "f.json"]) == DOCS[:2]
    with pytest.raises(UserError, match=r"c.json: item 0 is not a string or an object with a string field 'text'"):
        read_text_files([tmp_path / "c.json"])


def test_dataset_parquet_file_and_directory(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    (tmp_path / "dir" / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"content": DOCS[:30]}), tmp_path / "dir" / "part-0.parquet")
    pq.write_table(pa.table({"content": DOCS[30:]}), tmp_path / "dir" / "sub" / "part-1.parquet")
    one = load_texts(dataset=str(tmp_path / "dir" / "part-0.parquet"), text_field="content", role="all")
    assert list(one.docs) == DOCS[:30]
    many = load_texts(dataset=str(tmp_path / "dir"), text_field="content")
    assert list(many.docs) == TRAIN and "2 parquet files" in many.source
    assert all(is_eval_doc(d) for d in load_texts(dataset=str(tmp_path / "dir"), text_field="content",
                                                  role="eval").docs)
    with pytest.raises(UserError, match=r"no column 'text' \(columns: content\); pick one with --text-field"):
        load_texts(dataset=str(tmp_path / "dir"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="neither a save_to_disk directory nor a directory of parquet files"):
        load_texts(dataset=str(tmp_path / "empty"))
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(UserError, match="a file must be .parquet"):
        load_texts(dataset=str(tmp_path / "x.txt"))


def test_dataset_save_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets", reason="save_to_disk directories need the `datasets` package")
    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(str(tmp_path / "plain"))
    got = load_texts(dataset=str(tmp_path / "plain"), text_field="body")
    assert list(got.docs) == TRAIN  # no split: the content-hash rule holds documents out
    held = DOCS[:5]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": DOCS[5:]}),
                               "test": datasets.Dataset.from_dict({"body": held})})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert list(load_texts(dataset=str(tmp_path / "dict"), text_field="body", role="eval").docs) == held
    assert list(load_texts(dataset=str(tmp_path / "dict"), text_field="body", role="train").docs) == DOCS[5:]
    with pytest.raises(UserError, match=r"no column 'text' \(columns: body\)"):
        load_texts(dataset=str(tmp_path / "plain"))


def test_every_command_defaults_to_the_offline_corpus(tiny_dirs, tmp_path, capsys, no_hub):
    from dtpshard.model.checkpoint import load_tokenizer
    from dtpshard.training.distill import DistillConfig, resolve, train_blocks_for

    model = tiny_dirs["llama"]
    assert main(["eval", str(model), "--devices", "2", "--blocks", "1", "--seq-len", "8", "--json",
                 "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["data"].startswith("offline:")
    assert main(["affinity", str(model), "--out", str(tmp_path / "a.safetensors"), "--blocks", "1",
                 "--seq-len", "16", "--no-progress", "--json", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["data"].startswith("offline:") and out["tokens"] == 16 and out["edges"] == 5
    cfg = resolve(DistillConfig(teacher=model, out=tmp_path / "run", steps=1, seq_len=8, micro_batch=1, grad_accum=1))
    _, source = train_blocks_for(cfg, 1, load_tokenizer(model))
    assert source.startswith("offline:")


def test_eval_on_a_saved_dataset_with_a_text_field(tiny_dirs, tmp_path, capsys):
    datasets = pytest.importorskip("datasets", reason="save_to_disk directories need the `datasets` package")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": DOCS}),
                               "validation": datasets.Dataset.from_dict({"body": DOCS[:10]})})
    dd.save_to_disk(str(tmp_path / "ds"))
    assert main(["eval", str(tiny_dirs["llama"]), "--dataset", str(tmp_path / "ds"), "--text-field", "body",
                 "--blocks", "2", "--seq-len", "8", "--json", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["data"].startswith(f"dataset:{tmp_path / 'ds'}/validation") and out["tokens"] == 16


def test_experiment_config_names_the_text_field_and_tokenizer():
    from dtpshard.studies.config import check_config

    base = {"model": "m", "arms": [{"kind": "contiguous"}]}
    assert check_config(dict(base)).text_field == "text"
    cfg = check_config({**base, "text_field": "body", "tokenizer": "tok"})
    assert cfg.text_field == "body" and cfg.tokenizer == "tok"
    with pytest.raises(UserError, match="unknown key 'training.tensorboard'"):  # a flag of the command, per arm
        check_config({**base, "training": {"tensorboard": "tb"}})
