"""Stage 4, layouts: the co-located score J, the optimiser (exact balanced block updates), the
`layout` command that makes every layout family, and `permute`, which writes the permuted
checkpoint. Imports core, model and affinity."""
from dtpshard.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "colocated_score": "score", "optimise_layout": "optimise", "layout_cmd": "make", "permute_cmd": "permute",
})
