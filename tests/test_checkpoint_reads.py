"""A command opens its checkpoint once: config.json is read once, however many parts of the
command need the config, the shape, the family or the tokenizer."""
import builtins
import io
from pathlib import Path

import pytest

from dtpshard.cli import main
from dtpshard.core.layout import Layout
from dtpshard.model.checkpoint import open_checkpoint
from dtpshard.model.dtp import DTPModel
from dtpshard.training.distill import DistillConfig, distill


@pytest.fixture
def config_reads(monkeypatch):
    """Opens for reading of any config.json, by path (io.open is what pathlib and json readers
    use, builtins.open what transformers uses: the same function, patched under both names)."""
    reads: list[Path] = []
    real = io.open

    def counting(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, Path)) and Path(file).name == "config.json" and not set(mode) & set("wax+"):
            reads.append(Path(file).resolve())
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", counting)
    monkeypatch.setattr(builtins, "open", counting)
    return reads


def test_open_checkpoint_reads_config_once(tiny_dirs, config_reads):
    ckpt = open_checkpoint(tiny_dirs["qwen3"])
    assert ckpt.shape.family == "qwen3" and ckpt.record is None
    ckpt.tokenizer()
    assert config_reads == [(tiny_dirs["qwen3"] / "config.json").resolve()]


def test_starting_distill_on_a_dense_teacher_reads_its_config_once(tiny_dirs, tmp_path, config_reads):
    teacher = tiny_dirs["llama"]
    Layout.random(open_checkpoint(teacher).shape, devices=2, delay=1, seed=0).save(tmp_path / "layout.json")
    config_reads.clear()
    text = tmp_path / "docs.txt"
    text.write_text("\n\n".join(f"document {i}: " + "word " * 40 for i in range(300)))
    distill(DistillConfig(teacher=teacher, out=tmp_path / "run", layout=tmp_path / "layout.json", steps=1,
                          seq_len=8, micro_batch=1, grad_accum=1, eval_blocks=1, text=[str(text)],
                          eval_text=[str(text)], progress=False, device="cpu"))
    assert (tmp_path / "run" / "DONE").exists()
    assert config_reads.count((teacher / "config.json").resolve()) == 1, config_reads


@pytest.mark.parametrize("with_layout", [False, True])
def test_generate_reads_the_models_config_once(tiny_dirs, tmp_path, config_reads, capsys, with_layout):
    model = tiny_dirs["llama"]
    layout = []
    if with_layout:
        Layout.random(open_checkpoint(model).shape, devices=2, delay=1, seed=0).save(tmp_path / "layout.json")
        layout = ["--layout", str(tmp_path / "layout.json")]
    config_reads.clear()
    assert main(["generate", str(model), "--devices", "2", "--delay", "1", "--prompt", "hello world",
                 "--max-new-tokens", "2", *layout]) == 0
    assert capsys.readouterr().out.startswith("hello world")
    assert config_reads == [(model / "config.json").resolve()], config_reads


def test_generate_from_a_student_reads_its_config_once(tiny_dirs, tmp_path, config_reads, capsys):
    student = tmp_path / "student"
    DTPModel.from_pretrained(tiny_dirs["llama"], 2, 1).save_pretrained(student)
    config_reads.clear()
    assert main(["generate", str(student), "--prompt", "hello world", "--max-new-tokens", "2",
                 "--tokenizer", str(tiny_dirs["llama"])]) == 0
    assert config_reads == [(student / "config.json").resolve()], config_reads
