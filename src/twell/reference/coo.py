"""Coordinate-list products shared by the TwELL and hybrid references.

Every product works on a list of (row, column, value) triples and touches only those pairs, in
float32, in chunks so that memory stays bounded (a chunk gathers at most ``_CHUNK`` floats).
"""
from __future__ import annotations

import torch

_CHUNK = 1 << 24


def _chunks(n_pairs: int, width: int):
    step = max(1, _CHUNK // max(1, width))
    for start in range(0, n_pairs, step):
        yield slice(start, min(n_pairs, start + step))


def coo_sddmm(rows: torch.Tensor, cols: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 [P]: ``a[rows[p]] . b[cols[p]]`` for each pair (a [M, K], b [N, K])."""
    out = torch.empty(rows.numel(), dtype=torch.float32, device=a.device)
    for s in _chunks(rows.numel(), a.shape[1]):
        out[s] = (a[rows[s]].float() * b[cols[s]].float()).sum(-1)
    return out


def coo_spmm(rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor, b: torch.Tensor, n_rows: int) -> torch.Tensor:
    """fp32 [n_rows, K]: ``out[r] = sum over pairs of vals[p] * b[cols[p]]`` (b [N, K])."""
    out = torch.zeros(n_rows, b.shape[1], dtype=torch.float32, device=b.device)
    for s in _chunks(rows.numel(), b.shape[1]):
        out.index_add_(0, rows[s], vals[s].float()[:, None] * b[cols[s]].float())
    return out


def coo_tmm(rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor, g: torch.Tensor, n_cols: int) -> torch.Tensor:
    """fp32 [n_cols, K]: ``A^T @ g`` for the sparse A given by the pairs (g [M, K])."""
    out = torch.zeros(n_cols, g.shape[1], dtype=torch.float32, device=g.device)
    for s in _chunks(rows.numel(), g.shape[1]):
        out.index_add_(0, cols[s], vals[s].float()[:, None] * g[rows[s]].float())
    return out
