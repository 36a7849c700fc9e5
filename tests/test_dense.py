"""DenseModel against transformers' own models, on tiny random checkpoints of the four families.

Also the shared helpers of the affinity/data tests: `tiny_model` and `tiny_tokenizer`.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dtpshard.model.checkpoint import open_checkpoint
from dtpshard.model.dense import DenseModel

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
VOCAB = 320


def tiny_config(family: str, layers: int = 2, heads: int = 4, kv: int = 2, head_dim: int = 16, hidden: int = 48,
                neurons: int = 40, tied: bool = False):
    from tiny import tiny_config as family_config

    return family_config(family, vocab_size=VOCAB, hidden_size=hidden, intermediate_size=neurons,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                         head_dim=head_dim, rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=tied)


def tiny_model(path: Path, family: str = "qwen3", seed: int = 0, dtype: torch.dtype = torch.float32, **kw):
    """A random HF model saved to `path` (weights, norm gains and biases all random); returns it (eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kw), attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(str(path))
    return model.to(dtype).eval()


def tiny_tokenizer(path: Path | None = None, add_bos: bool = False):
    """A byte-level BPE tokenizer (VOCAB-sized) with <s>/</s>, trained in a few ms on fixed text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog. " * 20, "Return the value. " * 20],
                            trainer=trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    if path is not None:
        fast.save_pretrained(str(path))
    return fast


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tmp_path, family):
    hf = tiny_model(tmp_path, family, tied=family == "qwen3")
    dense = DenseModel.from_checkpoint(open_checkpoint(tmp_path))
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    got = dense.forward(ids)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_intermediates_match_transformers_hooks(tmp_path, family):
    """o (o_proj input), the residual at each norm, g/u/act (down_proj input) equal HF's."""
    hf = tiny_model(tmp_path, family)
    dense = DenseModel.from_checkpoint(open_checkpoint(tmp_path), dtype=torch.float64)
    hf = hf.double()
    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        return lambda mod, args: seen.__setitem__(name, args[0].detach())

    for i, layer in enumerate(hf.model.layers):
        layer.self_attn.o_proj.register_forward_pre_hook(keep(f"o{i}"))
        layer.post_attention_layernorm.register_forward_pre_hook(keep(f"x_ffn{i}"))
        layer.input_layernorm.register_forward_pre_hook(keep(f"x_attn{i}"))
        layer.mlp.down_proj.register_forward_pre_hook(keep(f"act{i}"))
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf(ids)
    s = dense.shape
    assert torch.equal(dense.embed(ids), seen["x_attn0"])
    for i in range(s.layers):  # each module on HF's own input (HF's RMSNorm runs in float32)
        x = seen[f"x_attn{i}"]
        at = dense.attention(i, x)
        assert torch.allclose(at.o.reshape(2, 17, -1), seen[f"o{i}"], atol=1e-5)
        c = dense.head_contributions(i, at.o)  # [B, T, H, D]
        assert torch.allclose(c.sum(2), at.out, atol=1e-10)
        assert torch.allclose(x + at.out, seen[f"x_ffn{i}"], atol=1e-5)
        x = seen[f"x_ffn{i}"]
        ff = dense.ffn(i, x)
        assert torch.allclose(ff.act, seen[f"act{i}"], atol=1e-5)
        L = hf.model.layers[i]
        h = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + s.rms_eps) * L.post_attention_layernorm.weight
        assert torch.allclose(ff.gate, h @ L.mlp.gate_proj.weight.T, atol=1e-10)
        assert torch.allclose(ff.act, torch.nn.functional.silu(ff.gate) * ff.up, atol=1e-12)


def test_qkv_is_grouped_projection_of_normalised_input(tmp_path):
    hf = tiny_model(tmp_path, "qwen2", heads=6, kv=2)
    dense = DenseModel.from_checkpoint(open_checkpoint(tmp_path), dtype=torch.float64)
    s = dense.shape
    x = torch.randn(1, 5, s.hidden, dtype=torch.float64)
    at = dense.attention(0, x)
    L = hf.model.layers[0].self_attn
    h = (x / at.rho * hf.model.layers[0].input_layernorm.weight.double())
    q = h @ L.q_proj.weight.double().T  # no bias
    k = h @ L.k_proj.weight.double().T
    g, r, hd = s.kv_groups, s.heads_per_group, s.head_dim
    for grp in range(g):
        assert torch.allclose(at.qkv[0, :, grp, :r * hd], q[0, :, grp * r * hd:(grp + 1) * r * hd], atol=1e-12)
        assert torch.allclose(at.qkv[0, :, grp, r * hd:(r + 1) * hd], k[0, :, grp * hd:(grp + 1) * hd], atol=1e-12)
