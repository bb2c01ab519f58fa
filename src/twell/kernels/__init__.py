"""CUDA kernels for Hopper (sm_90a): JIT build of csrc/ and the torch.library ops around it.

``available(build=True) -> (bool, reason)`` says whether the kernels can run here and why not;
``load()`` builds (cached on disk by a hash of sources and flags) and imports the extension;
both live in ``twell.kernels.build``. The ops (e.g. ``sparse_gated_ffn``) live in
``twell.kernels.ops``. Every name is resolved on first access, so importing twell.kernels
imports, builds and registers nothing (and ``python -m twell.kernels.build`` runs cleanly).
"""
from __future__ import annotations

import importlib

__all__ = ["BuildError", "available", "load"]
_FROM_BUILD = frozenset(__all__)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    if name in _FROM_BUILD:
        return getattr(importlib.import_module(f"{__name__}.build"), name)
    # Anything else is an op: forward to twell.kernels.ops (its import errors propagate).
    ops = importlib.import_module(f"{__name__}.ops")
    try:
        return getattr(ops, name)
    except AttributeError:
        raise AttributeError(f"module 'twell.kernels' has no attribute {name!r} "
                             f"(not defined in twell.kernels.ops either)") from None


def __dir__():
    return sorted(set(globals()) | _FROM_BUILD)
