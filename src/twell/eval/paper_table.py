"""The paper's downstream table: per task the metric the paper reports, its standard error and the chance
level, then the mean over the seven tasks as the paper computes it, for one or more :class:`EvalRun` records.

The metric per task is ``TaskSpec.headline`` (:data:`twell.eval.tasks.TASK_SPECS`: acc_norm for ARC-Easy,
ARC-Challenge, HellaSwag, OpenBookQA and PIQA; acc for WinoGrande and CommonsenseQA). A run that lacks a
task's metric gets no number for it (never lm-eval's other metric in its place). The mean is the plain
mean of the per-task numbers (no weighting by questions), with standard error ``sqrt(sum se^2) / k``
(tasks treated as independent). It is the paper's mean only over all seven tasks; over fewer, the row
says so.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping

import pandas as pd

from twell.eval.harness import EvalRun, TaskResult
from twell.eval.tasks import PAPER_TASKS, TASK_SPECS, chance


def paper_metric(task: str) -> str:
    """The metric the paper reports for ``task``."""
    return TASK_SPECS[task].headline


def observed_chance(task: str, result: TaskResult | None) -> float | None:
    """Chance accuracy on the scored documents: the mean of 1 / answer options over the logged documents
    (ARC mixes 3-, 4- and 5-option questions), else 1 / the task's usual number of options."""
    if result is not None and result.samples:
        return sum(1.0 / len(d["loglikelihoods"]) for d in result.samples) / len(result.samples)
    return chance(task)


def _score(result: TaskResult | None, metric: str) -> tuple[float, float, str]:
    """(value, stderr, note) of one run's task; NaN with the reason when it has no such score."""
    if result is None:
        return math.nan, math.nan, "not evaluated"
    if result.status != "ok":
        return math.nan, math.nan, f"skipped: {result.reason}"
    if metric not in result.metrics:
        return math.nan, math.nan, f"no {metric} in the run (has {sorted(result.metrics)})"
    m = result.metrics[metric]
    return float(m["value"]), float(m["stderr"]), ""


def paper_table(runs: Mapping[str, EvalRun] | EvalRun, tasks: Iterable[str] = PAPER_TASKS) -> pd.DataFrame:
    """One row per task, in the given order, then the mean row.

    Columns: task, metric, n, chance, data (local, hub, fixture-data), then ``<run>`` and ``<run>_se`` for each
    run (fractions 0-1), status (``ok``, ``missing`` or ``mean``), note. A task any run lacks is ``missing``
    and left out of the mean, whose row then names the tasks it covers.
    """
    if isinstance(runs, EvalRun):
        runs = {runs.name: runs}
    if not runs:
        raise ValueError("paper_table needs at least one EvalRun")
    tasks = list(tasks)
    unknown = [t for t in tasks if t not in TASK_SPECS]
    if unknown:
        raise KeyError(f"tasks {unknown} are not paper tasks; expected some of {list(PAPER_TASKS)}")
    first = next(iter(runs.values()))
    rows = []
    for task in tasks:
        metric = paper_metric(task)
        row = {"task": task, "metric": metric, "n": None, "chance": observed_chance(task, first.tasks.get(task)),
               "data": "", "status": "ok", "note": ""}
        notes, sources, ns = [], set(), set()
        for name, run in runs.items():
            res = run.tasks.get(task)
            value, se, note = _score(res, metric)
            row[name], row[f"{name}_se"] = value, se
            if note:
                notes.append(f"{name}: {note}")
            elif res is not None:
                sources.add(res.source)
                ns.add(res.n)
        if notes:
            row["status"], row["note"] = "missing", "; ".join(notes)
        if len(ns) > 1:
            row["note"] = "; ".join(filter(None, [row["note"], f"different n per run: {sorted(ns)}"]))
        row["n"] = min(ns) if ns else None
        row["data"] = "/".join(sorted(sources))
        rows.append(row)
    scored = [r for r in rows if r["status"] == "ok"]
    k = len(scored)
    if k:
        label = f"mean ({k} tasks)" if k == len(PAPER_TASKS) == len(tasks) else \
            f"mean ({k} of {len(PAPER_TASKS)} tasks; not the paper's mean)"
        mean = {"task": label, "metric": "mean", "n": sum(int(r["n"] or 0) for r in scored),
                "chance": (sum(r["chance"] for r in scored) / k if all(r["chance"] is not None for r in scored)
                           else None),
                "data": ",".join(sorted({r["data"] for r in scored})), "status": "mean",
                "note": "plain mean over " + ", ".join(r["task"] for r in scored)}
        for name in runs:
            mean[name] = sum(r[name] for r in scored) / k
            mean[f"{name}_se"] = math.sqrt(sum(r[f"{name}_se"] ** 2 for r in scored)) / k
        rows.append(mean)
    columns = ["task", "metric", "n", "chance", "data", *[c for n in runs for c in (n, f"{n}_se")], "status", "note"]
    table = pd.DataFrame(rows, columns=columns)
    table["n"] = table["n"].astype("Int64")
    return table


def _pct(value: float, se: float | None = None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if se is None or math.isnan(se):
        return f"{100 * value:.1f}"
    return f"{100 * value:.1f} ± {100 * se:.1f}"


def paper_markdown(table: pd.DataFrame, runs: Iterable[str] | None = None) -> str:
    """Markdown of :func:`paper_table` (percent ± standard error), FIXTURE rows and missing tasks marked."""
    names = list(runs) if runs is not None else [c for c in table.columns
                                                 if f"{c}_se" in table.columns and not c.endswith("_se")]
    lines = ["| task | metric | n | chance | " + " | ".join(names) + " |",
             "|---|---|---:|---:|" + "---:|" * len(names)]
    for r in table.to_dict("records"):
        task = f"**{r['task']}**" if r["status"] == "mean" else r["task"]
        if "fixture" in str(r["data"]):
            task += " **[FIXTURE data]**"
        n = "-" if pd.isna(r["n"]) else str(int(r["n"]))
        ch = "-" if r["chance"] is None or pd.isna(r["chance"]) else f"{100 * r['chance']:.1f}"
        cells = [_pct(r[name], r[f"{name}_se"]) for name in names]
        lines.append(f"| {task} | {r['metric']} | {n} | {ch} | " + " | ".join(cells) + " |")
    lines += ["", "Accuracy in percent ± lm-eval's standard error, in the metric the paper reports per task "
              "(acc_norm: length-normalised). chance: the accuracy of guessing uniformly among each question's "
              "options. Mean: the plain mean over the tasks, as the paper averages them, standard error "
              "sqrt(Σ se²)/k."]
    missing = table[table.status == "missing"]
    if len(missing):
        lines += ["", "No score (left out of the mean):"] + [f"- {r.task}: {r.note}" for r in missing.itertuples()]
    return "\n".join(lines) + "\n"
