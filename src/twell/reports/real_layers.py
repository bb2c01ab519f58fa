"""The layers of trained checkpoints, gathered from every benchmark run that captured them.

``python -m twell.bench ffn --checkpoint CKPT --tokens DATA`` adds one "real" case per layer: the
FFN's inputs on real text. Each run holds one checkpoint, whose layers land at whatever sparsity its
training reached, so no single run has a layer at each of the bars' nnz (8, 29, 64). Pooled over runs,
they cover that range, which is what comparing the bars with real activations needs.

- :func:`real_layer_table`: one row per (run, layer, implementation) of every GPU result in ``dirs``
  that follows the BENCHMARK.md protocol.
- :func:`plot_real_layers`: speedup against mean active neurons per row, with the generator's curve
  of one run and the speed bars for comparison.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Sequence

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from twell.bench.ffn import device_slug, run_deviations
from twell.reports.kernel_study import BAR_M, HEAVY_CASE, SPEED_BAR, WRONG_LABEL, load_bench, plot_wrong

COLUMNS = ["run", "measured at", "device", "checkpoint", "layer", "M", "nnz mean", "nnz p99", "nnz max", "reuse 64", "impl",
           "dense ms", "sparse ms", "speedup", "rel. error", "correct", "csrc"]
# A run is a device's file stamp and tag (two GPUs' runs with one stamp count apart); a layer is one of a run's.
RUN_KEYS = ["device", "run"]
LAYER_KEYS = [*RUN_KEYS, "layer"]
_IMPL_STYLE = {  # the per-row default and the block-union rule; any other implementation gets a grey square
    "twell-kernel": dict(marker="o", color="tab:blue", mfc="tab:blue", label="twell-kernel (per-row)"),
    "twell-kernel-union": dict(marker="D", color="tab:red", mfc="white", label="twell-kernel-union (block-union rule)"),
}


def real_layer_table(dirs: Sequence[str | Path], pattern: str = "ffn-*.json") -> pd.DataFrame:
    """Every real (captured checkpoint layer) case of every GPU benchmark JSON in ``dirs`` whose
    config follows the protocol, one row per implementation. ``run`` is the file's stamp and tag
    (its name less ``ffn-`` and the device); ``reuse 64`` is the active (row, neuron)
    pairs per distinct neuron in blocks of 64 rows (what the block-union path can save; NaN in runs
    older than that statistic); ``csrc`` the kernel sources' digest (``not recorded`` in runs
    older than that record). Files that are not benchmark results, and runs that did not finish, are skipped; a
    file found in two folders (same name) counts once."""
    rows, seen = [], set()
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            continue
        for path in sorted(d.glob(pattern)):
            if path.name in seen:
                continue
            try:
                result = load_bench(path)
            except (ValueError, OSError):
                continue
            meta = result["meta"]
            if run_deviations(meta) or not result.get("complete", True):
                continue
            seen.add(path.name)
            # The file's stem less "ffn-" and the device (write_outputs names files ffn-<device>-<stamp>-<tag>).
            run = path.stem.removeprefix("ffn-").removeprefix(f"{device_slug(meta['device_name'])}-")
            for r in result["cases"]:
                c, s = r["case"], r["sparsity"]
                if c["kind"] != "real":
                    continue
                for impl, v in r.get("impls", {}).items():
                    rows.append({
                        "run": run, "measured at": meta["timestamp"], "device": meta["device_name"],
                        "checkpoint": meta.get("config", {}).get("checkpoint") or "",
                        "layer": int(c.get("layer", -1)), "M": int(c["M"]), "nnz mean": s["mean_active"],
                        "nnz p99": s.get("p99_active", math.nan), "nnz max": s["max_active"],
                        "reuse 64": s.get("union_reuse_64", math.nan), "impl": impl,
                        "dense ms": r["dense"].get("timing", {}).get("median_ms", math.nan),
                        "sparse ms": v.get("timing", {}).get("median_ms", math.nan),
                        "speedup": v.get("speedup", math.nan), "rel. error": v.get("rel_err", math.nan),
                        "correct": "yes" if v.get("ok") else "no",
                        "csrc": (meta.get("code") or {}).get("csrc", "not recorded"),
                    })
    table = pd.DataFrame(rows, columns=COLUMNS)
    return table.sort_values(["measured at", "layer", "impl"], ignore_index=True)


def bar_brackets(table: pd.DataFrame, impl: str, device: str | None = "H100") -> pd.DataFrame:
    """For each nnz bar (8, 29, 64): the nearest correct layer of ``impl`` at the bars' M (65536 tokens)
    below and above that nnz, with their speedups, so a reader sees what real layers around the bar
    reach (no interpolation). Only layers measured on a device whose name contains ``device`` (the
    bars are H100 numbers; None: any device, each layer then names its device)."""
    sub = table[(table["impl"] == impl) & (table["correct"] == "yes") & (table["M"] == BAR_M)]
    if device is not None:
        on_device = sub[sub["device"].str.contains(device, regex=False)]
        if on_device.empty and not sub.empty:
            warnings.warn(f"no {impl} layer measured on a {device} (devices here: {sorted(sub['device'].unique())}); "
                          "the brackets are empty: pass device=None to use the others", stacklevel=2)
        sub = on_device
    out = []
    for case, bar in SPEED_BAR.items():
        if case == HEAVY_CASE:
            continue
        nnz = float(case.removeprefix("nnz"))
        below = sub[sub["nnz mean"] <= nnz].sort_values("nnz mean").tail(1)
        above = sub[sub["nnz mean"] > nnz].sort_values("nnz mean").head(1)

        def pick(frame, what):
            if frame.empty:
                return {f"{what} nnz": math.nan, f"{what} speedup": math.nan, f"{what} layer": ""}
            r = frame.iloc[0]
            where = f"{r['run']} layer {r['layer']}" + ("" if device is not None else f" ({r['device']})")
            return {f"{what} nnz": r["nnz mean"], f"{what} speedup": r["speedup"], f"{what} layer": where}

        out.append({"bar case": case, "bar": bar, "impl": impl, **pick(below, "below"), **pick(above, "above")})
    return pd.DataFrame(out)


def _layers_and_runs(table: pd.DataFrame) -> tuple[int, int]:
    return table.groupby(LAYER_KEYS).ngroups, table.groupby(RUN_KEYS).ngroups


def count_line(table: pd.DataFrame) -> str:
    """'<layers> layers from <runs> runs; correct: <n> of <m> measurements' (runs and layers as
    ``RUN_KEYS`` / ``LAYER_KEYS`` count them, as in the figure)."""
    layers, runs = _layers_and_runs(table)
    return f"{layers} layers from {runs} runs; correct: {int((table['correct'] == 'yes').sum())} of {len(table)} measurements"


def plot_real_layers(table: pd.DataFrame, generator: pd.DataFrame | None = None, generator_label: str = "",
                     impls: Sequence[str] | None = ("twell-kernel", "twell-kernel-union")) -> Figure:
    """Speedup vs mean active neurons per row of every real layer in ``table`` (colour and marker
    by implementation; a thin line joins a layer's implementations), the speed bars at nnz 8/29/64,
    and, when given, the generator's M = 65536 curve of one run (a speedup_table of notebook 01) for
    comparison. ``impls``: the implementations drawn (None: all; the table keeps them all). Red
    crosses mark wrong results."""
    if impls is not None:
        table = table[table["impl"].isin(impls)]
    if table.empty:
        raise ValueError(f"no real layers to plot (expected a non-empty real_layer_table with impls {impls})")
    fig = Figure(figsize=(11, 6.2), layout="constrained")
    ax = fig.subplots()
    for _, grp in table.groupby(LAYER_KEYS):
        if len(grp) > 1:
            ax.plot(grp["nnz mean"], grp["speedup"], "-", color="grey", lw=0.8, alpha=0.6)
    handles, labels = [], []
    for impl, grp in table.groupby("impl"):
        style = dict(_IMPL_STYLE.get(impl, dict(marker="s", color="dimgrey", mfc="white", label=impl)))
        label = style.pop("label")
        ax.plot(grp["nnz mean"], grp["speedup"], ls="none", ms=8, mew=1.5, mec=style["color"], **style)
        handles.append(Line2D([], [], ls="none", ms=8, mew=1.5, mec=style["color"], **style))
        labels.append(f"real layers, {label}")
    if plot_wrong(ax, table):
        handles.append(Line2D([], [], marker="x", color="red", ms=10, mew=2.5, ls="none"))
        labels.append(WRONG_LABEL)
    if generator is not None:
        gen = generator[(generator["shape"] == "inference") & (generator["M"] == BAR_M)
                        & (generator["case"] != HEAVY_CASE)].sort_values("nnz mean")
        if len(gen):
            ax.plot(gen["nnz mean"], gen["speedup"], "o--", color="black", mfc="black", ms=6, lw=1.2)
            handles.append(Line2D([], [], marker="o", ls="--", color="black", ms=6))
            labels.append(f"generator (BENCHMARK.md), {gen['impl'].iloc[0]}, M = {BAR_M}" +
                          (f"\n{generator_label}" if generator_label else ""))
    bar_x = {k: float(k.removeprefix("nnz")) for k in SPEED_BAR if k != HEAVY_CASE}
    ax.plot(list(bar_x.values()), [SPEED_BAR[k] for k in bar_x], "_", color="crimson", ms=26, mew=3, ls="none")
    handles.append(Line2D([], [], marker="_", color="crimson", ms=20, mew=3, ls="none"))
    labels.append("speed bar (on the generator), nnz 8/29/64")
    ax.axhline(1.0, color="grey", lw=1.2)
    xmax = max(float(table["nnz mean"].max()), 64.0) * 1.08
    top = float(table["speedup"].max())  # NaN when every layer failed
    ymax = max(0.0 if math.isnan(top) else top, max(SPEED_BAR.values())) * 1.15
    ax.set_xlim(0, xmax)
    ax.set_ylim(0, ymax)
    ax.set_xlabel("measured mean active neurons per row (of H) in the layer")
    ax.set_ylabel("speedup vs dense PyTorch (dense ms / sparse ms)")
    ax.grid(alpha=0.3)
    layers, runs = _layers_and_runs(table)
    first, last = table["measured at"].min()[:10], table["measured at"].max()[:10]
    Ms = "/".join(str(m) for m in sorted(table["M"].unique()))
    devices = ", ".join(sorted(table["device"].unique()))
    fig.suptitle(f"Sparse FFN on real activations: {layers} layers of {runs} benchmark runs of trained checkpoints\n"
                 f"(M = {Ms} tokens per layer; runs of {first} to {last}; {devices})", fontsize=11)
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    return fig
