"""Notebook 04's steps: run ``twell.bench.model`` per scale, read its results, and lay them out as the
paper's main table (dense against sparse per scale: inference throughput, energy per token, peak
memory, training throughput), with the paper's own numbers in separate, labelled columns; a rounded view of
that table for reading (ours beside the paper's, per scale); and three figures (speed-up per scale, energy
per token, training peak memory)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Mapping, Optional

from twell.bench.model import PAPER, ModelBenchConfig, run_model_bench, write_outputs
from twell.paths import repo_root


def _path(p: str | Path) -> str:
    """Checkpoint paths relative to the repository root (as the pipeline profiles give them); hub ids
    (no such local path, a single slash) pass through."""
    path = Path(p).expanduser()
    if path.is_absolute():
        return str(path)
    local = repo_root() / path
    return str(local) if local.exists() or len(path.parts) != 2 else str(p)


def run_scales(models: Mapping[str, Mapping[str, str]], out_dir: str | Path, *, progress: bool = True,
               **bench) -> list[Path]:
    """Run the model benchmark for every scale: ``models`` maps a label (``"0.5B"``) to
    ``{"sparse": checkpoint, "dense": checkpoint or None}``; ``bench`` holds ModelBenchConfig fields.
    Writes ``<out_dir>/model-*.json/.md`` per scale and returns the JSON paths."""
    paths = []
    for label, ck in models.items():
        if "sparse" not in ck:
            raise ValueError(f"scale {label!r}: expected {{'sparse': checkpoint, 'dense': checkpoint}}, got {dict(ck)}")
        sparse = _path(ck["sparse"])
        if not Path(sparse).exists() and Path(ck["sparse"]).parts[0] in ("runs", "reports"):
            raise FileNotFoundError(f"scale {label!r}: no checkpoint at {sparse}; train it first (notebook 02 "
                                    "leaves runs/notebook02/<config>/final, python -m twell.train runs/<name>/final)")
        cfg = ModelBenchConfig(checkpoint=sparse, dense_checkpoint=_path(ck["dense"]) if ck.get("dense") else None,
                               label=label, **bench)
        res = run_model_bench(cfg, progress=progress)
        paths.append(write_outputs(res, Path(out_dir))[0])
    return paths


def load_results(paths: Iterable[str | Path]) -> list[dict]:
    out = []
    for p in paths:
        path = Path(p)
        if not path.is_absolute() and not path.exists():  # as the profiles give them: from the checkout
            path = repo_root() / path
        out.append(json.loads(path.read_text()))
    return out


def _row(res: dict, measure: str, batch: Optional[int] = None) -> Optional[dict]:
    rows = [r for r in res["rows"] if r["measure"] == measure and (batch is None or r["batch"] == batch)]
    return rows[0] if rows else None


def _largest_prefill(res: dict) -> Optional[dict]:
    """The prefill row of the largest batch (the table's and the energy and memory figures' row)."""
    return max((r for r in res["rows"] if r["measure"] == "prefill"), key=lambda r: r["batch"], default=None)


def _gain(r: Optional[dict]) -> Optional[float]:
    return None if r is None else r["speedup"] - 1.0


def paper_scale(label: str) -> str:
    """The paper's name of the scale a row label starts with: "0.5B", or a config name such as "0p5b" or
    "1p5b (5000 steps)" -> "0.5B" / "1.5B"; the label itself when it starts with no scale."""
    m = re.match(r"\s*(\d+)(?:[p.](\d+))?\s*b\b", label, flags=re.IGNORECASE)
    if not m:
        return label
    return f"{m.group(1)}{'.' + m.group(2) if m.group(2) else ''}B"


def efficiency_table(results: list[dict]):
    """One row per scale: our measurements (dense, sparse, change) and the paper's in its own columns."""
    import pandas as pd

    rows = []
    for res in results:
        m, meta = res["model"], res["meta"]
        big = _largest_prefill(res)
        dec1 = min((r for r in res["rows"] if r["measure"] == "decode"), key=lambda r: r["batch"], default=None)
        # the decode row without launch overhead at the eager row's batch (else the smallest): the compiled
        # step where it was measured, else the eager step
        graphs = [r for r in res["rows"] if r["measure"] in ("decode-compiled-graph", "decode-graph")]
        batch = dec1["batch"] if dec1 else min((r["batch"] for r in graphs), default=None)
        at = [r for r in graphs if r["batch"] == batch]
        dg1 = next((r for r in at if r["measure"] == "decode-compiled-graph"), at[0] if at else None)
        tr = _row(res, "training")
        e_d = big["dense"].get("joules_per_token") if big else None
        e_s = big["sparse"].get("joules_per_token") if big else None
        mb = lambda v: None if v is None else v / 2**20  # noqa: E731
        rows.append({
            "scale": m["label"], "layers": m["layers"], "device": meta["device_name"],
            "active % (sparse)": None if m["activity"]["sparse"]["active_frac"] is None
            else 100 * m["activity"]["sparse"]["active_frac"],
            "CE dense": m["activity"]["dense"]["ce"], "CE sparse": m["activity"]["sparse"]["ce"],
            "tokens": m["tokens"]["kind"],
            "prefill batch": big["batch"] if big else None,
            "prefill tok/ms dense": big["dense"]["tokens_per_ms"] if big else None,
            "prefill tok/ms sparse": big["sparse"]["tokens_per_ms"] if big else None,
            "prefill gain %": None if big is None else 100 * _gain(big),
            "decode batch": dec1["batch"] if dec1 else (dg1["batch"] if dg1 else None),
            "decode eager gain %": None if dec1 is None else 100 * _gain(dec1),
            "decode CUDA graph gain %": None if dg1 is None else 100 * _gain(dg1),
            "decode CUDA graph step": None if dg1 is None else
                ("compiled" if dg1["measure"] == "decode-compiled-graph" else "eager"),
            "energy J/token dense": e_d, "energy J/token sparse": e_s,
            "energy change %": None if not (e_d and e_s) else 100 * (e_s / e_d - 1),
            "peak MB dense": mb(big["dense"].get("peak_bytes")) if big else None,
            "peak MB sparse": mb(big["sparse"].get("peak_bytes")) if big else None,
            "training tok/s dense": tr["dense"]["tokens_per_s"] if tr else None,
            "training tok/s sparse": tr["sparse"]["tokens_per_s"] if tr else None,
            "training gain %": None if tr is None else 100 * _gain(tr),
            "training peak MB dense": mb(tr["dense"].get("peak_bytes")) if tr else None,
            "training peak MB sparse": mb(tr["sparse"].get("peak_bytes")) if tr else None,
            "paper: inference gain %": (None if paper_scale(m["label"]) not in PAPER["inference"]
                                        else 100 * PAPER["inference"][paper_scale(m["label"])]),
            "paper: training gain % (range over scales)": "{:+.1f} to {:+.1f}".format(
                *(100 * v for v in PAPER["training_range"])),
            "paper: energy change % (range over scales)": "{:+.0f} to {:+.0f}".format(
                *(100 * v for v in PAPER["energy_range"])),
            "note": meta.get("note") or "",
        })
    return pd.DataFrame(rows)


def _change(new, old) -> Optional[float]:
    return None if new is None or not old else 100 * (new / old - 1)


def paper_view(table):
    """The rounded view of :func:`efficiency_table` that notebook 04 shows: one row per scale, our number
    beside the paper's for each measure (two header rows: measure, then ours / paper), units in the
    headers, no index. Gains are sparse over dense in percent; the paper's training and energy numbers
    are ranges over its scales, the same for every row."""
    import pandas as pd

    def pick(col):
        return table[col] if col in table else pd.Series([None] * len(table))

    def num(col, digits):  # a measured column: None (not measured, e.g. energy on a CPU) shows blank
        return pd.to_numeric(pick(col), errors="coerce").round(digits)

    paper_inf = pick("paper: inference gain %").map(lambda v: "" if v is None or pd.isna(v) else f"{v:+.1f}")
    steps = table["scale"].map(lambda s: s.split("(", 1)[1].rstrip(")") if "(" in s else "")
    view = pd.DataFrame({
        ("model", "scale"): table["scale"].map(paper_scale),
        ("model", "trained"): steps,
        ("model", "active % (sparse)"): num("active % (sparse)", 2),
        ("model", "CE sparse − dense"): (num("CE sparse", 12) - num("CE dense", 12)).round(3),
        ("prefill throughput gain %", "ours"): num("prefill gain %", 1),
        ("prefill throughput gain %", "paper"): paper_inf,
        ("decode gain %, batch 1", "CUDA graph"): num("decode CUDA graph gain %", 1),
        ("decode gain %, batch 1", "eager"): num("decode eager gain %", 1),
        ("energy per token change %", "ours"): num("energy change %", 1),
        ("energy per token change %", "paper"): pick("paper: energy change % (range over scales)"),
        ("training throughput gain %", "ours"): num("training gain %", 1),
        ("training throughput gain %", "paper"): pick("paper: training gain % (range over scales)"),
        ("training peak memory change %", "ours"): [
            None if d is None or pd.isna(d) else round(_change(s_, d), 1)
            for s_, d in zip(pick("training peak MB sparse"), pick("training peak MB dense"))],
    })
    view.columns = pd.MultiIndex.from_tuples(view.columns)
    return view


def show_view(view):
    """A pandas Styler of :func:`paper_view` for display: gains signed to one decimal, no index, a measure the
    run did not take left blank."""
    def fmt(spec):
        return lambda v: "" if v is None or v != v else format(v, spec)

    formats = {c: fmt("+.1f") for c in view.columns if view[c].dtype.kind == "f"}
    formats[("model", "active % (sparse)")] = fmt(".2f")
    formats[("model", "CE sparse − dense")] = fmt("+.3f")
    return view.style.hide(axis="index").format({c: f for c, f in formats.items() if c in view.columns})


# Bar groups of the speed-up figure: (measure, label) in drawing order; each at every batch a run measured.
SPEEDUP_MEASURES = (("prefill", "prefill"), ("decode-compiled-graph", "decode, compiled CUDA graph"),
                    ("decode-graph", "decode, CUDA graph"), ("decode", "decode, eager generate"),
                    ("training", "training step"))


def figures(results: list[dict], title: Optional[str] = None) -> dict:
    """``speedup`` (sparse / dense throughput per scale and measure), ``energy`` (mJ per token, prefill at the
    largest batch) and ``memory`` (training step peak, GB) figures, each with one title (``title``: the
    device, appended to it). A measure one scale's run did not take is marked "not measured" where its bar
    would be. The prefill peak is not drawn: at these batch sizes the logits set it, the same on both sides."""
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [paper_scale(r["model"]["label"]) for r in results]
    x = np.arange(len(labels))
    keys = [(m, b, name) for m, name in SPEEDUP_MEASURES
            for b in sorted({r["batch"] for res in results for r in res["rows"] if r["measure"] == m})]
    suffix = f" ({title})" if title else ""
    figs = {}
    fig, ax = plt.subplots(figsize=(12.5, 5.2))
    w = 0.84 / max(1, len(keys))
    colors = plt.get_cmap("tab10").colors
    missing: dict[tuple[str, str], list[int]] = {}
    for i, (meas, b, name) in enumerate(keys):
        pos = x + (i - (len(keys) - 1) / 2) * w
        vals = np.array([(_row(res, meas, b) or {}).get("speedup", np.nan) for res in results], dtype=float)
        ax.bar(pos, vals, w, label=f"{name}, batch {b}", color=colors[i % len(colors)])
        for p, v, lab in zip(pos, vals, labels):
            if np.isnan(v):
                ax.text(p, 1.005, "not measured", rotation=90, ha="center", va="bottom", fontsize=9, color="0.35")
                missing.setdefault((lab, name), []).append(b)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylim(min(0.8, np.nanmin([(_row(res, m, b) or {}).get("speedup", np.nan) for res in results
                                    for m, b, _ in keys] + [1.0]) - 0.05), None)
    ax.set_xticks(x, labels, fontsize=12)
    ax.set_ylabel("sparse / dense throughput", fontsize=12)
    ax.set_title("Sparse over dense throughput per scale" + suffix, fontsize=13)
    ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(alpha=0.3, axis="y")
    if missing:
        gaps = "; ".join(f"{lab}'s run has no '{name}' rows (batch {', '.join(map(str, bs))})"
                         for (lab, name), bs in missing.items())
        fig.text(0.01, 0.005, f"not measured: {gaps}", fontsize=10, color="0.35", ha="left", va="bottom")
    figs["speedup"] = fig
    for key, pick, unit, ylabel, name in (
            ("energy", _largest_prefill, 1e3, "mJ per token", "Energy per token, prefill at the largest batch"),
            ("memory", lambda res: _row(res, "training"), 1 / 1e9, "peak GB", "Training step peak memory")):
        fig, ax = plt.subplots(figsize=(8, 4.4))
        field = "joules_per_token" if key == "energy" else "peak_bytes"
        for j, side in enumerate(("dense", "sparse")):
            vals = []
            for res in results:
                row = pick(res)
                v = row[side].get(field) if row else None
                vals.append(np.nan if v is None else v * unit)
            ax.bar(x + (j - 0.5) * 0.4, vals, 0.4, label=side)
        ax.set_xticks(x, labels, fontsize=12)
        ax.set_ylabel(ylabel, fontsize=12)
        ax.set_title(name + suffix, fontsize=13)
        ax.legend(fontsize=11)
        ax.grid(alpha=0.3, axis="y")
        figs[key] = fig
    for fig in figs.values():
        fig.tight_layout(rect=(0, 0.04, 1, 1) if fig is figs["speedup"] and missing else None)
    return figs


# The paper's sparsity at 1.5B: about 29 of 5632 neurons active per token (the benchmarks' "nnz29" case).
PAPER_CASE = "nnz29"
FFN_MEASURES = {"inference": "large-batch op (gate + fused kernel)", "training": "training kernels (forward + backward)",
                "decode": "decoding op"}


def ffn_at_paper_sparsity(files: Mapping[str, str | Path], case: str = PAPER_CASE):
    """The FFN alone at the paper's sparsity, from the kernel benchmarks' JSON (synthetic activations from
    the calibrated generator, D 2048, H 5632), beside the models trained here: ``files`` maps
    ``"inference"`` (``python -m twell.bench ffn``), ``"training"`` (``... train-ffn``) and ``"decode"``
    (``... decode``) to a result file; any may be left out. One row per measure and row count M: the
    sparse implementation's speed over dense PyTorch in that run, its device and the file."""
    import pandas as pd

    unknown = sorted(set(files) - set(FFN_MEASURES))
    if unknown:
        raise ValueError(f"unknown measure(s) {unknown}: expected some of {sorted(FFN_MEASURES)}")
    rows = []
    for measure, f in files.items():
        res = load_results([f])[0]
        device = res["meta"].get("device_name", "?")
        if measure == "decode":
            found = [(r["M"], r["impls"].get("decode-kernel", {}).get("speedup")) for r in res["rows"] if r["case"] == case]
        else:
            kind, impl = ("inference", "twell-kernel") if measure == "inference" else ("train", "twell-train-kernel")
            found = [(c["case"]["M"], c["impls"].get(impl, {}).get("speedup")) for c in res["cases"]
                     if c["case"]["kind"] == kind and c["case"]["sparsity"] == case]
        found = [(m, s) for m, s in found if s is not None]
        if not found:
            raise ValueError(f"{f}: no {measure} result for case {case!r}")
        rows += [{"measure": measure, "implementation": FFN_MEASURES[measure], "case": case, "M": m,
                  "sparse / dense": s, "device": device, "file": Path(f).name} for m, s in sorted(found)]
    return pd.DataFrame(rows)


def ffn_view(table):
    """:func:`ffn_at_paper_sparsity` for reading: a pandas Styler without index or the case column (one case),
    the speed-up to two decimals, the benchmark file named in full."""
    view = table.drop(columns=["case"]).rename(columns={"M": "M (rows)", "sparse / dense": "sparse / dense (x)",
                                                        "file": "benchmark file"})
    return view.style.hide(axis="index").format({"sparse / dense (x)": "{:.2f}"})
