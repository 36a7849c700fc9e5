"""Stage 1, the model: the per-device modules and their kernels, the delay schedule, the one
decoder loop, the DTP forward (`DTPModel`, devices as a tensor axis, no distributed code), the dense
model calibration reads (the same modules at L = 1), checkpoint reading and writing, the student
format, and decoding with the KV cache. Imports only `dtpshard.core`."""
from dtpshard.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "DTPModel": "dtp", "KVCache": "dtp", "schedule": "delay", "open_checkpoint": "checkpoint",
    "read_shape": "checkpoint", "Checkpoint": "checkpoint", "DenseModel": "dense", "generate_ids": "decode",
})
