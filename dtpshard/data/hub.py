"""Whether the Hugging Face hub can be reached, asked before `datasets` is.

Without a network `datasets` retries every request with backoff (1, 2, 4, 8 ... s), printing a
line per retry, for about half a minute before it gives up. Offline mode (HF_HUB_OFFLINE=1 or
HF_DATASETS_OFFLINE=1) skips the network but still reads datasets already in the local cache, so
when the environment says offline, or one quick connection to the hub fails, the dataset is
loaded in offline mode: a cached one still loads, any other is one line at once.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import socket
import sys
from collections.abc import Iterator
from urllib.parse import urlparse

_TRUE = ("1", "on", "yes", "true")
PROBE_SECONDS = 3.0  # one TCP connection; a refused or unresolvable host answers at once


def offline_reason() -> str | None:
    """Why the hub is not to be asked ("HF_HUB_OFFLINE=1", "no network: ..."), or None."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return f"{var}={os.environ[var]}"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # a proxy may reach what a direct connection cannot: let the library try
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
    except OSError as e:
        return f"no network: {host} cannot be reached ({(e.strerror or type(e).__name__).lower()})"
    return None


@contextlib.contextmanager
def hub_offline(offline: bool) -> Iterator[None]:
    """Inside, huggingface_hub and datasets run in offline mode (cache only) when `offline`. Both
    read the environment once, when imported, so their module constants are set for the block."""
    if not offline:
        yield
        return
    saved = []
    for module, name in (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"),
                         ("datasets.config", "HF_DATASETS_OFFLINE")):
        try:
            mod = sys.modules.get(module) or importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, name):
            saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, True)
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)
