"""Pure-PyTorch reference of the decoding FFN: the contract of :func:`twell.kernels.decode_gated_ffn`
(same signature, same result up to the order of fp32 sums), on any device.

At a few rows (token-by-token generation) the FFN is bound by reading its weights. The kernel reads
``w_gate`` in full and, of ``w_up`` and ``w_down_t``, only the rows of neurons that some row's gate
makes active. The reference computes the same values over those neurons, rounding as the dense bf16
FFN does: gate, up projection and their product to bf16, sums in fp32.
"""
from __future__ import annotations

import torch
from torch import Tensor

from twell.formats import check_tensor
from twell.reference.gates import check_gate_settings

# The most rows the decoding kernel takes (csrc/twell_kernels.h: kDecodeMaxRows); larger inputs go
# through the other sparse path or dense (twell.nn.ffn's "auto").
DECODE_MAX_ROWS = 32
# The widest layer it takes (kDecodeMaxH): the down kernel lists a range of neuron groups in shared memory.
DECODE_MAX_H = 1 << 18


def check_decode_args(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down_t: Tensor) -> None:
    """Readable errors for the decoding FFN's inputs (shared by the reference and the kernel)."""
    check_tensor("x", x, dtype=torch.bfloat16, shape=("M", "D"), contiguous=True)
    M, D = x.shape
    if not 1 <= M <= DECODE_MAX_ROWS:
        raise ValueError(f"the decoding FFN takes 1 to {DECODE_MAX_ROWS} rows, got M={M} "
                         "(use twell.kernels.sparse_gated_ffn or dense for more)")
    if D % 64 or D <= 0:
        raise ValueError(f"the decoding FFN needs D to be a positive multiple of 64, got D={D}")
    check_tensor("w_gate", w_gate, dtype=x.dtype, shape=("H", D), device=x.device, contiguous=True)
    H = w_gate.shape[0]
    if not 1 <= H <= DECODE_MAX_H:
        raise ValueError(f"the decoding FFN takes 1 to {DECODE_MAX_H} hidden units, got H={H}")
    for name, w in (("w_up", w_up), ("w_down_t", w_down_t)):
        check_tensor(name, w, dtype=x.dtype, shape=(H, D), device=x.device, contiguous=True)


def decode_gated_ffn(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down_t: Tensor, *, threshold: float = 0.0,
                     up_relu: bool = False) -> Tensor:
    """bf16 [M, D]: ``sum over active n of bf16(relu(bf16(x . w_gate[n])) * bf16(x . w_up[n])) * w_down_t[n]``.

    A NaN gate value counts as active (it reaches the output, as relu(NaN) does in dense PyTorch);
    an inactive neuron contributes exactly nothing (its up and down rows are not read). ``threshold``
    (FATReLU: active where the bf16 gate is above it) and ``up_relu`` (dReLU: ReLU on the up product
    too; a neuron whose up product is not positive on any row where its gate is has its down row unread)
    pick the gate variant (twell.reference.gates)."""
    check_decode_args(x, w_gate, w_up, w_down_t)
    threshold, up_relu = check_gate_settings(threshold, up_relu)
    xf = x.float()
    gate = (xf @ w_gate.float().t()).to(torch.bfloat16)
    active = ~(gate <= threshold)
    gate = torch.where(active, gate, torch.zeros_like(gate))
    cols = active.any(0).nonzero().flatten()  # neurons some row needs
    u = (xf @ w_up[cols].float().t()).to(torch.bfloat16)
    on = active[:, cols]
    if up_relu:  # dReLU: active where both are positive; the down rows of the others are not read
        on = on & ~(u <= 0)
        u = torch.where(on, u, torch.zeros_like(u))
    g = gate[:, cols]
    h = torch.where(on, (g.float() * u.float()).to(torch.bfloat16), torch.zeros_like(g))
    if up_relu:
        keep = on.any(0)
        h, cols = h[:, keep], cols[keep]
    return (h.float() @ w_down_t[cols].float()).to(torch.bfloat16)
