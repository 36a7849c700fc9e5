"""Stage 4, layouts: the co-located score J, the optimiser (exact balanced block updates), every
layout family (`write_layout`, the `layout` command's work), and `permute`, which writes the
permuted checkpoint. Imports core, model and affinity."""
from dtpshard.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "colocated_score": "score", "optimise_layout": "optimise", "write_layout": "make", "permute": "permute",
})
