"""Stage 6, downstream: accuracy on benchmark tasks through lm-eval's task definitions, offline
(tasks.py: the data; lm.py: a dtpshard model as lm-eval's LM; evaluate.py: per-item scores and a
student's paired difference against its teacher). Imports core and model; lm-eval itself only
when a task is scored."""
from dtpshard.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "benchmark": "evaluate", "compare": "evaluate", "score_items": "evaluate", "TASKS": "tasks", "DEFAULT": "tasks",
    "language_model": "lm",
})
