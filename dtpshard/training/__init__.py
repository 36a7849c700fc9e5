"""Stage 5, training: the recipe and its settings, the chunked KL+CE loss, evaluation, the run
directory and the student's model card, the memory plan, the teacher cache, and distillation (one
process, DDP, or FSDP2). Imports core, model and data."""
from dtpshard.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "kl_ce_sums": "losses", "evaluate": "evaluate",
    "DistillConfig": "distill", "distill": "distill",
})
