"""Whether a ``model.path`` that names a Hugging Face hub repository can be served here.

transformers fetches a hub id's files with huggingface_hub, which retries a hub it cannot
reach for about half a minute per file and prints each retry: a job without a network
printed 20-45 lines and waited a minute before its one-line error. :func:`hub_unreachable`
asks the hub once, within :data:`HUB_PROBE_S`, before anything is fetched.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

from geartrain.data.sources import looks_like_hub_id

#: How long the hub gets to answer the probe (seconds).
HUB_PROBE_S = 5.0
_TRUE = ("1", "true", "yes", "on")


def hub_endpoint() -> str:
    """The hub huggingface_hub would ask (``HF_ENDPOINT``, else huggingface.co)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_unreachable(path: str | None) -> str | None:
    """Why the hub repository ``path`` names cannot be fetched here, or ``None``: it is no
    hub id (a local directory or file, a package shipping a GGUF file), the hub is not to be
    asked (``HF_HUB_OFFLINE``: transformers reads the cache and says what it lacks), its
    ``config.json`` is cached already, or the hub answers (any HTTP status)."""
    if path is None or Path(os.path.expanduser(path)).exists() or not looks_like_hub_id(path):
        return None
    from geartrain.gguf_source import find_gguf

    if find_gguf(path) is not None:
        return None
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(path, "config.json"), str):
            return None
    except Exception:  # noqa: BLE001 - a malformed id or cache: let the probe decide
        pass
    endpoint = hub_endpoint()
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_PROBE_S).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"the Hugging Face hub at {endpoint} cannot be reached from here ({reason})"
    return None
