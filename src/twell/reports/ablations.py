"""Notebook 02's ablations (the FFN's gate and activation) and the activity profile of a trained pair, each
beside what the paper reports.

The ablation table reads finished runs (``summary.json`` of ``python -m twell.train``) and, per run, the
``python -m twell.bench model`` JSON that timed it: prefill throughput of the model on its sparse path over
its dense path (the same weights), or, for a model benchmarked against a dense twin, over that twin.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from twell.paths import repo_root

FFN_KINDS = {"relu_gated": "ReLU-gated", "silu_gated": "SiLU-gated (Llama)", "relu": "ReLU, non-gated"}

# What the paper reports for each ablation (its 1.5B setting), keyed by (FFN kind, trained with L1).
PAPER_ABLATIONS = {
    ("relu_gated", True): "46.4% mean downstream (the recipe; SiLU's 47.1% beside it)",
    ("silu_gated", False): "47.1% mean downstream; all 5632 neurons active; slightly slower than ReLU",
    ("relu", True): "+11.2% inference speed-up",
}


def _read_json(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_absolute() and not p.exists():
        p = repo_root() / p
    return json.loads(p.read_text())


def _summary(run: str | Path) -> dict:
    p = Path(run)
    return _read_json(p if p.name == "summary.json" else p / "summary.json")


def _checkpoint_name(path: str) -> str:
    """``.../runs/small_books_dense/final`` -> ``small_books_dense``."""
    p = Path(path)
    return p.parent.name if p.name == "final" else p.name


def prefill_ratios(bench: str | Path | dict) -> tuple[dict[int, float], str]:
    """``({batch: sparse tokens/ms over dense}, what the dense side was)`` from a ``python -m twell.bench
    model`` JSON: its prefill rows, and what over what (the model's sparse path over its dense path, or the
    model over the dense twin it was benchmarked against)."""
    res = bench if isinstance(bench, dict) else _read_json(bench)
    ratios = {int(r["batch"]): r["sparse"]["tokens_per_ms"] / r["dense"]["tokens_per_ms"]
              for r in res["rows"] if r["measure"] == "prefill"}
    twin = res["meta"]["config"].get("dense_checkpoint")
    return ratios, ("sparse path / its dense path" if not twin else f"this model / {_checkpoint_name(twin)}")


def ablation_table(runs: Mapping[str, str | Path], bench: Mapping[str, str | Path] | None = None):
    """One row per run (label -> run directory or its summary.json): FFN kind, L1 coefficient, tokens seen,
    validation CE, active neurons in % of the FFN width at the end of training (the tracker's tail) and on
    the held-out tokens, dead neurons (mean over layers, % of the width), prefill throughput ratio per
    benchmarked batch and what it divides (``bench``: label -> model benchmark JSON; runs without one get
    None) and the
    paper's finding for that kind of FFN (empty where the paper has none)."""
    import pandas as pd

    bench = dict(bench or {})
    unknown = sorted(set(bench) - set(runs))
    if unknown:
        raise KeyError(f"bench results for {unknown} name no run; runs are {sorted(runs)}")
    ratios = {k: prefill_ratios(v) for k, v in bench.items()}
    batches = sorted({b for r, _ in ratios.values() for b in r})
    rows = []
    for label, run in runs.items():
        s = _summary(run)
        cfg, fin = s["config"], s["final"]
        ffn, l1 = cfg["model"]["ffn"], float(cfg["sparsity"]["l1_coef"])
        dead = fin["dead_frac_per_layer"]
        row = {"model": label, "FFN": FFN_KINDS.get(ffn, ffn), "L1": l1,
               "tokens (M)": s["steps_done"] * s["tokens_per_step"] / 1e6, "val CE": fin["val_ce"],
               "active % (train end)": 100 * fin["active_frac_mean"],
               "active % (held out)": None if fin.get("val_active_frac") is None else 100 * fin["val_active_frac"],
               "dead % (train end)": 100 * sum(dead) / len(dead)}
        r, against = ratios.get(label, ({}, None))
        for b in batches:
            row[f"prefill ratio, batch {b}"] = r.get(b)
        row["ratio of"] = against
        row["paper"] = PAPER_ABLATIONS.get((ffn, l1 > 0), "")
        rows.append(row)
    return pd.DataFrame(rows)


def _layer_pct(model: dict) -> list[float]:
    return [100 * f for f in model["active_frac_per_layer"]]


def activity_profile_note(result: str | Path | dict) -> str:
    """What a ``python -m twell.bench activity`` result shows per layer against the paper's profile (early
    layers least active), one sentence per model: the two most and the least active layers (% of the FFN
    width) and where they sit; then the first position bin against the later ones. Says only what the
    numbers show."""
    res = result if isinstance(result, dict) else _read_json(result)
    out = []
    for name, m in res["models"].items():
        pct = _layer_pct(m)
        n = len(pct)
        order = sorted(range(n), key=lambda i: pct[i])
        top = sorted(order[-2:])
        least = order[0]
        if n > 2 and set(top) == {0, n - 1}:
            where = "the first and last layers are the most active"
        else:
            where = f"the most active layers are {top[0]} and {top[1]}"
        early = least < n / 3
        verdict = ("as in the paper, the least active layer is in the first third" if early else
                   "the paper's least active layers are early ones; here the least active is not in the first third")
        bins = m["positions"]["active"]
        first = [b[0] / (sum(b[1:]) / (len(b) - 1)) for b in bins if len(b) > 1 and sum(b[1:]) > 0]
        pos = (f"; the first {m['positions']['edges'][1]} positions hold {min(first):.1f}-{max(first):.1f}x "
               "the later positions' active neurons per token" if first else "")
        out.append(f"{name}: {where} (layer {top[0]} {pct[top[0]]:.2f}%, layer {top[1]} {pct[top[1]]:.2f}% of the "
                   f"width), the least active is layer {least} of {n} ({pct[least]:.2f}%): {verdict}{pos}")
    return ". ".join(out) + "."
