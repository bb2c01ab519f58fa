"""TwELL: tile-wise ELLPACK storage for a sparse post-ReLU activation ``h`` of shape [M, H].

Layout (the contract every producer and consumer in this repository follows)
---------------------------------------------------------------------------
- The H columns are split into ``n_tiles = ceil(H / T)`` column tiles of width ``T`` (256 by
  default, matching the gate GEMM's column tile; 128 and 64 also work). The last tile is padded.
- Each (row, tile) owns ``S = T // C`` consecutive 32-bit words (``C`` is the compression factor,
  8 by default, so S = 32 words = 128 bytes per tile row):

  ``word 0``        count: the number of nonzeros of this row inside this tile (the true count,
                    which may exceed S - 1)
  ``words 1..S-1``  entries ``(bf16_bits(value) << 16) | column``: the bf16 bit pattern in the
                    upper half, the *global* column index (0 <= column < H <= 65536) in the lower half

  so ``packed`` is a ``torch.uint32`` matrix of shape [M, n_tiles * S], row-major.
- The reference packer writes entries in ascending column order and zeroes unused slots; kernels may
  write entries in another order and leave unused slots unwritten. Consumers read exactly
  ``min(count, S - 1)`` entries and assume no order.
- A zero is an exact ``0`` (or ``-0``); anything else, NaN and Inf included, is a nonzero, so a NaN
  never silently becomes zero.
- Overflow: a row with more than S - 1 nonzeros in some tile cannot be stored in its slots. Such a row
  is never dropped: it is listed in ``overflow_rows`` (int64, ascending) and its exact values are kept
  in ``overflow_dense`` ([R, H] bf16). Its packed words still hold the true counts (so a kernel can
  recognise it) and the first S - 1 entries of each tile. Consumers use the dense copy for these rows.
- Spill (written by the gate kernel only): an overflowing tile row may instead move its entries to a
  ``spill`` area of uint32 words. Its count word is then ``0x80000000 | offset``, ``spill[offset]``
  is the true count and ``spill[offset + 1 : offset + 1 + count]`` its entries. A spilled tile is
  stored exactly, so its row needs no dense backup; ``overflow_rows`` lists only rows with an
  overflowing tile that is not spilled.

``unpack()`` reproduces ``h`` exactly (up to the sign of zeros).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from twell.formats.checks import check_tensor, check_tiling, leading_nonzeros

MAX_COLUMNS = 1 << 16  # the column index has 16 bits
# The paper's compression C: the default of this packer and of a TwELL built by hand, the layout above
# (S = 32 words per 256-column tile). The ops (twell_gate, sparse_gated_ffn) default to 16 instead,
# which their spill area makes free; this packer has none, so the published 8 keeps more rows out of
# the dense backup (twell.reference.ffn.SPARSE_FFN_COMPRESSION; docs/kernels.md §6).
PUBLISHED_COMPRESSION = 8


def columns_limit(H: int) -> str:
    """Why TwELL cannot hold H columns, or "" when it can (callers add whose H it is)."""
    return "" if 1 <= H <= MAX_COLUMNS else f"TwELL needs 1 <= H <= {MAX_COLUMNS} (16-bit index), got H={H}"


def _require_little_endian() -> None:
    # Words are assembled from int16 halves through a view, which assumes little-endian memory.
    if sys.byteorder != "little":
        raise RuntimeError("TwELL packing assumes a little-endian machine")


@dataclass
class TwELL:
    """A packed TwELL matrix plus the dense backup of its overflow rows (see module docstring).

    ``pack_twell`` fills the overflow fields eagerly. A TwELL written by the gate kernel carries
    ``source = (x, w)`` instead (the activation is ``relu(x @ w.T)``): the overflow rows are then
    found from the counts and their dense values recomputed only when someone asks for them, so
    the kernel path never synchronises with the host.
    """

    packed: torch.Tensor  # uint32 [M, n_tiles * S]
    overflow_rows_: Optional[torch.Tensor]  # int64 [R], ascending (None: derive from counts)
    overflow_dense_: Optional[torch.Tensor]  # bf16 [R, H] (None: recompute from source)
    n_cols: int
    tile: int = 256
    compression: int = PUBLISHED_COMPRESSION
    n_overflow_tiles_: Optional[int] = None
    source: Optional[tuple] = None  # (x [M, D], w [H, D]) with h = relu(x @ w.T)
    spill: Optional[torch.Tensor] = None  # uint32 [cap + 1] spill area of the gate kernel

    SPILL_BIT = 0x80000000

    def __post_init__(self) -> None:
        # A hand-built TwELL of the wrong geometry would otherwise fail deep inside a view or a kernel.
        slots = check_tiling(self.tile, self.compression)
        if isinstance(self.n_cols, torch.SymInt):  # traced with a symbolic H (export, dynamic shapes)
            return
        if isinstance(self.n_cols, bool) or not isinstance(self.n_cols, int) or not 1 <= self.n_cols <= MAX_COLUMNS:
            raise ValueError(f"TwELL n_cols must be an int in [1, {MAX_COLUMNS}], got {self.n_cols!r}")
        width = -(-self.n_cols // self.tile) * slots
        check_tensor("packed", self.packed, dtype=torch.uint32, shape=("M", width))

    def _raw_counts(self) -> torch.Tensor:
        """int64 [M, n_tiles]: the count words as unsigned values."""
        return self.words()[..., 0].to(torch.int64) & 0xFFFFFFFF

    def spilled(self) -> torch.Tensor:
        """bool [M, n_tiles]: tile rows whose entries live in the spill area."""
        raw = self._raw_counts()
        if self.spill is None:
            return torch.zeros_like(raw, dtype=torch.bool)
        return (raw & self.SPILL_BIT) != 0

    @property
    def n_spilled_tiles(self) -> int:
        return int(self.spilled().sum())

    @property
    def overflow_rows(self) -> torch.Tensor:
        if self.overflow_rows_ is None:
            unstored = (self._raw_counts() > self.slots - 1) & ~self.spilled()
            self.overflow_rows_ = unstored.any(-1).nonzero().flatten()
        return self.overflow_rows_

    @property
    def overflow_dense(self) -> torch.Tensor:
        if self.overflow_dense_ is None:
            if self.source is None:
                raise ValueError("TwELL has neither a dense backup nor a source to recompute overflow rows")
            x, w = self.source
            self.overflow_dense_ = F.relu(F.linear(x[self.overflow_rows], w))
        return self.overflow_dense_

    @property
    def n_overflow_tiles(self) -> int:
        """Tile rows with more nonzeros than their S - 1 entry slots (spilled or not)."""
        if self.n_overflow_tiles_ is None:
            self.n_overflow_tiles_ = int((self.counts() > self.slots - 1).sum())
        return self.n_overflow_tiles_

    # -- geometry --------------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        return self.tile // self.compression

    @property
    def n_tiles(self) -> int:
        return -(-self.n_cols // self.tile)

    @property
    def n_rows(self) -> int:
        return self.packed.shape[0]

    @property
    def n_overflow_rows(self) -> int:
        return int(self.overflow_rows.numel())

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def words(self) -> torch.Tensor:
        """The packed words as int32 [M, n_tiles, S] (same bits; PyTorch has few uint32 kernels)."""
        return self.packed.view(torch.int32).view(self.n_rows, self.n_tiles, self.slots)

    # -- queries ---------------------------------------------------------------------------------
    def counts(self) -> torch.Tensor:
        """int32 [M, n_tiles]: true nonzero count of each tile row."""
        raw = self._raw_counts()
        spilled = self.spilled()
        if spilled.any():
            offsets = raw[spilled] & ~self.SPILL_BIT
            raw = raw.clone()
            raw[spilled] = self.spill.view(torch.int32)[offsets].to(torch.int64)
        return raw.to(torch.int32)

    def nnz_per_row(self) -> torch.Tensor:
        """int32 [M]: nonzeros per row."""
        return self.counts().sum(-1, dtype=torch.int32)

    def overflow_mask(self) -> torch.Tensor:
        """bool [M]: rows stored in the dense backup."""
        mask = torch.zeros(self.n_rows, dtype=torch.bool, device=self.device)
        mask[self.overflow_rows] = True
        return mask

    def nbytes(self) -> int:
        """Bytes of the format: the packed matrix, the overflow row list, the dense backup and the spill area.

        The backup is counted at its size, [R, H] bf16, without being built: a kernel TwELL recomputes
        it only when asked (``source``). The spill area counts at its allocated size.
        """
        spill = 0 if self.spill is None else self.spill.numel() * self.spill.element_size()
        rows = self.overflow_rows
        return (self.packed.numel() * self.packed.element_size() + rows.numel() * rows.element_size()
                + rows.numel() * self.n_cols * 2 + spill)

    def entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """COO view of the packed part of the non-overflow rows: (rows int64, cols int64, values bf16)."""
        m, _, cols, vals = self._entries()
        return m, cols, vals

    def _entries(self):
        w = self.words()
        raw = self._raw_counts()
        spilled = self.spilled()
        keep = ~self.overflow_mask()[:, None]
        slot = torch.arange(1, self.slots, device=self.device)
        # entry k (1-based slot) of an in-slot tile row is valid when k <= count
        valid = (slot <= raw[..., None]) & (keep & ~spilled)[..., None]
        m, t, k = valid.nonzero(as_tuple=True)
        word = w[m, t, k + 1]
        if spilled.any():
            ms, ts = (spilled & keep).nonzero(as_tuple=True)
            offsets = raw[ms, ts] & ~self.SPILL_BIT
            spill = self.spill.view(torch.int32)
            counts = spill[offsets].to(torch.int64)
            starts = torch.repeat_interleave(offsets + 1, counts)
            within = torch.arange(int(counts.sum()), device=self.device) - torch.repeat_interleave(
                torch.cumsum(counts, 0) - counts, counts)
            m = torch.cat([m, torch.repeat_interleave(ms, counts)])
            t = torch.cat([t, torch.repeat_interleave(ts, counts)])
            word = torch.cat([word, spill[starts + within]])
        halves = word.contiguous().view(torch.int16).view(-1, 2)  # little-endian: [low = column, high = value]
        cols = halves[:, 0].to(torch.int64) & 0xFFFF
        vals = halves[:, 1].contiguous().view(torch.bfloat16)
        return m, t, cols, vals

    def unpack(self) -> torch.Tensor:
        """Dense bf16 [M, H] equal to the packed activation."""
        out = torch.zeros(self.n_rows, self.n_cols, dtype=torch.bfloat16, device=self.device)
        m, cols, vals = self.entries()
        out[m, cols] = vals
        if self.n_overflow_rows:
            out[self.overflow_rows] = self.overflow_dense
        return out

    def validate(self) -> None:
        """Check internal consistency (useful on kernel output); raise ValueError on the first problem."""
        raw = self._raw_counts()
        spilled = self.spilled()
        if spilled.any():
            offsets = raw[spilled] & ~self.SPILL_BIT
            if int(offsets.max()) >= self.spill.numel() - 1:
                raise ValueError("TwELL spill offset past the spill area")
            ends = offsets + 1 + self.spill.view(torch.int32)[offsets].to(torch.int64)
            if int(ends.max()) > self.spill.numel():
                raise ValueError("TwELL spilled entries run past the end of the spill area")
        cnt = self.counts()
        if (cnt < 0).any() or (cnt > self.tile).any():
            raise ValueError(f"TwELL counts outside [0, {self.tile}]")
        over = ((cnt > self.slots - 1) & ~spilled).any(-1)
        listed = self.overflow_mask()
        if not torch.equal(over, listed):
            bad = (over != listed).nonzero().flatten()[:5].tolist()
            raise ValueError(f"overflow_rows disagree with the counts at rows {bad}")
        m, t, cols, vals = self._entries()
        if (cols >= self.n_cols).any() or not torch.equal(torch.div(cols, self.tile, rounding_mode="floor"), t):
            raise ValueError("TwELL entry with a column outside its tile or past H")
        if (vals == 0).any():
            raise ValueError("TwELL entry holding an explicit zero")
        key = m * self.n_cols + cols
        if key.unique().numel() != key.numel():
            raise ValueError("TwELL tile row with a repeated column")


def pack_twell(h: torch.Tensor, tile: int = 256, compression: int = PUBLISHED_COMPRESSION) -> TwELL:
    """Pack a post-ReLU activation ``h`` (bf16 [M, H], any device) into TwELL.

    Any nonzero (NaN and Inf included) is stored; rows whose tile overflows go to the dense backup.
    """
    _require_little_endian()
    slots = check_tiling(tile, compression)
    check_tensor("h", h, dtype=torch.bfloat16, shape=("M", "H"))
    M, H = h.shape
    if columns_limit(H):
        raise ValueError(f"h: {columns_limit(H)}")
    n_tiles = -(-H // tile)
    hp = torch.zeros(M, n_tiles * tile, dtype=h.dtype, device=h.device)
    hp[:, :H] = h
    hp = hp.view(M, n_tiles, tile)
    counts = (hp != 0).sum(-1, dtype=torch.int32)  # [M, n_tiles]
    vals, local = leading_nonzeros(hp, slots - 1, counts)
    tile_start = (torch.arange(n_tiles, device=h.device, dtype=torch.int32) * tile)[:, None]
    valid = torch.arange(slots - 1, device=h.device) < counts[..., None]
    cols = torch.where(valid, local.to(torch.int32) + tile_start, torch.zeros((), dtype=torch.int32, device=h.device))
    halves = torch.stack([cols.to(torch.int16), vals.view(torch.int16)], dim=-1)  # (low, high) halves
    entry_words = halves.view(torch.int32).squeeze(-1)  # [M, n_tiles, S-1]
    words = torch.cat([counts[..., None], entry_words], dim=-1)
    packed = words.reshape(M, n_tiles * slots).contiguous().view(torch.uint32)

    tile_overflow = counts > slots - 1
    rows = tile_overflow.any(-1).nonzero().flatten()
    return TwELL(
        packed=packed,
        overflow_rows_=rows,
        overflow_dense_=h[rows].clone(),
        n_cols=H,
        tile=tile,
        compression=compression,
        n_overflow_tiles_=int(tile_overflow.sum()),
    )


def unpack_twell(t: TwELL) -> torch.Tensor:
    """Dense bf16 [M, H] from a TwELL matrix (same as ``t.unpack()``)."""
    return t.unpack()


def twell_nbytes(M: int, H: int, tile: int = 256, compression: int = PUBLISHED_COMPRESSION) -> int:
    """Bytes of the packed matrix alone (no overflow rows) for an [M, H] activation."""
    slots = check_tiling(tile, compression)
    return M * (-(-H // tile)) * slots * 4
