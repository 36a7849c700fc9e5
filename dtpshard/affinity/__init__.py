"""Stage 3, affinity (paper section 3.1): the per-edge scorer, the affinity file format, the
streamed pass for models bigger than memory, and the calibration pass (`dtpshard affinity`).
Imports core, model and data."""
from dtpshard.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "Affinity": "file", "edges_for_delay": "file", "ScoreOptions": "scorer", "compute_affinity": "scorer",
    "calibrate": "calibrate",
})
