"""Calibrated synthetic sparsity for FFN benchmarks (the generator of shared/BENCHMARK.md).

Random ReLU gates are about 50% dense, which says nothing about sparse kernels. This generator
builds inputs whose gate activation ``relu(x @ w_gate.T)`` has a chosen mean number of active
neurons per row (``nnz``) and a chosen spread across rows (``tail``):

1. ``x = randn(M, D) * exp(tail * randn(M, 1))``, then ``x[:, 0] = 1``.
2. ``w_gate = randn(H, D) / sqrt(D)``; offsets ``o = 0.3 * randn(H)``;
   ``w_gate[:, 0] = -(b + o)`` with the scalar ``b`` found by bisection so that the mean
   number of positive entries of ``x @ w_gate.T`` per row equals ``nnz``.
3. ``w_up = randn(H, D) / sqrt(D)``, ``w_down = randn(D, H) / sqrt(H)`` (nn.Linear layouts).
4. Everything drawn from one seeded CPU generator in float32 (in the order x, row scale,
   w_gate, o, w_up, w_down), then cast to ``dtype`` and moved to ``device``.

The bisection runs in float32 on CPU on the real shapes. Because ``x[:, 0] = 1``, entry
(m, n) is positive iff ``z[m, n] = (x[:, 1:] @ w_gate[:, 1:].T)[m, n] - o[n] > b``, so ``z`` is
computed once and each bisection step only counts entries of ``z`` above the midpoint; entries
that can no longer cross the bracket are dropped after each step, so later steps are cheap.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class FFNInputs:
    """Inputs of one gated-FFN benchmark case (nn.Linear weight layouts).

    x [M, D], w_gate [H, D], w_up [H, D], w_down [D, H], all in one dtype on one device.
    ``bias`` is the bisected scalar b (``w_gate[:, 0] = -(b + o)``), ``nnz`` the target mean
    number of active neurons per row, ``tail`` the log-std of the per-row scale of x.
    """

    x: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    bias: float
    nnz: float
    tail: float
    seed: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """(M, D, H)."""
        return self.x.shape[0], self.x.shape[1], self.w_gate.shape[0]

    def to(self, device=None, dtype=None) -> "FFNInputs":
        """A copy with every tensor moved/cast (same bias, nnz, tail, seed)."""
        def conv(t):
            return t.to(device=device, dtype=dtype)

        return FFNInputs(conv(self.x), conv(self.w_gate), conv(self.w_up), conv(self.w_down),
                         self.bias, self.nnz, self.tail, self.seed)


def _check_args(M, D, H, nnz, tail) -> None:
    for name, v in (("M", M), ("D", D), ("H", H)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"expected {name} a positive int, got {v!r}")
    if D < 2:
        raise ValueError(f"expected D >= 2 (column 0 of x is the constant 1 that carries the bias), got D={D}")
    if not (0 < float(nnz) < H):
        raise ValueError(f"expected 0 < nnz < H={H} (target mean active neurons per row), got nnz={nnz!r}")
    if not (math.isfinite(float(tail)) and float(tail) >= 0):
        raise ValueError(f"expected tail >= 0 (log-std of the per-row scale of x), got tail={tail!r}")


def _bracket_pass(flat: torch.Tensor, lo: float, hi: float, chunk: int = 1 << 24):
    """One chunked pass: (count above lo, count above hi, entries in (lo, hi])."""
    n_lo = n_hi = 0
    keep = []
    for start in range(0, flat.numel(), chunk):
        c = flat[start:start + chunk]
        m_lo, m_hi = c > lo, c > hi
        n_lo += int(torch.count_nonzero(m_lo))
        n_hi += int(torch.count_nonzero(m_hi))
        keep.append(c[m_lo & ~m_hi])
    return n_lo, n_hi, torch.cat(keep)


def bisect_bias(z: torch.Tensor, target_count: float, iters: int = 64, tol: float = 1e-7) -> float:
    """Scalar b with count(z > b) closest to ``target_count`` (bisection on a float32 tensor z).

    The bracket starts from a subsample's quantiles and is checked (and widened if needed) on the
    full z in one pass; after each step the candidates that can no longer cross are dropped.
    """
    flat = z.reshape(-1)
    n = flat.numel()
    if not (0 < target_count < n):
        raise ValueError(f"target count {target_count} must lie strictly between 0 and {n}")
    q = 1.0 - target_count / n  # the quantile b sits at
    sample = flat[:: max(1, n // (1 << 22))][: 1 << 23].float()
    lo = float(torch.quantile(sample, max(0.0, q - 0.01)))
    hi = float(torch.quantile(sample, min(1.0, q + 0.01)))
    # Invariant: count(z > lo) >= target >= count(z > hi); widen until it holds on the full z.
    while True:
        n_lo, above, cand = _bracket_pass(flat, lo, hi)
        if n_lo >= target_count and above <= target_count:
            break
        width = max(1.0, hi - lo)
        if n_lo < target_count:
            lo -= 4 * width
        if above > target_count:
            hi += 4 * width
    best_b, best_gap = hi, abs(above - target_count)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if not (lo < mid < hi):
            break  # float resolution reached
        mask = cand > mid
        count = above + int(torch.count_nonzero(mask))
        gap = abs(count - target_count)
        if gap < best_gap:
            best_b, best_gap = mid, gap
        if count > target_count:
            lo, cand = mid, cand[mask]
        else:
            hi, above, cand = mid, count, cand[~mask]
        if cand.numel() == 0 or (hi - lo) <= tol * max(1.0, abs(hi)) or best_gap < 0.5:
            break
    return float(best_b)


def calibrated_ffn_inputs(M: int, D: int, H: int, nnz: float, tail: float, seed: int = 0,
                          device="cpu", dtype: torch.dtype = torch.bfloat16) -> FFNInputs:
    """Calibrated gated-FFN inputs: x [M, D], w_gate/w_up [H, D], w_down [D, H] in ``dtype``.

    The mean number of positive entries of ``x @ w_gate.T`` per row equals ``nnz`` in float32
    (after the cast to bf16 the measured mean moves by a fraction of a percent); larger ``tail``
    spreads the per-row counts (heavy rows). Deterministic for a given seed on any device.
    """
    _check_args(M, D, H, nnz, tail)
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    f32 = torch.float32
    x = torch.randn(M, D, generator=g, dtype=f32)
    x.mul_(torch.exp(float(tail) * torch.randn(M, 1, generator=g, dtype=f32)))
    x[:, 0] = 1.0
    w_gate = torch.randn(H, D, generator=g, dtype=f32).div_(math.sqrt(D))
    offsets = 0.3 * torch.randn(H, generator=g, dtype=f32)
    w_up = torch.randn(H, D, generator=g, dtype=f32).div_(math.sqrt(D))
    w_down = torch.randn(D, H, generator=g, dtype=f32).div_(math.sqrt(H))

    # z = x[:, 1:] @ w_gate[:, 1:].T - o: zeroing column 0 keeps the GEMM on contiguous operands.
    w_gate[:, 0] = 0.0
    z = x @ w_gate.T
    z.sub_(offsets)
    b = bisect_bias(z, float(nnz) * M)
    del z
    w_gate[:, 0] = -(b + offsets)

    def out(t):
        return t.to(dtype=dtype).to(device)

    return FFNInputs(out(x), out(w_gate), out(w_up), out(w_down), bias=b, nnz=float(nnz),
                     tail=float(tail), seed=int(seed))


def gate_activation(inputs: FFNInputs) -> torch.Tensor:
    """h = relu(x @ w_gate.T) [M, H] in the inputs' dtype, on their device."""
    return F.relu(F.linear(inputs.x, inputs.w_gate))


def sparsity_stats(h: torch.Tensor, tile: int = 256, compression: int = 8) -> dict:
    """Active-neuron statistics of a gate activation h [M, H] (active = nonzero).

    Returns mean/min/max/p50/p99 active per row, max and mean active per (row, column tile of
    width ``tile``), the fraction of all entries active, and the number of rows that overflow
    TwELL at (tile, compression), i.e. with some tile holding more than tile // compression - 1
    nonzeros.
    """
    if h.dim() != 2:
        raise ValueError(f"expected a 2-D activation [M, H], got shape {list(h.shape)}")
    if tile < 1:
        raise ValueError(f"expected tile >= 1, got {tile}")
    M, H = h.shape
    active = h != 0
    per_row = active.sum(dim=1, dtype=torch.int32)
    n_tiles = -(-H // tile)
    pad = n_tiles * tile - H
    act = F.pad(active, (0, pad)) if pad else active
    per_tile = act.view(M, n_tiles, tile).sum(dim=2, dtype=torch.int32)
    slots = tile // compression - 1
    row_f = per_row.float()
    return {
        "rows": M,
        "cols": H,
        "tile": tile,
        "mean_active": float(row_f.mean()),
        "min_active": int(per_row.min()),
        "max_active": int(per_row.max()),
        "p50_active": float(torch.quantile(row_f.cpu(), 0.5)),
        "p99_active": float(torch.quantile(row_f.cpu(), 0.99)),
        "max_per_tile": int(per_tile.max()),
        "mean_per_tile": float(per_tile.float().mean()),
        "density": float(row_f.sum()) / (M * H),
        "twell_slots": slots,
        "overflow_rows": int((per_tile > slots).any(dim=1).sum()),
        "overflow_tiles": int((per_tile > slots).sum()),
    }
