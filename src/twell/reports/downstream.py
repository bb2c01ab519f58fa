"""Notebook 03's key table: per task the metric the paper reports (:func:`twell.eval.paper_table.paper_table`),
both models' scores with standard errors, chance, the mean over tasks, and the dense-to-sparse gap with its
standard error, the paper's own mean and gap beside the mean row; and which scores are at chance.
"""
from __future__ import annotations

import math
from typing import Mapping

# The paper's mean over its seven tasks at 2B (percent): dense, then the L1-sparse model.
PAPER_DOWNSTREAM = {"scale": "2B", "dense": 49.1, "sparse": 48.8}


def key_table(runs: Mapping, *, baseline: str = "dense", other: str = "sparse"):
    """One row per task, then the mean row; percent. Columns: task, metric, n, chance %, ``<baseline> %``,
    ``<baseline> se``, ``<other> %``, ``<other> se``, ``gap (pts)`` (other - baseline), ``gap se``
    (``sqrt(se_b^2 + se_o^2)``: the two scores treated as independent), then the paper's 2B dense, sparse and
    gap, on the mean row only (NaN elsewhere: the paper's per-task numbers are not transcribed here)."""
    import pandas as pd

    from twell.eval.paper_table import paper_table

    for key in (baseline, other):
        if key not in runs:
            raise KeyError(f"no run named {key!r}; have {sorted(runs)}")
    t = paper_table({baseline: runs[baseline], other: runs[other]})
    t = t[t.status != "missing"]
    pct = lambda col: 100 * t[col].astype(float)  # noqa: E731
    out = pd.DataFrame({"task": t["task"], "metric": t["metric"], "n": t["n"], "chance %": pct("chance"),
                        f"{baseline} %": pct(baseline), f"{baseline} se": pct(f"{baseline}_se"),
                        f"{other} %": pct(other), f"{other} se": pct(f"{other}_se")})
    out["gap (pts)"] = out[f"{other} %"] - out[f"{baseline} %"]
    out["gap se"] = [math.hypot(a, b) for a, b in zip(out[f"{baseline} se"], out[f"{other} se"])]
    mean = (t.status == "mean").to_numpy()
    scale = PAPER_DOWNSTREAM["scale"]
    for col, value in ((f"paper {scale} {baseline} %", PAPER_DOWNSTREAM["dense"]),
                       (f"paper {scale} {other} %", PAPER_DOWNSTREAM["sparse"]),
                       (f"paper {scale} gap (pts)", PAPER_DOWNSTREAM["sparse"] - PAPER_DOWNSTREAM["dense"])):
        out[col] = [round(value, 6) if m else math.nan for m in mean]
    return out.reset_index(drop=True)


def at_chance(table, run: str, z: float = 2.0) -> list[str]:
    """The tasks of :func:`key_table` where ``run`` scores within ``z`` standard errors of chance."""
    rows = table[~table.task.str.startswith("mean")].to_dict("records")
    return [r["task"] for r in rows if abs(r[f"{run} %"] - r["chance %"]) <= z * r[f"{run} se"]]


def chance_note(table, runs=("dense", "sparse"), z: float = 2.0) -> str:
    """One sentence per run: on how many of the tasks it is within ``z`` standard errors of chance."""
    n = int((~table.task.str.startswith("mean")).sum())
    parts = []
    for run in runs:
        near = at_chance(table, run, z)
        parts.append(f"{run}: within {z:g} standard errors of chance on {len(near)} of {n} tasks"
                     + ("" if len(near) in (0, n) else f" ({', '.join(near)})"))
    return "; ".join(parts) + "."
