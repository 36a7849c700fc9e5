"""dtpshard: Delayed Tensor Parallelism for Llama-family checkpoints.

Imports go at the top of a module. An import sits inside the function that needs it for one of
these reasons only, said here once rather than at each:

- The help stays fast. `dtpshard --help` imports only cli.py (and this package), and
  `dtpshard COMMAND --help` the command's module and what that imports at its top. On that path
  a module the help does not use waits for the function that uses it when it takes a noticeable
  time to import (docs/benchmarks.md, "Import times"): torch, transformers, scipy, matplotlib; in
  the command modules that do not load torch, also yaml, psutil and importlib.metadata.
- An optional dependency: datasets and pyarrow (the `hf` extra), tensorboard.
- A part of torch that only one option uses and that costs as much again to import: FSDP2, DTensor
  and distributed checkpoints (`--fsdp`, training/fsdp.py).
- A module that reads a setting when first imported, set just before: inductor's config (its
  cache directory, model/compiled.py) and matplotlib's pyplot (the Agg backend, studies/figures.py).

No import is inside a function to break a cycle: tests/test_stages.py forbids cycles there too.
"""
from dtpshard.core.errors import UserError
from dtpshard.core.layout import Layout


def __getattr__(name: str):
    if name == "DTPModel":  # torch: not on the help path
        from dtpshard.model.dtp import DTPModel
        return DTPModel
    raise AttributeError(name)


__all__ = ["DTPModel", "Layout", "UserError"]
