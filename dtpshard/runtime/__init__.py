"""DTP for real: one process per device on torch.distributed, each holding only its own shard,
posting partials asynchronously and adding them δ modules later. Imports core and model."""
from dtpshard.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {"RankModel": "ranks", "run": "run"})
