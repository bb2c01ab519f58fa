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
from twell.reference.gates import check_gate_settings, gate_act


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


# The ops' settings and their defaults, in one place: the kernels (twell.kernels.ops) and this
# reference take the same arguments with these defaults, and nothing reads the environment
# (docs/kernels.md §2). The reference checks each setting and computes the same result whatever it is.
#
# Compression of the TwELL that twell_gate writes and that sparse_gated_ffn keeps inside (and of a
# SparseFFN layer's): 16 (15 slots per 256-column tile) halves the words against the published 8
# at no loss, because the gate kernel moves fuller tiles to its spill area exactly; the measurements
# are in docs/kernels.md §6. The format's own packer keeps the published 8
# (twell.formats.twell.PUBLISHED_COMPRESSION): it has no spill area, so fuller tiles cost it dense
# backup rows (why two defaults: docs/kernels.md §6).
SPARSE_FFN_COMPRESSION = 16
# union=None: the block-union path off, every row on the per-row kernel. Off by default because where
# no block qualifies its plan still costs a pass over the TwELL and the one op's overlap
# (docs/kernels.md §7); twell.model.choose_union_paths turns it on per layer.
UNION_OFF = (0.0, 0.0)
# The block-union rule (ratio, base) fitted on the current union kernels (docs/kernels.md §7): per block
# of 64 rows, the union path pays when entries > ~400 + 1.25 |U|. Used by choose_union_paths and as
# union_plan's default. (The earlier fit on the first union kernels was (0.43, 600).)
UNION_RULE = (0.8, 400.0)
UNION_BLOCK = 64  # rows per block of the block-union path (csrc/twell_union.cu: UB)
# dense_cap=None: rows per round of the dense path for heavy rows follow its rule, M / 8 rounded up
# to 128, at least 4096, at most M (csrc/bindings_dense.cpp; docs/kernels.md §5). A number of rows
# instead sets the capacity (rounded up to 128; 0, or under 384, turns the path off).
DENSE_CAP = None
# CTAs per cluster of the gate kernel: 2 (the pair shares each W_gate tile by TMA multicast) or 1 (the
# single-CTA variant, kept for comparison; docs/kernels.md §3).
GATE_CLUSTER = 2
GATE_CLUSTERS = (1, 2)


def check_union_rule(union) -> Optional[tuple[float, float]]:
    """``None`` (the default: the block-union path off, as ``UNION_OFF``) or ``(ratio, base)``: a block
    of 64 rows takes the kernels' block-union path when its union U of active neurons has
    ``|U| <= ratio * (entries - base)``; ratio 0 keeps every row on the per-row kernel. Returns
    ``None`` or the pair as floats. Shared by the reference (which has one path and only checks it)
    and the kernels (which run ``check_union_rule(union) or UNION_OFF``)."""
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


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_dense_cap(dense_cap) -> Optional[int]:
    """``None`` (the default: the dense path's rule, ``DENSE_CAP``) or rows per round of the kernels'
    dense path for heavy rows, an int >= 0 (0: off). Returns it unchanged."""
    if dense_cap is not None and not (_is_int(dense_cap) and dense_cap >= 0):
        raise ValueError(f"dense_cap must be None (the rule: M / 8 rows, at least 4096, at most M) or a number of "
                         f"rows >= 0 (0: the dense path off), got {dense_cap!r}")
    return dense_cap


def check_gate_cluster(gate_cluster) -> int:
    """CTAs per cluster of the gate kernel: ``GATE_CLUSTER`` (2) or 1 (the single-CTA variant)."""
    if not (_is_int(gate_cluster) and gate_cluster in GATE_CLUSTERS):
        raise ValueError(f"gate_cluster must be 2 (the gate kernel's 2-CTA clusters) or 1 (its single-CTA variant), "
                         f"got {gate_cluster!r}")
    return gate_cluster


def twell_gate(x: torch.Tensor, w_gate: torch.Tensor, tile: int = 256, compression: int = SPARSE_FFN_COMPRESSION,
               *, gate_cluster: int = GATE_CLUSTER, threshold: float = 0.0) -> TwELL:
    """TwELL of ``relu(x @ w_gate.T)`` (x bf16 [M, D], w_gate bf16 [H, D]); with ``threshold`` t > 0, of
    FATReLU: the gate where it is above t, else 0 (twell.reference.gates). ``gate_cluster`` picks the
    kernel's variant (:func:`check_gate_cluster`); it is checked here and changes nothing."""
    check_gate_args(x, w_gate, tile, compression)
    check_gate_cluster(gate_cluster)
    threshold, _ = check_gate_settings(threshold, False)
    return pack_twell(gate_act(F.linear(x, w_gate), threshold), tile, compression)


def twell_gated_ffn(x: torch.Tensor, gate: TwELL, w_up: torch.Tensor, w_down_t: torch.Tensor,
                    union: Optional[tuple[float, float]] = None, *, dense_cap: Optional[int] = DENSE_CAP,
                    up_relu: bool = False) -> torch.Tensor:
    """bf16 [M, D]: ``sum over active n of h[m, n] * (x[m] . w_up[n]) * w_down_t[n]``; with ``up_relu``
    (dReLU) the up product goes through ReLU too, so a neuron counts only where both are positive.

    ``union`` and ``dense_cap`` pick the kernels' routes (:func:`check_union_rule`,
    :func:`check_dense_cap`); they are checked here and do not change the reference's result."""
    check_ffn_args(x, gate, ("w_up", w_up), ("w_down_t", w_down_t))
    check_union_rule(union)
    check_dense_cap(dense_cap)
    _, up_relu = check_gate_settings(0.0, up_relu)
    rows, cols, vals = gate.entries()
    u = coo_sddmm(rows, cols, x, w_up)
    s = vals.float() * (gate_act(u) if up_relu else u)
    out = coo_spmm(rows, cols, s, w_down_t, x.shape[0])
    if gate.n_overflow_rows:
        r = gate.overflow_rows
        h = gate.overflow_dense.float()
        u = x[r].float() @ w_up.float().t()
        out[r] = (h * (gate_act(u) if up_relu else u)) @ w_down_t.float()
    return out.to(torch.bfloat16)


def twell_ffn(act: TwELL, w_down_t: torch.Tensor, *, dense_cap: Optional[int] = DENSE_CAP) -> torch.Tensor:
    """Non-gated FFN, bf16 [M, D]: ``act @ w_down_t`` where act = TwELL of relu(x @ w_up.T).
    ``dense_cap`` as in :func:`twell_gated_ffn` (checked, changes nothing here)."""
    if not isinstance(act, TwELL):
        raise TypeError(f"act: expected a twell.formats.TwELL, got {type(act).__name__}")
    check_tensor("w_down_t", w_down_t, dtype=torch.bfloat16, shape=(act.n_cols, "D"), device=act.device, contiguous=True)
    check_dense_cap(dense_cap)
    rows, cols, vals = act.entries()
    out = coo_spmm(rows, cols, vals, w_down_t, act.n_rows)
    if act.n_overflow_rows:
        out[act.overflow_rows] = act.overflow_dense.float() @ w_down_t.float()
    return out.to(torch.bfloat16)


def sparse_gated_ffn(x, w_gate, w_up, w_down_t, tile: int = 256, compression: int = SPARSE_FFN_COMPRESSION,
                     union: Optional[tuple[float, float]] = None, *, dense_cap: Optional[int] = DENSE_CAP,
                     gate_cluster: int = GATE_CLUSTER, threshold: float = 0.0, up_relu: bool = False) -> torch.Tensor:
    """The whole sparse gated FFN: TwELL gate, then the fused up/down product (other compressions
    agree to rounding: fuller tiles overflow to the dense fallback); with every default, the same as
    ``twell_gated_ffn(x, twell_gate(x, w_gate), w_up, w_down_t)``. ``union``, ``dense_cap`` and
    ``gate_cluster`` are checked as in :func:`twell_gated_ffn` and :func:`twell_gate` and do not change
    the result; ``threshold`` (FATReLU) and ``up_relu`` (dReLU) pick the gate variant."""
    gate = twell_gate(x, w_gate, tile, compression, gate_cluster=gate_cluster, threshold=threshold)
    return twell_gated_ffn(x, gate, w_up, w_down_t, union=union, dense_cap=dense_cap, up_relu=up_relu)


def dense_gated_ffn(x, w_gate, w_up, w_down) -> torch.Tensor:
    """The dense baseline of BENCHMARK.md (bf16 cuBLAS on GPU): relu(x Wg^T) * (x Wu^T) @ Wd^T."""
    return F.linear(F.relu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
