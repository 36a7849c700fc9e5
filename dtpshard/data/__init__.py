"""Stage 2, data: text sources (the offline standard-library corpus, local files, Hugging Face
datasets), the calibration/training/evaluation roles that keep evaluation text out of the other
two, and packing into token blocks. Used by calibration and by training; imports only core."""
from dtpshard.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {"load_texts": "blocks", "make_blocks": "blocks",
                                               "stdlib_documents": "corpus"})
