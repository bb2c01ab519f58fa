"""Pure-PyTorch reference of the sparse training FFN: the contract of
:func:`twell.kernels.training.train_gated_ffn` (same signature, same outputs), on any device.

The kernels skip the inactive neurons; the result is what dense PyTorch computes, so the reference
is the dense computation itself, differentiated by autograd, plus the activity the kernels report.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from twell.formats import check_tensor
from twell.reference.gates import active as active_mask, check_gate_settings, hidden

# Active neurons a row may have and still take the sparse path (more: the row runs dense). The
# paper's hybrid training format uses the same 128.
TRAIN_SLOTS = 128
# The widest layer (D, a multiple of 8) the training kernels take; the reference takes any.
TRAIN_MAX_D = 2048


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


def train_gated_ffn(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, slots: int = TRAIN_SLOTS, *,
                    threshold: float = 0.0, up_relu: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out [M, D], l1 fp32 0-dim = mean over rows of sum |h|, nnz int32 [M], neuron_active bool [H])``
    of ``out = (relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``, differentiable in x and the weights.
    A NaN gate value counts as active (it reaches the output, as relu(NaN) does).

    ``threshold`` t (FATReLU): the gate passes where it is above t, so its gradient is the upstream one
    there and zero where ``g <= t`` (autograd of ``where``). ``up_relu`` (dReLU): ``relu(g) * relu(u)``,
    active where both are positive; the up projection's gradient is then zero where ``u <= 0`` too."""
    check_train_args(x, w_gate, w_up, w_down, slots)
    threshold, up_relu = check_gate_settings(threshold, up_relu)
    g = F.linear(x, w_gate)
    u = F.linear(x, w_up)
    h = hidden(g, u, threshold, up_relu)
    active = active_mask(g, u, threshold, up_relu)
    l1 = h.abs().sum(-1, dtype=torch.float32).mean() if x.shape[0] else h.new_zeros((), dtype=torch.float32)
    return (F.linear(h, w_down), l1, active.sum(-1, dtype=torch.int32).detach(), active.any(0).detach())
