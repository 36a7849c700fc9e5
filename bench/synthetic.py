"""A random Llama-family checkpoint of any size, written the way Hugging Face shards one
(`model-0000i-of-0000K.safetensors` + `model.safetensors.index.json` + config.json), one shard in
memory at a time, so benchmarks can build checkpoints larger than they would like to hold."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def write_sharded_llama(path: Path, *, layers: int, hidden: int, neurons: int, heads: int, kv_groups: int,
                        vocab: int, shard_bytes: int, head_dim: int | None = None,
                        dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> int:
    """Weights ~ N(0, 1/fan_in), norm gains ~ 1 + N(0, 0.01); untied LM head. Returns the weights' bytes."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    D, N, H, G = hidden, neurons, heads, kv_groups
    hd = head_dim or D // H
    cfg = LlamaConfig(hidden_size=D, intermediate_size=N, num_hidden_layers=layers, num_attention_heads=H,
                      num_key_value_heads=G, head_dim=hd, vocab_size=vocab, tie_word_embeddings=False,
                      max_position_embeddings=4096, rms_norm_eps=1e-5, torch_dtype=str(dtype).split(".")[-1])
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(path))
    shapes = {"model.embed_tokens.weight": (vocab, D)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "self_attn.q_proj.weight": (H * hd, D),
                       p + "self_attn.k_proj.weight": (G * hd, D), p + "self_attn.v_proj.weight": (G * hd, D),
                       p + "self_attn.o_proj.weight": (D, H * hd), p + "post_attention_layernorm.weight": (D,),
                       p + "mlp.gate_proj.weight": (N, D), p + "mlp.up_proj.weight": (N, D),
                       p + "mlp.down_proj.weight": (D, N)})
    shapes.update({"model.norm.weight": (D,), "lm_head.weight": (vocab, D)})
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards, size = [[]], 0
    for name, shape in shapes.items():  # plan the shards first: their names need the count
        nbytes = itemsize * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    g = torch.Generator().manual_seed(seed)

    def rand(shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:
            return (1 + 0.1 * torch.randn(shape, generator=g)).to(dtype)
        return (torch.randn(shape, generator=g) / shape[-1] ** 0.5).to(dtype)

    weight_map, total = {}, 0
    for j, names in enumerate(shards):
        file = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        shard = {n: rand(shapes[n]) for n in names}
        save_file(shard, str(path / file), metadata={"format": "pt"})
        total += sum(t.numel() * itemsize for t in shard.values())
        weight_map.update({n: file for n in names})
        del shard  # freed before the next shard is made
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total
