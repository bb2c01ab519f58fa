"""Pure-PyTorch reference of the sparse training FFN: the contract of
:func:`twell.kernels.training.train_gated_ffn` (same signature, same outputs), on any device.

The kernels skip the inactive neurons; the result is what dense PyTorch computes, so the reference
is the dense computation itself, differentiated by autograd, plus the activity the kernels report.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from twell.formats import check_tensor
from twell.reference.gates import active as active_mask, check_gate_settings, hidden

# Active neurons a row may have and still take the sparse path (more: the row runs dense). The
# paper's hybrid training format uses the same 128.
TRAIN_SLOTS = 128
# The widest layer (D, a multiple of 8) the training kernels take; the reference takes any.
TRAIN_MAX_D = 8192
# Hot neurons (``hot=``, computed as columns of dense GEMMs over all rows): by default those active on at least
# this fraction of a forward's rows; whether the split pays is a layer's own matter, so it is timed per layer
# (docs/training_kernels.md, "Hot neurons"). The set is rounded up to a multiple of HOT_MULTIPLE (tensor-core
# tiles) and holds at most HOT_MAX_FRAC of the neurons.
HOT_MIN_FREQ = 0.02
HOT_MULTIPLE = 64
HOT_MAX_FRAC = 0.25


def check_train_args(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, slots: int) -> None:
    """Readable errors for the training FFN's inputs (shared by the reference and the kernels)."""
    check_tensor("x", x, dtype=torch.bfloat16, shape=("M", "D"), contiguous=True)
    D = x.shape[1]
    check_tensor("w_gate", w_gate, dtype=x.dtype, shape=("H", D), device=x.device, contiguous=True)
    H = w_gate.shape[0]
    check_tensor("w_up", w_up, dtype=x.dtype, shape=(H, D), device=x.device, contiguous=True)
    check_tensor("w_down", w_down, dtype=x.dtype, shape=(D, H), device=x.device, contiguous=True)
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= 1024:
        raise ValueError(f"slots must be an int in [1, 1024], got {slots!r}")


def check_hot(hot, H: int, device: torch.device) -> None:
    """Readable errors for a ``hot`` argument: None or an int64 1-D tensor of neuron indices on x's device (its
    dtype, shape and device only; :func:`check_hot_values` reads the values, which :func:`choose_hot` makes valid)."""
    if hot is None:
        return
    if not isinstance(hot, Tensor) or hot.dtype != torch.int64 or hot.dim() != 1:
        raise ValueError("hot must be None or an int64 1-D tensor of neuron indices (choose_hot makes one), got "
                         + (f"{hot.dtype} with shape {tuple(hot.shape)}" if isinstance(hot, Tensor) else repr(hot)))
    if hot.device != device:
        raise ValueError(f"hot must be on x's device {device}, got {hot.device}")
    if hot.numel() > H:
        raise ValueError(f"hot lists {hot.numel()} neurons, more than the layer's H={H}")


def check_hot_values(hot: Tensor, H: int) -> None:
    """hot strictly increasing within [0, H): one host read the first time a set is checked for this H; the set
    is then marked (with its version), so a set made once and used at every step is read back once."""
    mark = (hot._version, H)
    if hot.numel() == 0 or getattr(hot, "_twell_hot_checked", None) == mark:
        return
    ok = bool(((hot[1:] > hot[:-1]).all() & (hot[0] >= 0) & (hot[-1] < H)).item())
    if not ok:
        raise ValueError(f"hot must hold distinct neuron indices in [0, {H}) in increasing order")
    hot._twell_hot_checked = mark


@torch.no_grad()
def gate_counts(x: Tensor, w_gate: Tensor, chunk: int = 8192) -> Tensor:
    """int64 [H]: on how many rows of x [M, D] each neuron's ReLU gate is open (``x @ w_gate.T > 0``, in x's dtype,
    as the op computes it from a layer's weights cast to that dtype), in slices of ``chunk`` rows (no [M, H]
    tensor at once); the counts :func:`choose_hot` takes."""
    w = w_gate.detach().to(x.dtype)
    counts = torch.zeros(w.shape[0], dtype=torch.int64, device=x.device)
    for r0 in range(0, x.shape[0], chunk):
        counts += (F.linear(x[r0:r0 + chunk].detach(), w) > 0).sum(0)
    return counts


def choose_hot(counts: Tensor, rows: int, min_freq: float = HOT_MIN_FREQ, multiple: int = HOT_MULTIPLE,
               max_frac: float = HOT_MAX_FRAC) -> Tensor:
    """The hot neurons of a layer from ``counts`` [H] (rows on which each neuron was active, out of ``rows``):
    those active on at least ``min_freq`` of the rows, the set rounded up to a multiple of ``multiple`` with
    the next most active neurons (a rounded-up neuron is computed densely too: exact either way) and capped at
    ``max_frac`` of H rounded down to a multiple of ``multiple``. int64 indices, increasing, on counts' device;
    empty when no neuron reaches min_freq, or when the cap is 0 (H below multiple / max_frac: 256 by default)."""
    if counts.dim() != 1:
        raise ValueError(f"counts must be 1-D [H], got shape {tuple(counts.shape)}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive int, got {rows!r}")
    if not 0.0 < min_freq <= 1.0:
        raise ValueError(f"min_freq is a fraction of the rows in (0, 1], got {min_freq}")
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"multiple must be a positive int, got {multiple!r}")
    if not 0.0 <= max_frac <= 1.0:
        raise ValueError(f"max_frac must be in [0, 1], got {max_frac}")
    H = counts.shape[0]
    counts = counts.double()  # exact for any count of rows; the threshold in rows, not a rounded rate
    k = int((counts >= min_freq * rows).sum())
    cap = math.floor(H * max_frac + 1e-9) // multiple * multiple
    k = min(-(-k // multiple) * multiple, cap, H)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=counts.device)
    # ties broken by index, so the same counts give the same set on every rank and run
    order = torch.sort(counts, descending=True, stable=True).indices[:k]
    return order.sort().values


def train_gated_ffn(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, slots: int = TRAIN_SLOTS, *,
                    threshold: float = 0.0, up_relu: bool = False, hot: Optional[Tensor] = None
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out [M, D], l1 fp32 0-dim = mean over rows of sum |h|, nnz int32 [M], neuron_active bool [H])``
    of ``out = (relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``, differentiable in x and the weights.
    A NaN gate value counts as active (it reaches the output, as relu(NaN) does).

    ``threshold`` t (FATReLU): the gate passes where it is above t, so its gradient is the upstream one
    there and zero where ``g <= t`` (autograd of ``where``). ``up_relu`` (dReLU): ``relu(g) * relu(u)``,
    active where both are positive; the up projection's gradient is then zero where ``u <= 0`` too.

    ``hot`` (:func:`choose_hot`): neurons the kernels compute as dense columns over every row instead of pair by
    pair; it changes no result, so here it is only checked."""
    check_train_args(x, w_gate, w_up, w_down, slots)
    check_hot(hot, w_gate.shape[0], x.device)
    if hot is not None:
        check_hot_values(hot, w_gate.shape[0])
    threshold, up_relu = check_gate_settings(threshold, up_relu)
    g = F.linear(x, w_gate)
    u = F.linear(x, w_up)
    h = hidden(g, u, threshold, up_relu)
    active = active_mask(g, u, threshold, up_relu)
    l1 = h.abs().sum(-1, dtype=torch.float32).mean() if x.shape[0] else h.new_zeros((), dtype=torch.float32)
    return (F.linear(h, w_down), l1, active.sum(-1, dtype=torch.int32).detach(), active.any(0).detach())
