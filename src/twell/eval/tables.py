"""Dense-versus-sparse downstream table (CSV + markdown) and bar chart from two :class:`EvalRun` records.

Per task and metric: both scores with lm-eval's standard errors, the difference ``other - baseline``
and its standard error ``sqrt(se_b^2 + se_o^2)``. That formula treats the two scores as
independent; they are paired (same questions), so when the models' errors correlate it overstates
the uncertainty. The mean over tasks is unweighted, over tasks scored in both runs, with standard
error ``sqrt(sum se^2) / k`` (tasks treated as independent; NaN if any task's is NaN). Skipped tasks
appear with their reason and no number.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping

import pandas as pd

from twell.eval.harness import METRICS, EvalRun
from twell.eval.tasks import TASK_SPECS, chance

HEADLINE = "headline"  # acc_norm where the task defines it, else acc (TaskSpec.headline)


def _headline_metric(run: EvalRun, task: str) -> str:
    res = run.tasks[task]
    return TASK_SPECS[task].headline if TASK_SPECS[task].headline in res.metrics else "acc"


def _paired_se(b_res, o_res, metric: str) -> float:
    """Standard error of the mean per-document difference, when both runs logged the same documents."""
    if not b_res.samples or not o_res.samples:
        return math.nan
    b = {d["doc_id"]: d[metric] for d in b_res.samples if metric in d}
    o = {d["doc_id"]: d[metric] for d in o_res.samples if metric in d}
    if set(b) != set(o) or len(b) < 2:
        return math.nan
    diffs = [o[k] - b[k] for k in sorted(b)]
    mean = sum(diffs) / len(diffs)
    return math.sqrt(sum((x - mean) ** 2 for x in diffs) / (len(diffs) - 1) / len(diffs))


def comparison_table(runs: Mapping[str, EvalRun], *, baseline: str = "dense", other: str = "sparse",
                     blocks: tuple[str, ...] = (HEADLINE, *METRICS)) -> pd.DataFrame:
    """Long table in blocks (``headline``, ``acc``, ``acc_norm``): one row per task, then a mean row.

    Columns: block, task, data (source of the task files: local, hub, fixture-data), metric, n, chance (accuracy of
    uniform guessing, 1 / answer options; None for tasks not known here), <baseline>, <baseline>_se, <other>,
    <other>_se, diff, diff_se,
    diff_se_paired, status ("ok", "mean" or "skipped"), note. Values are fractions (0-1);
    ``diff = other - baseline``. ``diff_se_paired`` (NaN unless both runs logged samples of the same
    documents) is the standard error of the mean per-document difference, which uses the pairing.
    Skipped tasks come last, once, with the reason in ``note``.
    """
    for key in (baseline, other):
        if key not in runs:
            raise KeyError(f"no run named {key!r}; have {sorted(runs)}")
    b_run, o_run = runs[baseline], runs[other]
    tasks = list(dict.fromkeys([*b_run.tasks, *o_run.tasks]))
    ok_tasks, skipped = [], []
    for task in tasks:
        pair = ((baseline, b_run.tasks.get(task)), (other, o_run.tasks.get(task)))
        if all(r is not None and r.status == "ok" for _, r in pair):
            ok_tasks.append(task)
            continue
        reasons = {n: (r.reason if r is not None else "not evaluated") for n, r in pair if r is None or r.status != "ok"}
        if len(reasons) == 2 and len(set(reasons.values())) == 1:
            note = f"both: {reasons[baseline]}"
        else:
            note = "; ".join(f"{n}: {why}" for n, why in reasons.items())
        skipped.append({"block": HEADLINE, "task": task, "status": "skipped", "note": note})
    rows = []
    for block in blocks:
        part = []
        for task in ok_tasks:
            b_res, o_res = b_run.tasks[task], o_run.tasks[task]
            metric = _headline_metric(b_run, task) if block == HEADLINE else block
            if metric not in b_res.metrics or metric not in o_res.metrics:
                continue
            (bv, bs), (ov, os_) = [(r.metrics[metric]["value"], r.metrics[metric]["stderr"]) for r in (b_res, o_res)]
            note = "" if b_res.n == o_res.n else f"different n: {baseline} {b_res.n}, {other} {o_res.n}"
            data = b_res.source if b_res.source == o_res.source else f"{b_res.source}/{o_res.source}"
            part.append({"block": block, "task": task, "data": data, "metric": metric, "n": b_res.n,
                         "chance": chance(task), baseline: bv,
                         f"{baseline}_se": bs, other: ov, f"{other}_se": os_, "diff": ov - bv,
                         "diff_se": math.hypot(bs, os_), "diff_se_paired": _paired_se(b_res, o_res, metric),
                         "status": "ok", "note": note})
        if not part:
            continue
        k = len(part)
        frame = pd.DataFrame(part)
        # skipna=False: a task without an error (no paired samples, lm-eval 'N/A') leaves the mean's error unknown;
        # skipping it would still divide by k and understate the error (all NaN would read 0.0)
        se = lambda col: math.sqrt(float((frame[col] ** 2).sum(skipna=False))) / k  # noqa: E731
        rows += part + [{"block": block, "task": f"mean ({k} tasks)", "data": ",".join(sorted(set(frame.data))),
                         "metric": block, "n": int(frame.n.sum()),
                         "chance": frame["chance"].mean() if frame["chance"].notna().all() else None,
                         baseline: frame[baseline].mean(), f"{baseline}_se": se(f"{baseline}_se"),
                         other: frame[other].mean(), f"{other}_se": se(f"{other}_se"), "diff": frame["diff"].mean(),
                         "diff_se": se("diff_se"), "diff_se_paired": se("diff_se_paired"), "status": "mean",
                         "note": "tasks: " + ", ".join(frame.task)}]
    columns = ["block", "task", "data", "metric", "n", "chance", baseline, f"{baseline}_se", other, f"{other}_se", "diff", "diff_se",
               "diff_se_paired", "status", "note"]
    table = pd.DataFrame(rows + skipped, columns=columns)
    table["n"] = table["n"].astype("Int64")  # stays integer next to the skipped rows' missing n
    return table


def _pm(value: float, se: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{100 * value:.1f} ± {100 * se:.1f}" if not math.isnan(se) else f"{100 * value:.1f}"


def _run_line(run: EvalRun) -> str:
    observed = ", ".join(f"{k} x{v}" for k, v in run.ffn_paths_observed.items()) or "no SparseFFN modules (dense MLP)"
    flag = "**FIXTURE (tiny random model, not a result)** " if run.fixture else ""
    return (f"- {flag}`{run.name}`: {run.source} via {run.loader}; FFN path requested {run.ffn_path}, ran: {observed}; "
            f"{run.device} {run.dtype}; batch {run.batch_size_note}; limit {run.limit}; "
            f"lm-eval {run.versions.get('lm_eval')}, transformers {run.versions.get('transformers')}")


def to_markdown(table: pd.DataFrame, runs: Mapping[str, EvalRun], *, baseline: str = "dense",
                other: str = "sparse") -> str:
    """Markdown version of :func:`comparison_table` (percent), with provenance and skipped tasks."""
    lines: list[str] = []
    titles = {HEADLINE: "Headline metric (acc_norm where the task defines it, else acc)", "acc": "acc",
              "acc_norm": "acc_norm"}
    paired = bool(table.loc[table.status == "ok", "diff_se_paired"].notna().any())  # per-task rows, not the means
    for block, part in table[table.status != "skipped"].groupby("block", sort=False):
        lines += [f"### {titles.get(block, block)}", "",
                  f"| task | metric | n | chance | {baseline} | {other} | {other} − {baseline} |"
                  + (" paired se |" if paired else ""),
                  "|---|---|---:|---:|---:|---:|---:|" + ("---:|" if paired else "")]
        for r in part.to_dict("records"):
            extra = "" if not paired else (" - |" if pd.isna(r["diff_se_paired"]) else f" {100 * r['diff_se_paired']:.1f} |")
            task = f"{r['task']} **[FIXTURE data]**" if "fixture" in str(r["data"]) else r["task"]
            n = int(r["n"])
            if str(r["note"]).startswith("different n"):  # the two scores are not over the same documents
                task, n = f"{task} **[{r['note']}]**", f"{n} / {int(runs[other].tasks[r['task']].n)}"
            ch = "-" if r["chance"] is None or pd.isna(r["chance"]) else f"{100 * r['chance']:.1f}"
            lines.append(f"| {task} | {r['metric']} | {n} | {ch} | {_pm(r[baseline], r[f'{baseline}_se'])} | "
                         f"{_pm(r[other], r[f'{other}_se'])} | {_pm(r['diff'], r['diff_se'])} |" + extra)
        lines.append("")
    lines += ["Accuracies in percent ± lm-eval's standard error; chance: the accuracy of guessing uniformly "
              "(1 / answer options; ARC has a few 3- and 5-option questions among its 4-option ones). The difference's standard error is "
              f"sqrt(se_{baseline}² + se_{other}²), treating the two scores as independent (they are paired on the "
              "same questions, so this is conservative when their errors correlate). Mean rows: unweighted mean over "
              "the tasks scored in both runs, standard error sqrt(Σ se²)/k (tasks treated as independent)."]
    if paired:
        lines[-1] += (" paired se: standard error of the mean per-question difference (uses the pairing; "
                      "shown where both runs logged the same questions).")
    skipped = table[table.status == "skipped"]
    if len(skipped):
        lines += ["", "Skipped (no score, not zero):"] + [f"- {r.task}: {r.note}" for r in skipped.itertuples()]
    lines += ["", "Runs:"] + [_run_line(runs[n]) for n in (baseline, other)]
    return "\n".join(lines) + "\n"


def plot_comparison(table: pd.DataFrame, path: str | Path, *, baseline: str = "dense", other: str = "sparse",
                    title: str = "Zero-shot accuracy (headline metric)") -> Path:
    """Grouped bars (headline metric per task, and the mean) with standard-error bars; saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    part = table[(table.block == HEADLINE) & (table.status != "skipped")]
    fixture = ["fixture" in d for d in part.data.astype(str)]
    labels = [t.replace("mean ", "mean\n") if s == "mean" else f"{t}{'*' if f else ''}\n{m}"
              for t, m, s, f in zip(part.task, part.metric, part.status, fixture)]
    x = np.arange(len(part))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(part) + 1.5), 4.2))
    for offset, key in ((-0.2, baseline), (0.2, other)):
        ax.bar(x + offset, 100 * part[key], width=0.4, yerr=100 * part[f"{key}_se"], capsize=3, label=key)
    ch = pd.to_numeric(part["chance"], errors="coerce").to_numpy(dtype=float)
    if np.isfinite(ch).any():  # guessing's accuracy per task: a score near it says nothing of the model
        ax.hlines(100 * ch, x - 0.45, x + 0.45, colors="k", linestyles=":", label="chance")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title)
    ax.legend()
    skipped = table[table.status == "skipped"]
    foot = (["* FIXTURE data (synthetic, not a result)"] if any(fixture) else []) + \
        (["skipped (no data): " + ", ".join(skipped.task)] if len(skipped) else [])
    if foot:
        fig.text(0.01, 0.01, ";  ".join(foot), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def write_comparison(runs: Mapping[str, EvalRun], *, baseline: str = "dense", other: str = "sparse",
                     stem: str = "downstream_eval", reports_root: str | Path | None = None,
                     include_samples: bool = False) -> dict[str, Path]:
    """Write ``tables/<stem>.csv``, ``tables/<stem>.md``, ``tables/<stem>_runs.json`` and ``figures/<stem>.png``.

    The runs JSON holds every run's provenance and metrics; per-document samples only with ``include_samples``.
    """
    from twell.paths import reports_dir

    root = Path(reports_root) if reports_root is not None else reports_dir()
    tables, figures = root / "tables", root / "figures"
    tables.mkdir(parents=True, exist_ok=True)
    table = comparison_table(runs, baseline=baseline, other=other)
    out = {"csv": tables / f"{stem}.csv", "markdown": tables / f"{stem}.md", "runs": tables / f"{stem}_runs.json"}
    table.to_csv(out["csv"], index=False)
    out["markdown"].write_text(to_markdown(table, runs, baseline=baseline, other=other))
    records = {k: v.to_dict() for k, v in runs.items()}
    if not include_samples:  # per-document values can be megabytes; the table already holds what they give
        for record in records.values():
            for task in record["tasks"].values():
                task["samples"] = None
    out["runs"].write_text(json.dumps(records, indent=2, default=str))
    fixture = any(r.fixture for r in runs.values())
    out["figure"] = plot_comparison(table, figures / f"{stem}.png", baseline=baseline, other=other,
                                    title="FIXTURE model (not a result)" if fixture else
                                    "Zero-shot accuracy (headline metric)")
    return out
