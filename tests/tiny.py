"""Tiny random checkpoints of every supported family, built in code (no hub, no downloads).

`tiny_hf_model(family)` returns a transformers model whose every parameter (norm gains and
q/k/v biases too) is random, so no identity can pass by accident. `save_tiny(dir, family)`
writes it as a checkpoint directory with a small byte-level BPE tokenizer.
"""
from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "llama_tied", "qwen2", "qwen3", "mistral", "phi3", "granite")

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=384, max_position_embeddings=256, rms_norm_eps=1e-6)


def tiny_config(family: str = "llama", **overrides):
    from transformers import GraniteConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    kw = dict(BASE)
    if family == "llama":
        cls = LlamaConfig
        kw.update(tie_word_embeddings=False, rope_theta=10000.0)
    elif family == "llama_tied":  # SmolLM2 / Danube style
        cls = LlamaConfig
        kw.update(tie_word_embeddings=True, rope_theta=100000.0)
    elif family == "qwen2":
        cls = Qwen2Config
        kw.update(tie_word_embeddings=True, use_sliding_window=False)
    elif family == "qwen3":
        cls = Qwen3Config
        kw.update(tie_word_embeddings=True, head_dim=16)  # head_dim != hidden / heads
    elif family == "mistral":
        cls = MistralConfig
        kw.update(tie_word_embeddings=False, sliding_window=None)
    elif family == "phi3":  # fused qkv_proj and gate_up_proj; a sliding window shorter than the tests' texts
        cls = Phi3Config
        kw.update(tie_word_embeddings=False, sliding_window=11, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif family == "granite":  # every multiplier away from 1
        cls = GraniteConfig
        kw.update(tie_word_embeddings=True, embedding_multiplier=3.0, residual_multiplier=0.6,
                  attention_multiplier=0.2, logits_scaling=2.5)
    else:
        raise ValueError(family)
    kw.update(overrides)
    return cls(**kw)


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model


def tiny_hf_model(family: str = "llama", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="eager")
    return randomize(model, seed).eval()


def tiny_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 4, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = [torch.__doc__ or "", Path(torch.__file__).read_text()[:20000]] * 2
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")


def save_tiny(path: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    path = Path(path)
    model = tiny_hf_model(family, seed, **overrides)
    model.save_pretrained(str(path))
    tiny_tokenizer(model.config.vocab_size).save_pretrained(str(path))
    return path


def command_line(command: str, model: Path, out: Path, opts: dict, **over) -> list[str]:
    """`command MODEL --out OUT --no-progress` and a flag per option (`over` replaces; None drops one)."""
    args = [command, str(model), "--out", str(out), "--no-progress"]
    for k, v in {**opts, **over}.items():
        if v is not None:
            args += [f"--{k}", str(v)]
    return args


def with_nan(affinity_file: Path, out: Path, edge: tuple[int, int], index: tuple[int, int]) -> Path:
    """A copy of an affinity file with one score NaN (Affinity.save refuses to write one): what a
    damaged or hand-edited file holds, for the readers' refusals."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    with safe_open(str(affinity_file), framework="np") as f:
        meta = f.metadata()
    tensors = load_file(str(affinity_file))
    tensors[f"edge.{edge[0]}.{edge[1]}"][index] = np.nan
    save_file(tensors, str(out), metadata=meta)
    return out


def copy_owned(src, dst):
    """A copy of a directory dtpshard wrote, owned where it lies, as if dtpshard had written it
    there: each mark rebound to its directory's and its own identity (core/owned.py binds a mark
    to both, so a plain copy is nobody's). Tests use it to give each case its own finished run."""
    import json
    import shutil
    from pathlib import Path

    from dtpshard.core.identity import identity
    from dtpshard.core.owned import MARK

    dst = Path(shutil.copytree(src, dst, symlinks=True))
    for mark in dst.rglob(MARK):
        data = json.loads(mark.read_text())
        data["dir"], data["self"] = identity(mark.parent), identity(mark)
        with open(mark, "r+") as f:  # in place: the file keeps its inode
            f.write(json.dumps(data))
            f.truncate()
    return dst


def linked_victim(tmp_path: Path, name: str, text: str = "precious") -> tuple[Path, Path]:
    """A user's file and a directory `run` whose `name` is a hard link to it: what a command must
    neither write through nor remove. -> (the user's file, run)."""
    import os

    victim = tmp_path / f"victim{Path(name).suffix or '.txt'}"
    victim.write_text(text)
    (run := tmp_path / "run").mkdir()
    os.link(victim, run / name)
    return victim, run
