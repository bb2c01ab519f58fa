"""Hybrid ELL + dense-backup format for training.

Training activations are sparse on average but some rows (often the first tokens of a sequence)
are dense. The hybrid format stores

- an ELL part of fixed width ``W`` (128 by default): for every row with at most W nonzeros,
  ``values`` [M, W] bf16 and ``cols`` [M, W] int32 hold its nonzeros in ascending column order,
  padded with (0, column 0); ``row_nnz`` [M] int32 holds every row's true count;
- a dense backup for the rare heavy rows (more than W nonzeros): ``heavy_rows`` int64 [R] and
  ``heavy_dense`` [R, H] bf16, with a fixed ``capacity`` (default ceil(M / 8) rows).

When more rows are heavy than the backup holds, nothing is dropped silently: ``status`` is
``HybridStatus.BACKUP_FULL``, ``n_heavy`` says how many rows needed the backup, the backup is left
empty, and every use of the data (``unpack`` and all ops) raises :class:`HybridCapacityError`.
The caller must grow the capacity (``pack_hybrid(h, capacity=hy.n_heavy)``) or run that layer dense.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from twell.formats.checks import check_tensor, leading_nonzeros


class HybridStatus(enum.Enum):
    OK = "ok"
    BACKUP_FULL = "backup_full"


class HybridCapacityError(RuntimeError):
    """The dense backup was too small for the heavy rows; the hybrid matrix holds no usable data."""


@dataclass
class Hybrid:
    values: torch.Tensor  # bf16 [M, W]
    cols: torch.Tensor  # int32 [M, W]
    row_nnz: torch.Tensor  # int32 [M]
    heavy_rows: torch.Tensor  # int64 [R]
    heavy_dense: torch.Tensor  # bf16 [R, H]
    n_cols: int
    width: int
    capacity: int
    status: HybridStatus
    n_heavy: int

    @property
    def n_rows(self) -> int:
        return self.values.shape[0]

    @property
    def device(self) -> torch.device:
        return self.values.device

    def require_ok(self) -> "Hybrid":
        if self.status is not HybridStatus.OK:
            raise HybridCapacityError(
                f"{self.n_heavy} rows have more than {self.width} nonzeros but the dense backup holds "
                f"{self.capacity}; grow it (pack_hybrid(h, capacity={self.n_heavy})) or run this layer dense"
            )
        return self

    def light_mask(self) -> torch.Tensor:
        """bool [M]: rows stored in the ELL part."""
        return self.row_nnz <= self.width

    def ell_valid(self) -> torch.Tensor:
        """bool [M, W]: which ELL slots hold an entry."""
        slot = torch.arange(self.width, device=self.device)
        return (slot < self.row_nnz[:, None]) & self.light_mask()[:, None]

    def unpack(self) -> torch.Tensor:
        """Dense bf16 [M, H]."""
        self.require_ok()
        out = torch.zeros(self.n_rows, self.n_cols, dtype=torch.bfloat16, device=self.device)
        m, k = self.ell_valid().nonzero(as_tuple=True)
        out[m, self.cols[m, k].long()] = self.values[m, k]
        out[self.heavy_rows] = self.heavy_dense
        return out

    def nbytes(self) -> int:
        """Bytes of the ELL part, the counts and the full-capacity dense backup (as allocated by a kernel)."""
        ell = self.values.numel() * 2 + self.cols.numel() * 4 + self.row_nnz.numel() * 4
        return ell + self.capacity * (self.n_cols * 2 + 8)


def pack_hybrid(h: torch.Tensor, width: int = 128, capacity: int | None = None) -> Hybrid:
    """Pack bf16 [M, H] into the hybrid format (see module docstring). Check ``status`` before use."""
    check_tensor("h", h, dtype=torch.bfloat16, shape=("M", "H"))
    M, H = h.shape
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a positive int, got {width!r}")
    if capacity is None:
        capacity = -(-M // 8)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"capacity must be a non-negative int, got {capacity!r}")
    row_nnz = (h != 0).sum(-1, dtype=torch.int32)  # NaN counts as a nonzero
    heavy = row_nnz > width
    heavy_rows = heavy.nonzero().flatten()
    n_heavy = int(heavy_rows.numel())
    k = min(width, H)
    values = torch.zeros(M, width, dtype=torch.bfloat16, device=h.device)
    cols = torch.zeros(M, width, dtype=torch.int32, device=h.device)
    # heavy rows keep no ELL entries (count 0 here): they live in the dense backup
    values[:, :k], lead = leading_nonzeros(h, k, torch.where(heavy, 0, row_nnz))
    cols[:, :k] = lead.to(torch.int32)
    if n_heavy <= capacity:
        status, backup_rows, backup = HybridStatus.OK, heavy_rows, h[heavy_rows].clone()
    else:
        status = HybridStatus.BACKUP_FULL
        backup_rows = torch.empty(0, dtype=torch.int64, device=h.device)
        backup = torch.empty(0, H, dtype=h.dtype, device=h.device)
    return Hybrid(values, cols, row_nnz, backup_rows, backup, H, width, capacity, status, n_heavy)
