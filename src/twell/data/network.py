"""When may twell touch the network? Decided from flags, never by probing (a probe can hang).

- The Hugging Face offline variables (``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``,
  ``TRANSFORMERS_OFFLINE``) always win: when one is set, nothing goes online.
- Otherwise an explicit ``allow`` argument (a config's ``data.allow_network``) decides.
- Otherwise ``TWELL_ALLOW_NETWORK=1`` allows it; the default is offline.
"""
from __future__ import annotations

import os

_TRUE = {"1", "ON", "YES", "TRUE"}
HF_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def network_refused_env() -> bool:
    """True when ``TWELL_ALLOW_NETWORK`` is set to a false value (0, off, ...): nothing may go online,
    explicit hub ids and evaluations included."""
    value = os.environ.get("TWELL_ALLOW_NETWORK", "").strip().upper()
    return value != "" and value not in _TRUE


def hf_offline_env() -> bool:
    """True when the environment tells the Hugging Face libraries to stay offline."""
    return any(os.environ.get(v, "").strip().upper() in _TRUE for v in HF_OFFLINE_VARS)


def network_allowed(allow: bool | None = None) -> bool:
    """Whether code may download (hub tokenizers, FineWeb-Edu streaming, hub checkpoints)."""
    if hf_offline_env():
        return False
    if allow is not None:
        return bool(allow)
    return os.environ.get("TWELL_ALLOW_NETWORK", "").strip().upper() in _TRUE
