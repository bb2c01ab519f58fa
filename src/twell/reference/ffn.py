"""Pure-PyTorch TwELL inference ops: the contract the CUDA kernels (twell.kernels) meet.

Same names, arguments and return values as the kernels. Each op computes over the active neurons
only (the pairs stored in TwELL) in float32 and returns bf16; overflow rows take the exact dense
path. ``w_down_t`` is ``W_down.T`` stored contiguously ([H, D]), one row per neuron, which is also
the layout the kernels read.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from twell.formats import TwELL, check_tensor, check_tiling, pack_twell
from twell.formats.twell import columns_limit
from twell.reference.coo import coo_sddmm, coo_spmm


def check_gate_args(x: torch.Tensor, w_gate: torch.Tensor, tile: int, compression: int) -> None:
    check_tiling(tile, compression)
    check_tensor("x", x, dtype=torch.bfloat16, shape=("M", "D"), contiguous=True)
    if isinstance(w_gate, torch.Tensor) and w_gate.dim() == 2 and w_gate.shape[1] != x.shape[1]:
        raise ValueError(f"x has D={x.shape[1]} columns but w_gate is {list(w_gate.shape)} ([H, D]): "
                         "the widths must agree")
    check_tensor("w_gate", w_gate, dtype=torch.bfloat16, shape=("H", x.shape[1]), device=x.device, contiguous=True)
    if columns_limit(w_gate.shape[0]):
        raise ValueError(f"{columns_limit(w_gate.shape[0])} (w_gate's rows)")


def check_ffn_args(x: torch.Tensor, gate: TwELL, *weights: tuple[str, torch.Tensor]) -> None:
    """Shared by the reference and the kernels: x bf16 [M, D]; weights bf16 [H, D]; gate TwELL [M, H]."""
    if not isinstance(gate, TwELL):
        raise TypeError(f"gate: expected a twell.formats.TwELL, got {type(gate).__name__}")
    check_tensor("x", x, dtype=torch.bfloat16, shape=(gate.n_rows, "D"), device=gate.device, contiguous=True)
    for name, w in weights:
        check_tensor(name, w, dtype=torch.bfloat16, shape=(gate.n_cols, x.shape[1]), device=x.device, contiguous=True)


# The block-union rule (ratio, base), refitted on the H100 after the union kernels got cheaper
# (docs/kernels.md §7): per block of 64 rows, the union path pays when entries > ~400 + 1.25 |U|.
# It sends every generator case and every layer of a 4-layer retrain to its faster path. Used by
# twell.model.choose_union_paths. (The earlier fit on the first union kernels was (0.43, 600).)
UNION_RULE = (0.8, 400.0)
UNION_BLOCK = 64  # rows per block of the block-union path (csrc/twell_union.cu: UB)


def check_union_rule(union) -> Optional[tuple[float, float]]:
    """``None`` (the kernels' setting from TWELL_UNION_RATIO / TWELL_UNION_BASE) or ``(ratio, base)``:
    a block of 64 rows takes the kernels' block-union path when its union U of active neurons has
    ``|U| <= ratio * (entries - base)``; ratio 0 keeps every row on the per-row kernel. Returns the
    pair as floats. Shared by the reference (which has one path and only checks it) and the kernels."""
    if union is None:
        return None
    if isinstance(union, (str, bytes)):
        raise ValueError(f"union must be None or (ratio, base), got {union!r}")
    try:
        ratio, base = (float(v) for v in union)
    except (TypeError, ValueError):
        raise ValueError(f"union must be None or (ratio, base), got {union!r}") from None
    if not (math.isfinite(ratio) and math.isfinite(base)) or ratio < 0 or base < 0:
        raise ValueError(f"union: ratio and base must be finite and >= 0, got {union!r}")
    return ratio, base


def twell_gate(x: torch.Tensor, w_gate: torch.Tensor, tile: int = 256, compression: int = 8) -> TwELL:
    """TwELL of ``relu(x @ w_gate.T)`` (x bf16 [M, D], w_gate bf16 [H, D])."""
    check_gate_args(x, w_gate, tile, compression)
    return pack_twell(F.relu(F.linear(x, w_gate)), tile, compression)


def twell_gated_ffn(x: torch.Tensor, gate: TwELL, w_up: torch.Tensor, w_down_t: torch.Tensor,
                    union: Optional[tuple[float, float]] = None) -> torch.Tensor:
    """bf16 [M, D]: ``sum over active n of h[m, n] * (x[m] . w_up[n]) * w_down_t[n]``.

    ``union`` picks the kernels' route (see :func:`check_union_rule`); it is checked here and does not
    change the reference's result."""
    check_ffn_args(x, gate, ("w_up", w_up), ("w_down_t", w_down_t))
    check_union_rule(union)
    rows, cols, vals = gate.entries()
    s = vals.float() * coo_sddmm(rows, cols, x, w_up)
    out = coo_spmm(rows, cols, s, w_down_t, x.shape[0])
    if gate.n_overflow_rows:
        r = gate.overflow_rows
        h = gate.overflow_dense.float()
        out[r] = (h * (x[r].float() @ w_up.float().t())) @ w_down_t.float()
    return out.to(torch.bfloat16)


def twell_ffn(act: TwELL, w_down_t: torch.Tensor) -> torch.Tensor:
    """Non-gated FFN, bf16 [M, D]: ``act @ w_down_t`` where act = TwELL of relu(x @ w_up.T)."""
    if not isinstance(act, TwELL):
        raise TypeError(f"act: expected a twell.formats.TwELL, got {type(act).__name__}")
    check_tensor("w_down_t", w_down_t, dtype=torch.bfloat16, shape=(act.n_cols, "D"), device=act.device, contiguous=True)
    rows, cols, vals = act.entries()
    out = coo_spmm(rows, cols, vals, w_down_t, act.n_rows)
    if act.n_overflow_rows:
        out[act.overflow_rows] = act.overflow_dense.float() @ w_down_t.float()
    return out.to(torch.bfloat16)


# Compression of the TwELL inside sparse_gated_ffn, which no caller sees (here and in the kernel op):
# 16 (15 slots per 256-column tile) halves the words against the published 8 and was 0.8-1.3% faster
# at nnz 8 and 0-0.7% elsewhere in four same-process A/Bs on the H100, outputs bit-identical
# (docs/kernels.md §6). 32 and 64 were no faster than 16 within noise, and leave the spill area
# little room on denser layers.
SPARSE_FFN_COMPRESSION = 16


def sparse_gated_ffn(x, w_gate, w_up, w_down_t, tile: int = 256, compression: int = SPARSE_FFN_COMPRESSION,
                     union: Optional[tuple[float, float]] = None) -> torch.Tensor:
    """The whole sparse gated FFN: TwELL gate, then the fused up/down product (other compressions
    agree to rounding: fuller tiles overflow to the dense fallback). ``union`` is checked as in
    :func:`twell_gated_ffn` and does not change the result."""
    return twell_gated_ffn(x, twell_gate(x, w_gate, tile, compression), w_up, w_down_t, union=union)


def dense_gated_ffn(x, w_gate, w_up, w_down) -> torch.Tensor:
    """The dense baseline of BENCHMARK.md (bf16 cuBLAS on GPU): relu(x Wg^T) * (x Wu^T) @ Wd^T."""
    return F.linear(F.relu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
