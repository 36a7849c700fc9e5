"""dtpshard: Delayed Tensor Parallelism for Llama-family checkpoints."""
from .errors import UserError
from .layout import Layout


def __getattr__(name: str):  # torch-heavy imports only when asked for
    if name == "DTPModel":
        from .model import DTPModel
        return DTPModel
    raise AttributeError(name)


__all__ = ["DTPModel", "Layout", "UserError"]
