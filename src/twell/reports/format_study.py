"""Measurements behind notebook 00: what TwELL and hybrid storage cost and how often TwELL overflows.

Every number here comes from packing real tensors with :mod:`twell.formats` (``TwELL.nbytes()``,
``TwELL.n_overflow_rows``, ``Hybrid.nbytes()``...), never from a formula, so the tables follow the
formats if their layout changes.
"""
from __future__ import annotations

import dataclasses
import struct
from typing import Iterable, Sequence

import pandas as pd
import torch

from twell.formats import HybridStatus, TwELL, pack_hybrid, pack_twell

# The four reporting cases of shared/BENCHMARK.md: (target mean active neurons per row, tail).
BENCHMARK_CASES: tuple[tuple[float, float], ...] = ((8, 0.1), (29, 0.1), (64, 0.1), (29, 0.35))

# A toy activation for the packing picture: nonzeros per (row, tile) for 8 rows x 2 tiles of 64 columns.
# With T=64, C=4 a tile row holds 15 entries: row 4 fills tile 0 exactly, row 6 overflows it.
TOY_TILE_COUNTS: tuple[tuple[int, int], ...] = (
    (2, 0), (5, 3), (0, 1), (9, 4), (15, 2), (3, 6), (21, 11), (1, 7),
)


@dataclasses.dataclass(frozen=True)
class SparsityCase:
    """One calibrated-generator setting: mean active neurons per row ``nnz`` and row-scale ``tail``."""

    nnz: float
    tail: float

    @property
    def label(self) -> str:
        return f"nnz {self.nnz:g}, tail {self.tail:g}"


def cases_from(pairs: Iterable[Sequence[float]]) -> list[SparsityCase]:
    """``[(8, 0.1), ...]`` (tuples or 2-lists, as YAML gives them) -> unique SparsityCases, in order."""
    out: list[SparsityCase] = []
    for p in pairs:
        if len(p) != 2:
            raise ValueError(f"expected (nnz, tail) pairs, got {p!r}")
        case = SparsityCase(float(p[0]), float(p[1]))
        if case not in out:
            out.append(case)
    return out


def toy_activation(tile_counts: Sequence[Sequence[int]] = TOY_TILE_COUNTS, tile: int = 64,
                   seed: int = 0) -> torch.Tensor:
    """A small post-ReLU-like bf16 activation [rows, n_tiles * tile] with the given nonzeros per (row, tile).

    Positions are random within each tile; values are |N(0, 1)| + 0.05 (positive, as after a ReLU).
    """
    n_tiles = len(tile_counts[0])
    if any(len(r) != n_tiles for r in tile_counts):
        raise ValueError(f"expected the same number of tiles in every row of tile_counts, got {tile_counts!r}")
    if any(not 0 <= c <= tile for r in tile_counts for c in r):
        raise ValueError(f"expected every count in [0, {tile}], got {tile_counts!r}")
    g = torch.Generator().manual_seed(seed)
    h = torch.zeros(len(tile_counts), n_tiles * tile)
    for r, counts in enumerate(tile_counts):
        for j, c in enumerate(counts):
            cols = j * tile + torch.randperm(tile, generator=g)[:c]
            h[r, cols] = torch.randn(c, generator=g).abs() + 0.05
    return h.to(torch.bfloat16)


def word_grid(t: TwELL) -> dict[str, torch.Tensor]:
    """Decode every packed word of ``t`` for plotting, each [M, n_tiles * S] (CPU).

    ``kind``: 0 count word, 1 stored entry, 2 unused slot; ``value`` float32 (NaN where no entry);
    ``column`` int64 (-1 where no entry); ``count`` int32 [M, n_tiles] the count words; ``overflow`` bool [M].
    """
    w = t.words().cpu()  # int32 [M, n_tiles, S]
    count = w[..., 0]
    slot = torch.arange(t.slots)
    is_entry = (slot >= 1) & (slot <= count[..., None])
    kind = torch.where(slot == 0, 0, torch.where(is_entry, 1, 2))
    halves = w.contiguous().view(torch.int16).view(*w.shape, 2)  # little-endian: (column, value) halves
    column = torch.where(is_entry, halves[..., 0].to(torch.int64) & 0xFFFF, -1)
    value = halves[..., 1].contiguous().view(torch.bfloat16).float()
    value = torch.where(is_entry, value, torch.nan)
    flat = (t.n_rows, t.n_tiles * t.slots)
    return {
        "kind": kind.reshape(flat), "value": value.reshape(flat), "column": column.reshape(flat),
        "count": count, "overflow": t.overflow_mask().cpu(),
    }


def decode_words(t: TwELL, row: int, tile: int = 0) -> pd.DataFrame:
    """The S words of one (row, tile) of ``t`` with their bit fields, one line per slot."""
    if not 0 <= row < t.n_rows or not 0 <= tile < t.n_tiles:
        raise IndexError(f"expected row < {t.n_rows} and tile < {t.n_tiles}, got row={row}, tile={tile}")
    words = t.words()[row, tile].cpu()
    count = int(words[0])
    recs = []
    for k, wd in enumerate(words.tolist()):
        u = wd & 0xFFFFFFFF
        hi, lo = u >> 16, u & 0xFFFF
        if k == 0:
            kind, value, column = "count", float("nan"), ""
        elif k <= count:
            kind = "entry"
            value = struct.unpack("<f", struct.pack("<I", hi << 16))[0]  # bf16 = upper half of an fp32
            column = str(lo)
        else:
            kind, value, column = "unused", float("nan"), ""
        recs.append({"slot": k, "word (hex)": f"0x{u:08x}", "kind": kind,
                     "bits 31..16 (bf16)": f"0x{hi:04x}" if kind == "entry" else "",
                     "value": value, "bits 15..0 (column)": column,
                     "count": count if k == 0 else ""})
    return pd.DataFrame(recs)


def measure_formats(h: torch.Tensor, tiles: Sequence[int] = (64, 128, 256),
                    compressions: Sequence[int] = (2, 4, 8), hybrid_width: int = 128,
                    hybrid_capacity: int | None = None) -> list[dict]:
    """Pack ``h`` (bf16 [M, H]) as dense, TwELL for every (T, C), and hybrid; one record per format.

    Bytes come from the format objects. For a hybrid whose backup is full (status BACKUP_FULL, the
    caller must grow it or run dense), ``bytes_grown`` is the footprint after growing the backup to fit.
    """
    M, H = h.shape
    recs = [{"format": "dense bf16", "tile": None, "compression": None, "bytes": M * H * h.element_size()}]
    for T in tiles:
        for C in compressions:
            t = pack_twell(h, tile=T, compression=C)
            recs.append({
                "format": f"TwELL T={T} C={C}", "tile": T, "compression": C, "slots": t.slots,
                "bytes": t.nbytes(), "overflow_rows": t.n_overflow_rows,
                "overflow_tile_rows": t.n_overflow_tiles, "tile_rows": M * t.n_tiles,
            })
            del t
    hy = pack_hybrid(h, width=hybrid_width, capacity=hybrid_capacity)
    rec = {"format": f"hybrid W={hybrid_width}", "tile": None, "compression": None, "bytes": hy.nbytes(),
           "hybrid_status": hy.status.value, "heavy_rows": hy.n_heavy, "capacity": hy.capacity}
    if hy.status is HybridStatus.BACKUP_FULL:
        rec["bytes_grown"] = pack_hybrid(h, width=hybrid_width, capacity=hy.n_heavy).nbytes()
    else:
        rec["bytes_grown"] = rec["bytes"]
    recs.append(rec)
    return recs


def study_cases(cases: Sequence[SparsityCase], M: int, D: int = 2048, H: int = 5632, *,
                tiles: Sequence[int] = (64, 128, 256), compressions: Sequence[int] = (2, 4, 8),
                hybrid_width: int = 128, seed: int = 0, device: str = "cpu",
                progress: bool = True) -> pd.DataFrame:
    """Generate the calibrated gate activation of every case and measure every format on it.

    One row per (case, format) with the case's measured statistics (``twell.bench.generator``:
    mean/max active per row, max per 256-wide tile) and the format's bytes and overflow counts.
    Activations are generated one case at a time and freed, so M can be large on a GPU.
    """
    from twell.bench.generator import calibrated_ffn_inputs, gate_activation, sparsity_stats
    from twell.progress import progress_bar

    rows = []
    for case in progress_bar(list(cases), progress=progress, desc="calibrated cases", unit="case"):
        inputs = calibrated_ffn_inputs(M, D, H, nnz=case.nnz, tail=case.tail, seed=seed, device=device)
        h = gate_activation(inputs)
        del inputs
        stats = sparsity_stats(h, tile=256)
        base = {"case": case.label, "nnz_target": case.nnz, "tail": case.tail, "M": M, "D": D, "H": H,
                "mean_active": stats["mean_active"], "max_active": stats["max_active"],
                "max_per_256_tile": stats["max_per_tile"], "sparsity": 1.0 - stats["density"]}
        for rec in measure_formats(h, tiles, compressions, hybrid_width):
            rows.append({**base, **rec})
        del h
    df = pd.DataFrame(rows)
    dense = df.loc[df["format"] == "dense bf16"].set_index("case")["bytes"]
    df["bytes_per_token"] = df["bytes"] / df["M"]
    df["vs_dense"] = df["bytes"] / df["case"].map(dense)
    df["overflow_row_frac"] = df["overflow_rows"] / df["M"]
    df["overflow_tile_row_frac"] = df["overflow_tile_rows"] / df["tile_rows"]
    return df


def case_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per case: the measured activation statistics (BENCHMARK.md asks for these)."""
    cols = ["case", "M", "mean_active", "max_active", "max_per_256_tile", "sparsity"]
    return df[cols].drop_duplicates("case").reset_index(drop=True)


def footprint_table(df: pd.DataFrame) -> pd.DataFrame:
    """Bytes per token of every format (columns) for every case (rows), with dense bf16 for scale.

    The hybrid column holds its footprint with the default backup capacity; where that backup was
    too small (the caller must grow it or run dense) the column ``hybrid status`` says so and the
    grown footprint is given.
    """
    wide = df.pivot(index="case", columns="format", values="bytes_per_token")
    order = list(dict.fromkeys(df["case"]))
    fmt_order = list(dict.fromkeys(df["format"]))
    wide = wide.loc[order, fmt_order]
    hy = df[df["format"].str.startswith("hybrid")].set_index("case")
    wide["hybrid status"] = hy["hybrid_status"]
    wide["hybrid grown B/token"] = hy["bytes_grown"] / hy["M"]
    stats = case_table(df).set_index("case")[["mean_active", "sparsity"]]
    return stats.join(wide).reset_index()


def overflow_table(df: pd.DataFrame, cases: Sequence[SparsityCase] | None = None) -> pd.DataFrame:
    """Overflow rate per (case, T, C): fraction of rows and of (row, tile) pairs that overflow."""
    tw = df[df["format"].str.startswith("TwELL")]
    if cases is not None:  # keep the caller's case order
        labels = [c.label for c in cases]
        missing = sorted(set(labels) - set(tw["case"]))
        if missing:
            raise ValueError(f"cases {missing} were not measured in this study (it has: {sorted(set(tw['case']))})")
        rank = {lab: i for i, lab in enumerate(labels)}
        tw = tw[tw["case"].isin(labels)]
        tw = tw.iloc[tw["case"].map(rank).argsort(kind="stable")]
    cols = ["case", "M", "tile", "compression", "slots", "overflow_rows", "overflow_row_frac",
            "overflow_tile_row_frac", "mean_active", "max_per_256_tile"]
    out = tw[cols].copy()
    ints = ["tile", "compression", "slots", "overflow_rows"]
    out[ints] = out[ints].astype(int)
    return out.reset_index(drop=True)


def overflow_summary(df_overflow: pd.DataFrame, tile: int = 256, compression: int = 8) -> str:
    """One line per case: how many rows overflow at (tile, compression), measured in this run."""
    sel = df_overflow[(df_overflow["tile"] == tile) & (df_overflow["compression"] == compression)]
    if sel.empty:
        raise ValueError(f"no TwELL T={tile} C={compression} rows in the overflow table")
    lines = [f"TwELL T={tile} C={compression} ({tile // compression - 1} entries per tile row), "
             f"M = {int(sel['M'].iloc[0])} rows per case:"]
    for rec in sel.itertuples():
        lines.append(f"  {rec.case:<20} {int(rec.overflow_rows):>6} rows overflow ({100 * rec.overflow_row_frac:.3g}%), "
                     f"{100 * rec.overflow_tile_row_frac:.3g}% of (row, tile) pairs; "
                     f"max nonzeros in a 256-wide tile row: {int(rec.max_per_256_tile)}")
    return "\n".join(lines)
