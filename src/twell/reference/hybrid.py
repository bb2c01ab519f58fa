"""Pure-PyTorch products on the hybrid training format, and the sparse gated FFN built from them.

Three products cover the forward and backward passes of a ReLU-gated FFN whose hidden pattern is
the gate's nonzeros (weights in the [H, D] one-row-per-neuron layout):

- ``hybrid_spmm(a, w)``      ``a @ w``            [M, H] x [H, D] -> [M, D]   (forward down, dX)
- ``hybrid_sddmm(a, x, w)``  ``(x @ w.T)`` on a's pattern -> Hybrid          (up values, dS)
- ``hybrid_tmm(a, g)``       ``a.T @ g``          [H, M] x [M, D] -> [H, D]   (weight gradients)

ELL rows go through the pair lists; heavy rows through their dense backup. Every op refuses a
hybrid matrix whose backup overflowed (``HybridCapacityError``).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from twell.formats import Hybrid, check_tensor, pack_hybrid
from twell.reference.coo import coo_sddmm, coo_spmm, coo_tmm


def _pairs(a: Hybrid):
    m, k = a.ell_valid().nonzero(as_tuple=True)
    return m, a.cols[m, k].long(), a.values[m, k], k


def hybrid_spmm(a: Hybrid, w: torch.Tensor) -> torch.Tensor:
    """fp32 [M, D] = a @ w for w [H, D]."""
    a.require_ok()
    check_tensor("w", w, shape=(a.n_cols, "D"), device=a.device)
    m, n, v, _ = _pairs(a)
    out = coo_spmm(m, n, v, w, a.n_rows)
    if a.heavy_rows.numel():
        out[a.heavy_rows] = a.heavy_dense.float() @ w.float()
    return out


def hybrid_sddmm(a: Hybrid, x: torch.Tensor, w: torch.Tensor) -> Hybrid:
    """Hybrid with a's pattern and values ``x[m] . w[n]`` (bf16, computed in fp32)."""
    a.require_ok()
    check_tensor("x", x, shape=(a.n_rows, "D"), device=a.device)
    check_tensor("w", w, shape=(a.n_cols, x.shape[1]), device=a.device)
    m, n, _, k = _pairs(a)
    values = torch.zeros_like(a.values)
    values[m, k] = coo_sddmm(m, n, x, w).to(values.dtype)
    heavy = a.heavy_dense
    if a.heavy_rows.numel():
        dense = (x[a.heavy_rows].float() @ w.float().t()).to(heavy.dtype)
        heavy = torch.where(a.heavy_dense != 0, dense, torch.zeros_like(dense))
    return replace(a, values=values, heavy_dense=heavy)


def hybrid_tmm(a: Hybrid, g: torch.Tensor) -> torch.Tensor:
    """fp32 [H, D] = a.T @ g for g [M, D]."""
    a.require_ok()
    check_tensor("g", g, shape=(a.n_rows, "D"), device=a.device)
    m, n, v, _ = _pairs(a)
    out = coo_tmm(m, n, v, g, a.n_cols)
    if a.heavy_rows.numel():
        out += a.heavy_dense.float().t() @ g[a.heavy_rows].float()
    return out


def hybrid_mul(a: Hybrid, b: Hybrid) -> Hybrid:
    """Elementwise product of two hybrids with the same pattern (values in bf16)."""
    return replace(a, values=a.values * b.values, heavy_dense=a.heavy_dense * b.heavy_dense)


def _on_pattern(a: Hybrid, like: Hybrid) -> Hybrid:
    """``a`` with ``like``'s pattern kept explicit: heavy entries off the pattern forced to zero."""
    mask = like.heavy_dense != 0
    return replace(a, heavy_dense=torch.where(mask, a.heavy_dense, torch.zeros_like(a.heavy_dense)))


class _HybridGatedFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down_t, width, capacity):
        h = F.relu(F.linear(x, w_gate))
        pattern = pack_hybrid(h, width, capacity).require_ok()  # full backup: raises with the numbers
        u = hybrid_sddmm(pattern, x, w_up)
        s = hybrid_mul(pattern, u)
        out = hybrid_spmm(s, w_down_t).to(x.dtype)
        # unused ELL slots and off-pattern backup entries are exact zeros, so plain sums do
        l1 = (s.values.float().abs().sum() + s.heavy_dense.float().abs().sum()) / max(1, x.shape[0])
        ctx.save_for_backward(x, w_gate, w_up, w_down_t)
        ctx.hybrids = (pattern, u, s)
        return out, l1

    @staticmethod
    def backward(ctx, d_out, d_l1):
        x, w_gate, w_up, w_down_t = ctx.saved_tensors
        pattern, u, s = ctx.hybrids
        M = x.shape[0]
        ds = hybrid_sddmm(pattern, d_out, w_down_t)
        # d|s|/ds = sign(s), scaled by d_l1 / M (the L1 term is a mean over tokens).
        ds = replace(
            ds,
            values=ds.values + (torch.sign(s.values.float()) * d_l1 / M).to(ds.values.dtype),
            heavy_dense=ds.heavy_dense + (torch.sign(s.heavy_dense.float()) * d_l1 / M).to(ds.heavy_dense.dtype),
        )
        ds = _on_pattern(ds, pattern)
        d_w_down_t = hybrid_tmm(s, d_out)
        du = hybrid_mul(ds, pattern)  # dU = dS * h
        dg = hybrid_mul(ds, u)  # dH = dS * u; dG = dH on the pattern (relu' = 1 there)
        d_w_up = hybrid_tmm(du, x)
        d_w_gate = hybrid_tmm(dg, x)
        dx = hybrid_spmm(du, w_up) + hybrid_spmm(dg, w_gate)
        return (dx.to(x.dtype), d_w_gate.to(w_gate.dtype), d_w_up.to(w_up.dtype),
                d_w_down_t.to(w_down_t.dtype), None, None)


def hybrid_gated_ffn(x, w_gate, w_up, w_down_t, width: int = 128, capacity: int | None = None):
    """Sparse gated FFN for training: returns (out bf16 [M, D], l1 fp32 scalar = mean_m sum_n |h*u|).

    Differentiable in x and all weights; the hidden pattern is relu(x @ w_gate.T) != 0. Raises
    HybridCapacityError when more than ``capacity`` rows have over ``width`` nonzeros.
    """
    check_tensor("x", x, dtype=torch.bfloat16, shape=("M", "D"))
    check_tensor("w_gate", w_gate, dtype=x.dtype, shape=("H", x.shape[1]), device=x.device)
    for name, w in (("w_up", w_up), ("w_down_t", w_down_t)):  # the same H as w_gate
        check_tensor(name, w, dtype=x.dtype, shape=(w_gate.shape[0], x.shape[1]), device=x.device)
    return _HybridGatedFFN.apply(x, w_gate, w_up, w_down_t, width, capacity)
