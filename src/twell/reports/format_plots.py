"""Pictures for notebook 00: a tile before/after TwELL packing, footprint and overflow curves.

Each function returns a matplotlib Figure (built without pyplot state, so it works headless);
save it with :func:`twell.reports.save_figure`.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from matplotlib import colormaps
from matplotlib.colors import ListedColormap, LogNorm
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from twell.formats import TwELL
from twell.reports.format_study import word_grid

_VALUE_CMAP = "viridis"
_C_COLORS = {2: "tab:blue", 4: "tab:orange", 8: "tab:green"}


def plot_tile_packing(h: torch.Tensor, t: TwELL) -> Figure:
    """Top: the dense activation ``h`` [M, H] (zeros white, tile borders drawn). Bottom: the packed
    words of ``t`` [M, n_tiles * S]: count words, entries (coloured by value, labelled with their
    global column), unused slots, and the overflow rows whose dense copy consumers read instead."""
    h = h.detach().float().cpu()
    M, H = h.shape
    g = word_grid(t)
    S, n_tiles = t.slots, t.n_tiles
    vmax = float(h.max()) if h.numel() and float(h.max()) > 0 else 1.0
    cmap = colormaps[_VALUE_CMAP].with_extremes(bad="white")

    # at most 13.5 in: a notebook 1000 px wide at 72 px per inch (the pipeline's inline resolution)
    fig = Figure(figsize=(min(13.5, max(10.0, 0.36 * n_tiles * S + 2.5)), 2.2 + 0.62 * M * 2), layout="constrained")
    ax_d, ax_p = fig.subplots(2, 1, height_ratios=[1, 1.15])

    # Dense tile: zeros masked so the sparsity pattern is visible.
    dense = np.ma.masked_equal(h.numpy(), 0.0)
    im = ax_d.imshow(dense, cmap=cmap, vmin=0, vmax=vmax, aspect="auto", interpolation="nearest")
    for j in range(1, n_tiles):
        ax_d.axvline(j * t.tile - 0.5, color="black", lw=1.5)
    for r in range(M):
        nnz = [int((h[r, j * t.tile:(j + 1) * t.tile] != 0).sum()) for j in range(n_tiles)]
        ax_d.text(H - 0.5 + H * 0.005, r, " " + " | ".join(map(str, nnz)), va="center", ha="left", fontsize=8)
    ax_d.set_title(f"dense post-ReLU activation h [{M}, {H}] (white = 0); tiles of T = {t.tile} columns, "
                   f"nonzeros per tile at right", fontsize=10)
    ax_d.set_xlabel("column")
    ax_d.set_ylabel("row")
    ax_d.set_yticks(range(M))
    ax_d.set_xticks(list(range(0, H, max(1, t.tile // 4))) + [H - 1])

    # Packed words: background by kind, entries by value.
    kind = g["kind"].numpy()
    bg = ListedColormap(["#f4c542", "white", "#d9d9d9"])  # count, entry (drawn over), unused
    ax_p.imshow(kind, cmap=bg, vmin=0, vmax=2, aspect="auto", interpolation="nearest")
    vals = np.ma.masked_invalid(g["value"].numpy())
    entry_cmap = colormaps[_VALUE_CMAP].with_extremes(bad=(0, 0, 0, 0))  # let the background show through
    ax_p.imshow(vals, cmap=entry_cmap, vmin=0, vmax=vmax, aspect="auto", interpolation="nearest")
    counts = g["count"].numpy()
    cols = g["column"].numpy()
    for r in range(M):
        for k in range(n_tiles * S):
            if kind[r, k] == 0:
                ax_p.text(k, r, str(counts[r, k // S]), ha="center", va="center", fontsize=8, fontweight="bold")
            elif kind[r, k] == 1:
                v = float(vals[r, k])
                ax_p.text(k, r, str(cols[r, k]), ha="center", va="center", fontsize=6.5,
                          color="white" if v < 0.6 * vmax else "black")
    for j in range(1, n_tiles):
        ax_p.axvline(j * S - 0.5, color="black", lw=1.5)
    for r in np.flatnonzero(g["overflow"].numpy()):
        ax_p.add_patch(Rectangle((-0.5, r - 0.5), n_tiles * S, 1, fill=False, edgecolor="red", lw=2.5))
        ax_p.text(n_tiles * S - 0.5 + 0.3, r, " overflow row:\n dense copy used", color="red", va="center",
                  fontsize=8)
    ax_p.set_title(f"TwELL packed words [{M}, {n_tiles} x S], S = T/C = {t.tile}/{t.compression} = {S} "
                   f"uint32 words per (row, tile); entries labelled with their column", fontsize=10)
    ax_p.set_xlabel("word (slot) index")
    ax_p.set_ylabel("row")
    ax_p.set_yticks(range(M))
    ax_p.set_xticks(range(0, n_tiles * S, max(1, S // 4)))
    fig.legend(
        handles=[Patch(color="#f4c542", label="word 0: count"), Patch(color=cmap(0.6), label="entry (bf16 value | column)"),
                 Patch(color="#d9d9d9", label="unused slot"), Patch(fill=False, edgecolor="red", lw=2, label="overflow row")],
        loc="outside lower center", ncol=4, fontsize=9, frameon=False,
    )
    fig.colorbar(im, ax=[ax_d, ax_p], label="activation value", shrink=0.6, pad=0.01)
    return fig


def plot_footprint(df: pd.DataFrame, sweep_tail: float = 0.1) -> Figure:
    """Bytes per token relative to dense bf16 versus measured active neurons per row: one panel per
    tile width T, a line per compression C, the hybrid format, and the heavy-tail cases as stars."""
    tiles = sorted(int(t) for t in df["tile"].dropna().unique())
    H = int(df["H"].iloc[0])
    fig = Figure(figsize=(min(13.5, 4.0 * len(tiles) + 1.5), 4.4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(tiles), sharey=True))
    sweep = df[np.isclose(df["tail"], sweep_tail)].sort_values("mean_active")
    others = df[~np.isclose(df["tail"], sweep_tail)]
    hy = sweep[sweep["format"].str.startswith("hybrid")]
    hy_name = hy["format"].iloc[0] if len(hy) else "hybrid"  # e.g. "hybrid W=128", as the study ran it
    for ax, T in zip(axes, tiles):
        ax.axhline(1.0, color="gray", lw=2, label="dense bf16")
        for C in sorted(int(c) for c in df["compression"].dropna().unique()):
            sel = sweep[(sweep["tile"] == T) & (sweep["compression"] == C)]
            color = _C_COLORS.get(C)
            ax.plot(sel["mean_active"], sel["vs_dense"], "o-", color=color, label=f"TwELL C={C}")
            oth = others[(others["tile"] == T) & (others["compression"] == C)]
            ax.plot(oth["mean_active"], oth["vs_dense"], "*", ms=13, color=color, mec="black", mew=0.6)
        ok = hy["hybrid_status"] == "ok"
        dense_b = hy["bytes"] / hy["vs_dense"]
        ax.plot(hy["mean_active"], hy["bytes_grown"] / dense_b, "k--", lw=1, alpha=0.6)
        ax.plot(hy["mean_active"][ok], hy["vs_dense"][ok], "ks", label=f"{hy_name}, backup M/8")
        ax.plot(hy["mean_active"][~ok], (hy["bytes_grown"] / dense_b)[~ok], "ks", mfc="white",
                label="hybrid: backup full, grown to fit")
        ax.set_xscale("log")
        ax.set_title(f"T = {T}")
        ax.set_xlabel(f"measured mean active neurons per row (of H = {H})")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("bytes per token / dense bf16")
    if len(others):  # the cases off the sweep's tail (BENCHMARK.md's heavy tail: 0.35)
        tails = ", ".join(f"{t:g}" for t in sorted(others["tail"].unique()))
        axes[-1].plot([], [], "*", ms=13, color="white", mec="black", label=f"tail {tails},\nsame colours")
    handles, labels = axes[-1].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="outside right center")
    M = int(df["M"].iloc[0])
    fig.suptitle(f"Memory footprint of the packed activation vs dense bf16 (calibrated generator, "
                 f"tail {sweep_tail:g}, M = {M}; overflow rows stored dense)", fontsize=11)
    return fig


def plot_overflow(df_overflow: pd.DataFrame) -> Figure:
    """Overflow rate for every generator case (rows) and tile width / compression (columns, C
    increasing within each T): top the fraction of rows that overflow, bottom the fraction of
    (row, tile) pairs. Cells are annotated; white means no overflow among the M rows."""
    M = int(df_overflow["M"].iloc[0])
    cases = list(dict.fromkeys(df_overflow["case"]))
    configs = sorted({(int(t), int(c)) for t, c in zip(df_overflow["tile"], df_overflow["compression"])})
    fig = Figure(figsize=(2.5 + 0.95 * len(configs), 1.6 + 1.1 * len(cases)), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    cmap = colormaps["Reds"].with_extremes(bad="white")
    metrics = [("overflow_row_frac", "rows that overflow", "overflow_rows"),
               ("overflow_tile_row_frac", "(row, tile) pairs that overflow", None)]
    for ax, (col, title, count_col) in zip(axes, metrics):
        pct = np.zeros((len(cases), len(configs)))
        counts = np.zeros_like(pct)
        for i, case in enumerate(cases):
            for j, (T, C) in enumerate(configs):
                sel = df_overflow[(df_overflow["case"] == case) & (df_overflow["tile"] == T)
                                  & (df_overflow["compression"] == C)]
                pct[i, j] = 100 * float(sel[col].iloc[0])
                counts[i, j] = float(sel[count_col].iloc[0]) if count_col else np.nan
        shown = np.ma.masked_less_equal(pct, 0.0)
        vmax = max(float(pct.max()), 1e-3)
        ax.imshow(shown, cmap=cmap, norm=LogNorm(vmin=min(vmax / 1e3, 1e-3), vmax=vmax), aspect="auto")
        for i in range(len(cases)):
            for j in range(len(configs)):
                text = "0" if pct[i, j] == 0 else f"{pct[i, j]:.2g}%"
                if count_col and pct[i, j] > 0:
                    text += f"\n({int(counts[i, j])})"
                dark = pct[i, j] > 0 and np.log10(pct[i, j] / vmax) > -1
                ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
        ax.set_xticks(range(len(configs)), [f"T={T}\nC={C}" for T, C in configs], fontsize=8)
        ax.set_yticks(range(len(cases)), cases)
        for j in range(1, len(configs)):
            if configs[j][0] != configs[j - 1][0]:
                ax.axvline(j - 0.5, color="black", lw=1.5)
        ax.set_title(title + (" (number of rows)" if count_col else ""), fontsize=10)
    fig.suptitle(f"TwELL overflow rate vs tile width T and compression C (calibrated generator, M = {M} rows; "
                 f"0 = no overflow among them)", fontsize=11)
    return fig
