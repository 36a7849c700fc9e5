"""Stage 4, training: corpora and token blocks, the chunked KL+CE loss, evaluation, the run
directory, and distillation (single process, DDP). Imports core, model and layouts' files."""
from dtpshard.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "load_texts": "data", "make_blocks": "data", "kl_ce_sums": "losses", "evaluate": "evaluate",
    "DistillConfig": "distill", "distill": "distill",
})
