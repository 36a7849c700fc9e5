"""Stage 1, the model: the delay schedule, checkpoint reading, the DTP forward (`DTPModel`, devices
as a tensor axis, no distributed code), the dense reference forward used by calibration, and
generation with the KV cache. Imports only `dtpshard.core`."""
from dtpshard.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "DTPModel": "dtp", "KVCache": "dtp", "schedule": "delay", "open_checkpoint": "checkpoint",
    "read_shape": "checkpoint", "Checkpoint": "checkpoint", "DenseModel": "dense", "generate_ids": "generate",
})
