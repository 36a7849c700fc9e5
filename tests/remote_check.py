"""A student through transformers' remote code, checked under whatever transformers this process
imports: `python tests/remote_check.py OUT` prints one JSON object. test_remote.py runs it under
the oldest transformers dtpshard accepts (4.56), in a subprocess with that version first on
PYTHONPATH; the same checks run in the suite's own process against distilled students.

The student is a tiny teacher permuted by a random layout and saved by DTPModel.save_pretrained,
as distill saves one (distill itself is not run here: its data and training have nothing to do
with the transformers version)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def check(out: Path) -> dict:
    import torch
    import transformers
    import transformers.dynamic_module_utils as dmu
    from transformers import AutoModelForCausalLM

    from dtpshard.core.layout import Layout
    from dtpshard.model.dtp import DTPModel
    from tiny import save_tiny

    dmu.HF_MODULES_CACHE = os.environ["HF_MODULES_CACHE"]  # also read at import: the same directory
    result = {"transformers": transformers.__version__, "modules_cache": dmu.HF_MODULES_CACHE, "cases": []}
    ids = torch.randint(0, 384, (2, 11), generator=torch.Generator().manual_seed(0))
    prompt = torch.randint(0, 384, (1, 6), generator=torch.Generator().manual_seed(1))
    for family, devices, delay in (("llama", 2, 1), ("qwen3", 4, 2)):
        teacher = save_tiny(out / f"{family}-teacher", family)
        shape = DTPModel.from_pretrained(teacher, 1, 0).shape
        student = out / f"{family}-L{devices}-d{delay}"
        layout = Layout.random(shape, devices=devices, delay=delay, seed=5)
        DTPModel.from_pretrained(teacher, devices, delay, layout=layout).save_pretrained(student, source=teacher)
        case = {"family": family, "devices": devices, "delay": delay}
        try:
            AutoModelForCausalLM.from_pretrained(str(student), trust_remote_code=False)
            case["refused"] = None
        except ValueError as e:
            case["refused"] = str(e).strip().splitlines()[0]
        ref = DTPModel.from_pretrained(student)
        hf = AutoModelForCausalLM.from_pretrained(str(student), trust_remote_code=True, torch_dtype=torch.float32)
        with torch.no_grad():
            want = ref(ids).logits
            case["max_abs_diff"] = (hf(ids).logits - want).abs().max().item()
            case["dense_diff"] = (DTPModel.from_pretrained(student, 1, 0)(ids).logits - want).abs().max().item()
        case["class"] = f"{type(hf).__module__}.{type(hf).__name__}"
        ours = ref.generate(prompt, max_new_tokens=10, eos_token_id=-1)[0].tolist()
        theirs = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None)[0].tolist()
        case["same_tokens"], case["tokens"] = ours == theirs, theirs
        bf16 = AutoModelForCausalLM.from_pretrained(str(student), trust_remote_code=True, torch_dtype=torch.bfloat16)
        with torch.no_grad():
            case["bf16"] = str(bf16.dtype)
            case["bf16_equal"] = torch.equal(bf16(ids).logits,
                                             DTPModel.from_pretrained(student, dtype="bfloat16")(ids).logits)
        again = out / f"{student.name}-resaved"
        hf.save_pretrained(str(again))
        reloaded = AutoModelForCausalLM.from_pretrained(str(again), trust_remote_code=True, torch_dtype=torch.float32)
        with torch.no_grad():
            case["resaved_diff"] = (reloaded(ids).logits - want).abs().max().item()
            case["resaved_in_dtpshard_diff"] = (DTPModel.from_pretrained(again)(ids).logits - want).abs().max().item()
        case["resaved_files"] = sorted(p.name for p in again.iterdir())
        result["cases"].append(case)
    return result


if __name__ == "__main__":
    print(json.dumps(check(Path(sys.argv[1]))))
