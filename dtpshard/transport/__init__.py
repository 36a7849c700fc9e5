"""How the devices' partials travel between processes: the one-sided shared-memory exchange
(`shared.py`, ranks on one host; its ops' native kernels in `ring.cpp`, built by `native.py`) and
its choice against the process group's collectives (`choose.py`). The symmetric-memory design for
CUDA is in `symmetric.py`. Imports only `dtpshard.core` and `dtpshard.model`."""
from dtpshard.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "SharedReduce": "shared", "open_ring": "shared", "ring_slots": "shared", "choose": "choose",
    "SymmetricReduce": "symmetric",
})
