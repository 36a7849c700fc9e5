"""dtpshard: Delayed Tensor Parallelism for Llama-family checkpoints."""
from dtpshard.core.errors import UserError
from dtpshard.core.layout import Layout


def __getattr__(name: str):  # torch-heavy imports only when asked for
    if name == "DTPModel":
        from dtpshard.model.dtp import DTPModel
        return DTPModel
    raise AttributeError(name)


__all__ = ["DTPModel", "Layout", "UserError"]
