"""Stage 6, studies: experiments from a config file, statistics, the report and its figures, and
the SmolLM2 demo. Imports every earlier stage."""
from dtpshard.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "run_experiment": "experiment", "load_config": "config", "write_report": "report", "step_matching": "stats",
})
