"""Offline mode for the Hugging Face libraries, switched on for one block of code.

``datasets`` and ``huggingface_hub`` read ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` once, at
import time, into module constants; setting the environment variable later changes nothing. So
:func:`hf_offline` sets the variables (for anything imported later and for subprocesses) *and*
the already-imported constants, and restores all of them on exit.
"""
from __future__ import annotations

import contextlib
from typing import Iterator


def resolve_offline(offline: bool | None) -> bool:
    """``None`` means: follow the environment (an HF_*_OFFLINE variable, or TWELL_ALLOW_NETWORK set to a
    false value)."""
    if offline is not None:
        return bool(offline)
    # Imported here: the twell.data package imports torch, and importing twell.eval stays light.
    from twell.data.network import hf_offline_env, network_refused_env

    return hf_offline_env() or network_refused_env()


def _constants() -> list[tuple[object, str]]:
    """(module, attribute) pairs holding the offline flag the libraries check at call time."""
    pairs: list[tuple[object, str]] = []
    try:
        import huggingface_hub.constants as hub_constants

        pairs.append((hub_constants, "HF_HUB_OFFLINE"))
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers/datasets
        pass
    try:
        import datasets.config as ds_config

        pairs += [(ds_config, name) for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if hasattr(ds_config, name)]
    except ImportError:  # pragma: no cover
        pass
    return pairs


@contextlib.contextmanager
def hf_offline(enabled: bool = True) -> Iterator[None]:
    """Within the block, nothing in datasets/huggingface_hub/transformers may use the network.

    ``enabled=False`` is a no-op (the hub path stays available to users with internet).
    """
    if not enabled:
        yield
        return
    from twell.data.network import HF_OFFLINE_VARS
    from twell.paths import environ_set

    saved_constants = [(mod, attr, getattr(mod, attr)) for mod, attr in _constants()]
    with environ_set({name: "1" for name in HF_OFFLINE_VARS}):
        try:
            for mod, attr, _ in saved_constants:
                setattr(mod, attr, True)
            yield
        finally:
            for mod, attr, value in saved_constants:
                setattr(mod, attr, value)
