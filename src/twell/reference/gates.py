"""Gate variants of a ReLU-gated FFN, ``out = W_down h`` with ``g = x W_gate^T``, ``u = x W_up^T``:

=========  ===================================  =========================================
relu       ``h = relu(g) * u``                  active where ``g > 0`` (the paper's model)
fatrelu    ``h = (g if g > t else 0) * u``      active where ``g > t``; ``t >= 0`` per model
drelu      ``h = relu(g) * relu(u)``            active where ``g > 0`` and ``u > 0``
=========  ===================================  =========================================

The sparse ops take them as two settings: ``threshold`` (the gate's FATReLU threshold, 0 for ReLU) and
``up_relu`` (ReLU on the up projection too: dReLU). A NaN gate (or, with ``up_relu``, a NaN up value)
counts as active and reaches the output, as ``relu(NaN)`` does in dense PyTorch; so the comparisons
are written as ``not (g <= t)``. The threshold is compared in the dtype of ``g`` (a bf16 gate against
``t`` rounded to bf16), which is what ``g > t`` does in PyTorch. docs/models.md describes each variant.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

# SparseFFN activations that the sparse paths compute (the kernels only "relu" for now) and the
# (threshold, up_relu) settings each gives the ops.
SPARSE_ACTIVATIONS = ("relu", "fatrelu", "drelu")


def check_gate_settings(threshold, up_relu) -> tuple[float, bool]:
    """``threshold``: a finite float >= 0 (0: ReLU); ``up_relu``: a bool. Returns them as (float, bool)."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold) \
            or threshold < 0:
        raise ValueError(f"threshold (the FATReLU gate threshold) must be a finite number >= 0 (0: ReLU), "
                         f"got {threshold!r}")
    if not isinstance(up_relu, bool):
        raise ValueError(f"up_relu (ReLU on the up projection: dReLU) must be a bool, got {up_relu!r}")
    return float(threshold), up_relu


def gate_act(g: Tensor, threshold: float = 0.0) -> Tensor:
    """FATReLU: ``g`` where ``g > threshold`` (NaN kept), else 0; ``threshold=0`` is ReLU (torch.relu, one
    kernel: it keeps NaN too)."""
    if not threshold:
        return torch.relu(g)
    return torch.where(g <= threshold, 0.0, g)


def hidden(g: Tensor, u: Tensor, threshold: float = 0.0, up_relu: bool = False) -> Tensor:
    """The hidden activation ``h`` from the gate and up pre-activations (same shape and dtype)."""
    return gate_act(g, threshold) * (gate_act(u) if up_relu else u)


def active(g: Tensor, u: Tensor | None, threshold: float = 0.0, up_relu: bool = False) -> Tensor:
    """bool, g's shape: where a neuron is active (its h may be nonzero). ``u`` is needed with up_relu only."""
    a = ~(g <= threshold)
    return a & ~(u <= 0) if up_relu else a


def settings(activation: str, threshold: float) -> tuple[float, bool]:
    """(threshold, up_relu) of a SparseFFN activation in SPARSE_ACTIVATIONS."""
    if activation not in SPARSE_ACTIVATIONS:
        raise ValueError(f"the sparse paths compute {SPARSE_ACTIVATIONS}, not {activation!r}")
    return (threshold if activation == "fatrelu" else 0.0), activation == "drelu"


def kernel_gate_unsupported(threshold: float = 0.0, up_relu: bool = False) -> str:
    """Why the CUDA kernels (twell.kernels) but the decoding op cannot compute this gate variant, '' for
    ReLU: they compare the gate against 0 and take the up product as it is
    (docs/models.md#what-the-kernels-do-not-support-yet). Stated here once for the kernels' ops, the planner
    and SparseFFN."""
    threshold, up_relu = check_gate_settings(threshold, up_relu)
    if threshold:
        return (f"FATReLU (gate threshold {threshold:g}): the kernels' gate epilogue compares against 0 only; "
                "the decoding op, the reference and dense paths compute it")
    if up_relu:
        return ("dReLU (ReLU on the up projection too): the kernels' fused up/down multiplies by the up product "
                "as it is; the decoding op, the reference and dense paths compute it")
    return ""
