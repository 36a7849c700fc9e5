"""Stage 0, what every stage shares: the one-line error, atomic writes and the cache folder, the
model's shape and the checks on devices and delay, the vocabulary (layout kinds, stage-3 modes, KV
search modes, the constrained types of flags and config keys) and the one check of a value against
a type (typed.py), layouts as data and the permutation they define on the weights (keyed by module
m), device/dtype resolution, and the one local multi-process launcher. Imports nothing from
dtpshard's other packages."""
from dtpshard.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "UserError": "errors", "ModelShape": "shape", "shape_from_hf_config": "shape", "check_devices": "shape",
    "check_delay": "shape", "Layout": "layout", "as_layout": "layout", "permutation_spec": "permutation",
    "apply_layout": "permutation", "pick_device": "devices", "DTYPES": "devices", "launch_local": "launch",
    "root_cause": "launch", "UnitShape": "shape", "resolve_dtp": "settings", "LayoutKind": "vocab", "Stage3": "vocab",
    "KvSearch": "vocab",
})
