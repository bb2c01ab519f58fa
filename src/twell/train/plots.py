"""Figures and tables of training runs, read from their metrics JSONL (notebook 02 calls these).

Every function takes ``runs``: a mapping ``label -> metrics.jsonl path`` (or already-read
records from :func:`twell.train.read_metrics`) and returns a matplotlib Figure or a DataFrame.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import numpy as np

from twell.train.metrics import read_metrics

Runs = Mapping[str, "str | Path | dict"]


def _records(runs: Runs) -> dict[str, dict[str, list[dict]]]:
    if not runs:
        raise ValueError("expected at least one run: a mapping label -> metrics.jsonl path")
    return {label: (src if isinstance(src, dict) else read_metrics(src)) for label, src in runs.items()}


def _finish(fig, title: str | None):
    """Common end of every figure here: optional super-title (the data note), tight layout."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` records (fewer at the start)."""
    if window <= 1 or len(y) < window:
        return y
    kernel = np.ones(window) / window
    head = np.cumsum(y[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(y, kernel, mode="valid")])


def _smoothed(steps: np.ndarray, y: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of a moving mean over ``window`` logged records, each mean drawn at the mean step of its
    window: a trailing mean drawn at the window's last step would show every change late."""
    return _smooth(steps.astype(float), window), _smooth(y, window)


def _window_text(runs: dict[str, dict[str, list[dict]]], window: int) -> str:
    """How many steps ``window`` logged records span (records are logged every log_every steps)."""
    gaps = [int(np.median(np.diff([r["step"] for r in recs["train"]])))
            for recs in runs.values() if len(recs.get("train", [])) > 1]
    if window <= 1:
        return "not smoothed"
    if not gaps or min(gaps) == max(gaps) == 1:
        return f"moving mean, {window} steps"
    span = f"{window * gaps[0]}" if min(gaps) == max(gaps) else f"{window * min(gaps)}-{window * max(gaps)}"
    return f"moving mean, {window} records = {span} steps"


def plot_loss(runs: Runs, smooth: int = 20, title: str | None = None):
    """Training CE (smoothed) and validation CE against step, one colour per run."""
    import matplotlib.pyplot as plt

    data = _records(runs)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, (label, recs) in enumerate(data.items()):
        c = f"C{i}"
        tr = recs.get("train", [])
        if tr:
            x, y = _smoothed(np.array([r["step"] for r in tr]), np.array([r["ce"] for r in tr]), smooth)
            axes[0].plot(x, y, color=c, label=label)
        va = recs.get("val", [])
        if va:
            axes[1].plot([r["step"] for r in va], [r["val_ce"] for r in va], "o-", color=c, ms=3, label=label)
    axes[0].set(xlabel="step", ylabel=f"train cross-entropy\n({_window_text(data, smooth)})")
    axes[1].set(xlabel="step", ylabel="validation cross-entropy\n(held-out documents)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _finish(fig, title)


def _layer_panels(runs: Runs, key: str, height: float):
    """One panel per run (shared y axis) for a per-layer training series: (fig, axes, panels), where
    panels holds (axis, label, steps, values [steps, layers]) of every run that logged training records."""
    import matplotlib.pyplot as plt

    data = _records(runs)
    fig, axes = plt.subplots(1, len(data), figsize=(5.5 * len(data), height), squeeze=False, sharey=True)
    panels = []
    for ax, (label, recs) in zip(axes[0], data.items()):
        tr = recs.get("train", [])
        if tr:
            panels.append((ax, label, np.array([r["step"] for r in tr]), np.array([r[key] for r in tr])))
    return fig, axes, panels


def plot_active(runs: Runs, widths: Mapping[str, int] | None = None, title: str | None = None, smooth: int = 10):
    """Active neurons per token (% of the FFN width when ``widths`` gives it), per layer, against step
    (moving mean over ``smooth`` logged records, drawn at the mean step of each window)."""
    data = _records(runs)  # read once: the panels and the window's label both need it
    fig, axes, panels = _layer_panels(data, "active_mean", 3.8)
    window = _window_text(data, smooth)
    for ax, label, s, act in panels:
        scale = 100.0 / widths[label] if widths and label in widths else 1.0
        for layer in range(act.shape[1]):
            x, y = _smoothed(s, act[:, layer], smooth)
            ax.plot(x, y * scale, lw=1, label=f"layer {layer}")
        x, y = _smoothed(s, act.mean(1), smooth)
        ax.plot(x, y * scale, "k--", lw=1.5, label="mean")
        ax.set(title=label, xlabel="step", yscale="log",
               ylabel="active neurons per token" + (" (% of width)" if scale != 1.0 else "") + f"\n({window})")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7, ncol=2)
    return _finish(fig, title)


def plot_dead(runs: Runs, title: str | None = None):
    """Fraction of dead neurons (silent for the tracker's window) per layer against step."""
    fig, axes, panels = _layer_panels(runs, "dead_frac", 3.5)
    for ax, label, s, dead in panels:
        for layer in range(dead.shape[1]):
            ax.plot(s, 100 * dead[:, layer], lw=1, label=f"layer {layer}")
        ax.set(title=label, xlabel="step", ylabel="dead neurons (% of width)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    return _finish(fig, title)


def plot_throughput(runs: Runs, smooth: int = 10, title: str | None = None):
    """Training throughput (tokens/s and peak GPU memory, where recorded) next to the active fraction,
    against step: the sparse training kernels take over a layer as its activity falls (the dotted lines
    mark the steps where a run changed a layer's route: its ``ffn-routes`` events)."""
    import matplotlib.pyplot as plt

    recs = _records(runs)
    has_mem = any("peak_mem_mb" in r for v in recs.values() for r in v.get("train", []))
    fig, axes = plt.subplots(1, 3 if has_mem else 2, figsize=(13 if has_mem else 9, 3.6))
    for label, v in recs.items():
        tr = [r for r in v.get("train", []) if "tok_s" in r]
        if not tr:
            continue
        steps = np.array([r["step"] for r in tr])
        color = axes[0].plot(*_smoothed(steps, np.array([r["tok_s"] for r in tr], float), smooth), lw=1.2,
                             label=label)[0].get_color()
        axes[1].plot(steps, 100 * np.array([r["active_frac"] for r in tr]), lw=1, color=color, label=label)
        if has_mem:
            axes[2].plot(steps, [r.get("peak_mem_mb", np.nan) for r in tr], lw=1, color=color, label=label)
        for ev in v.get("event", []):
            if ev.get("event") == "ffn-routes":
                for ax in axes:
                    ax.axvline(ev["step"], color=color, ls=":", lw=0.8, alpha=0.7)
    axes[0].set(xlabel="step", ylabel="tokens / s", title=f"training throughput ({_window_text(recs, smooth)})")
    axes[1].set(xlabel="step", ylabel="% of width", yscale="log", title="active neurons (mean over layers)")
    if has_mem:
        axes[2].set(xlabel="step", ylabel="MB", title="peak GPU memory between records")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _finish(fig, title)


def l1_sweep_table(summaries: Mapping[str, "str | Path | dict"]):
    """One row per run of an L1 sweep (``label -> summary.json``): coefficient, final active fraction, dead
    fraction, validation CE and its change against the L1 = 0 run (``NaN`` without one)."""
    import pandas as pd

    rows = []
    for label, summ in summaries.items():
        if not isinstance(summ, dict):
            summ = json.loads(Path(summ).read_text())
        f = summ["final"]
        rows.append({"run": label, "L1 coef": float(summ["l1_coef"]), "steps": summ["steps_done"],
                     "active %": 100 * f["active_frac_mean"] if f.get("active_frac_mean") is not None else np.nan,
                     "dead %": 100 * float(np.mean(f["dead_frac_per_layer"])) if f.get("dead_frac_per_layer") else np.nan,
                     "val CE": f.get("val_ce", np.nan)})
    table = pd.DataFrame(rows).sort_values("L1 coef").reset_index(drop=True)
    dense = table[table["L1 coef"] == 0]
    base = float(dense["val CE"].iloc[0]) if len(dense) else np.nan
    table["val CE vs L1 0 (%)"] = 100 * (table["val CE"] / base - 1)
    return table


def plot_l1_sweep(table, title: str | None = None, claim: tuple[float, float] = (3e-5, 2.0)):
    """The paper's sweep figure from :func:`l1_sweep_table`: active fraction, validation CE against the
    L1 = 0 run, and dead fraction, each against the coefficient (L1 = 0 drawn at the left edge). The
    paper's claim, CE within about ``claim[1]``% of dense up to ``claim[0]``, is drawn on the CE panel."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    coefs = table["L1 coef"].to_numpy(float)
    pos = coefs[coefs > 0]
    zero_x = pos.min() / 3 if len(pos) else 1e-6  # where L1 = 0 sits on the log axis
    x = np.where(coefs > 0, coefs, zero_x)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, col, name in ((axes[0], "active %", "active neurons (% of width)"),
                          (axes[1], "val CE vs L1 0 (%)", "validation CE against L1 = 0 (%)"),
                          (axes[2], "dead %", "dead neurons (% of width)")):
        ax.plot(x, table[col], "o-")
        ax.set(xscale="log", xlabel="L1 coefficient (leftmost point: 0)", ylabel=name, title=name)
        # ticks at the swept coefficients (labelled "0" for the L1 = 0 run): the log axis's own minor labels
        # of a decade this short overlap
        ax.set_xticks(x, ["0" if c == 0 else f"{c:g}" for c in coefs], fontsize=7)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].axhspan(-claim[1], claim[1], color="tab:green", alpha=0.12,
                    label=f"paper: within ~{claim[1]:g}% of dense up to {claim[0]:g}")
    if len(pos) and pos.min() <= claim[0] <= pos.max():  # the claim's range end, where the sweep covers it
        axes[1].axvline(claim[0], color="tab:green", ls=":", lw=1)
    axes[1].legend(fontsize=7)
    return _finish(fig, title)


def plot_kernel_bench(table, title: str | None = None):
    """Bars of :func:`twell.train.study.training_kernel_bench`'s table: speed-up of the training FFN
    over dense per case, and peak memory above inputs, dense against sparse."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    names = [str(c).replace("train M=16384 ", "") for c in table["case"]]
    x = np.arange(len(names))
    a.bar(x, table["speed-up"], color="tab:green")
    a.axhline(1.0, color="k", lw=0.8)
    a.set(xticks=x, xticklabels=names, ylabel="dense time / sparse time", title="forward + backward + L1")
    b.bar(x - 0.2, table["dense peak MB"], 0.4, label="dense")
    b.bar(x + 0.2, table["sparse peak MB"], 0.4, label="sparse kernels")
    b.set(xticks=x, xticklabels=names, ylabel="MB", title="peak memory above inputs and weights")
    b.legend(fontsize=7, loc="center right")
    for ax in (a, b):
        ax.grid(alpha=0.3, axis="y")
    return _finish(fig, title)


def plot_positions(runs: Runs, title: str | None = None):
    """Active neurons per token by position in the sequence (the last ``positions`` record of each run)."""
    import matplotlib.pyplot as plt

    data = _records(runs)
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, (label, recs) in enumerate(data.items()):
        pos = recs.get("positions", [])
        if not pos:
            continue
        last = pos[-1]
        edges = np.array(last["edges"])
        centers = (edges[:-1] + edges[1:] - 1) / 2
        act = np.array(last["active"])  # [L, bins]
        ax.plot(centers, act.mean(0), "o-", ms=3, color=f"C{i}", label=f"{label} (mean over layers, step {last['step']})")
        ax.fill_between(centers, act.min(0), act.max(0), color=f"C{i}", alpha=0.15)
    ax.set(xlabel="token position", ylabel="active neurons per token", yscale="log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _finish(fig, title)


def summary_table(runs: Runs, summaries: Mapping[str, "str | Path | dict"] | None = None):
    """One row per run: steps, epochs, final/best validation CE, active neurons, dead fraction, throughput."""
    import pandas as pd

    data = _records(runs)
    rows = []
    for label, recs in data.items():
        tr, va = recs.get("train", []), recs.get("val", [])
        summ = None
        if summaries and label in summaries:
            summ = summaries[label]
            if not isinstance(summ, dict):
                summ = json.loads(Path(summ).read_text())
        tail = tr[-max(1, min(50, len(tr) // 10)):] if tr else []
        act = float(np.mean([np.mean(r["active_mean"]) for r in tail])) if tail else float("nan")
        row = {
            "run": label,
            "steps": tr[-1]["step"] if tr else 0,
            "epochs": tr[-1].get("epoch") if tr else None,
            "train CE (tail mean)": float(np.mean([r["ce"] for r in tail])) if tail else float("nan"),
            "val CE (final)": va[-1]["val_ce"] if va else float("nan"),
            "val CE (best)": min(r["val_ce"] for r in va) if va else float("nan"),
            "active / token": act,
            "dead % (mean over layers)": 100 * float(np.mean(tr[-1]["dead_frac"])) if tr else float("nan"),
            "tokens/s": float(np.median([r["tok_s"] for r in tr])) if tr else float("nan"),
        }
        if summ is not None:
            H = summ["config"]["model"]["intermediate_size"]
            row["active %"] = 100 * act / H
            row["L1 coef"] = summ.get("l1_coef")
            row["data"] = summ["data"]["label"]
        rows.append(row)
    return pd.DataFrame(rows)


def _activity_models(result: "str | Path | dict") -> dict:
    """The ``models`` of a ``python -m twell.bench activity`` result (a JSON path or the dict)."""
    res = result if isinstance(result, dict) else json.loads(Path(result).read_text())
    if "models" not in res or not res["models"]:
        raise ValueError("expected the JSON of `python -m twell.bench activity` (a 'models' mapping)")
    return res["models"]


def activity_table(result: "str | Path | dict"):
    """One row per layer and model of a ``python -m twell.bench activity`` result: active neurons per token
    (mean, % of H, median, p99), dead neurons (active on none of the tokens) and the first-bin / later ratio
    of the position profile (how much more active the first tokens are)."""
    import pandas as pd

    rows = []
    for name, m in _activity_models(result).items():
        q = m["active_quantiles_per_layer"]
        for layer, mean in enumerate(m["active_mean_per_layer"]):
            bins = m["positions"]["active"][layer]
            later = float(np.mean(bins[1:])) if len(bins) > 1 else float("nan")
            rows.append({"model": name, "layer": layer, "active / token": mean,
                         "active %": 100 * m["active_frac_per_layer"][layer], "p50": q["p50"][layer],
                         "p99": q["p99"][layer], "dead %": 100 * m["dead_frac_per_layer"][layer],
                         "first bin / later bins": bins[0] / later if later else float("nan")})
    return pd.DataFrame(rows)


def activity_by_depth(results: "dict[str, str | Path | dict]"):
    """``(figure, table)`` of several ``python -m twell.bench activity`` results (label -> JSON path or dict,
    e.g. one per model scale): active neurons per token by relative depth (layer / (layers - 1)), each
    result's sparse model solid and its dense twin dashed (log scale); the table gives per model its
    layers, mean, first-layer, last-layer and least active layer's share of H."""
    import matplotlib.pyplot as plt
    import pandas as pd

    if not results:
        raise ValueError("activity_by_depth needs at least one activity result")
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    rows = []
    for i, (label, result) in enumerate(results.items()):
        for name, m in _activity_models(result).items():
            frac = 100 * np.asarray(m["active_frac_per_layer"], dtype=float)
            depth = np.arange(len(frac)) / max(1, len(frac) - 1)
            dense = name == "dense"
            ax.plot(depth, frac, "o--" if dense else "o-", ms=3, lw=1, color=f"C{i}", alpha=0.6 if dense else 1.0,
                    label=f"{label} {name} ({len(frac)} layers, mean {100 * m['active_frac_mean']:.2f}%)")
            rows.append({"result": label, "model": name, "layers": len(frac),
                         "mean active %": 100 * m["active_frac_mean"], "first layer %": frac[0],
                         "last layer %": frac[-1], "least active layer": int(frac.argmin()),
                         "least active %": float(frac.min()), "tokens": m["tokens"]})
    ax.set(xlabel="relative depth (layer / (layers - 1))", ylabel="active neurons per token (% of H)",
           yscale="log", title="activity by depth")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)
    return _finish(fig, None), pd.DataFrame(rows)


def plot_checkpoint_activity(result: "str | Path | dict", title: str | None = None):
    """A checkpoint's activity on held-out tokens (``python -m twell.bench activity``): active neurons per
    token by layer (each model), and by token position for every layer of each model (log scale)."""
    import matplotlib.pyplot as plt

    models = _activity_models(result)
    fig, axes = plt.subplots(1, 1 + len(models), figsize=(4.2 * (1 + len(models)), 3.8))
    ax = axes[0]
    width = 0.8 / len(models)
    for i, (name, m) in enumerate(models.items()):
        layers = np.arange(len(m["active_frac_per_layer"]))
        ax.bar(layers + (i - (len(models) - 1) / 2) * width, 100 * np.array(m["active_frac_per_layer"]), width,
               label=f"{name} (mean {100 * m['active_frac_mean']:.2f}%)", color=f"C{i}")
    ax.set(xlabel="layer", ylabel="active neurons per token (% of H)", yscale="log", title="by layer")
    ax.set_xticks(np.arange(max(len(m["active_frac_per_layer"]) for m in models.values())))
    ax.grid(alpha=0.3, which="both", axis="y")
    ax.legend(fontsize=8)
    for ax, (name, m) in zip(axes[1:], models.items()):
        edges = np.array(m["positions"]["edges"])
        centers = (edges[:-1] + edges[1:] - 1) / 2
        for layer, act in enumerate(m["positions"]["active"]):
            ax.plot(centers, act, "o-", ms=2, lw=1, color=plt.cm.viridis(layer / max(1, len(m["positions"]["active"]) - 1)),
                    label=f"layer {layer}")
        ax.set(xlabel="token position", ylabel="active neurons per token", yscale="log",
               title=f"{name}: by position ({m['tokens']} tokens)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6, ncol=2)
    return _finish(fig, title)
