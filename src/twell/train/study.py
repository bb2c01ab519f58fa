"""What notebook 02 does, as plain functions: train a config and its dense twin, collect finished runs,
copy their metrics into reports/, and write the figures and the table.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Mapping

from twell.paths import repo_root
from twell.train.loop import RunResult, run

# Where notebook 02 trains (notebook 03's cpu-smoke checkpoints point here).
NOTEBOOK_RUNS = repo_root() / "runs" / "notebook02"


def _common_overrides(device: str, steps: int | None, extra: list[str] | None) -> list[str]:
    """The overrides every run of one notebook-02 set shares: device, steps, and the caller's own."""
    return [f"train.device={device}"] + ([f"train.steps={int(steps)}"] if steps else []) + list(extra or [])


def train_with_twin(config: str, *, steps: int | None = None, l1_coef: float | None = None,
                    data_path: str | None = None, device: str = "auto", dense_twin: bool = True,
                    out_root: str | Path | None = None, extra: list[str] | None = None) -> dict[str, RunResult]:
    """Train ``config`` (and, with ``dense_twin``, the same run with L1 = 0); return ``label -> RunResult``.

    Labels are ``"<config> (L1 <coef>)"`` and ``"<config> (L1 0, dense)"``. Runs go to
    ``<out_root>/<config>`` and ``<out_root>/<config>_dense_twin``, replacing what is there (default
    out_root: runs/notebook02/, apart from runs/<config>, the CLI's default, so the notebook never
    deletes a run made by hand).
    """
    out_root = Path(out_root) if out_root is not None else NOTEBOOK_RUNS
    common = _common_overrides(device, steps, extra)
    sparse_over = common + ([f"sparsity.l1_coef={float(l1_coef)!r}"] if l1_coef is not None else [])
    results: dict[str, RunResult] = {}
    res = run(config, data=data_path, out=out_root / config, overwrite=True, overrides=sparse_over)
    results[f"{config} (L1 {res.summary['l1_coef']:g})"] = res
    if dense_twin:
        res_d = run(config, data=data_path, out=out_root / f"{config}_dense_twin", overwrite=True,
                    overrides=common + ["sparsity.l1_coef=0.0"])
        results[f"{config} (L1 0, dense)"] = res_d
    return results


def train_variants(config: str, variants: Mapping[str, list[str]], *, steps: int | None = None,
                   data_path: str | None = None, device: str = "auto", out_root: str | Path | None = None,
                   extra: list[str] | None = None) -> dict[str, RunResult]:
    """Train ``config`` once per variant (``label -> overrides``, e.g. ``{"L1 1e-5": ["sparsity.l1_coef=1e-5"]}``),
    with the same steps, data and seed; runs go to ``<out_root>/<config>_<label slug>`` (default out_root:
    runs/notebook02/), replacing what is there. The L1 sweep and the re-initialisation ablation of notebook
    02 are two such sets."""
    out_root = Path(out_root) if out_root is not None else NOTEBOOK_RUNS
    common = _common_overrides(device, steps, extra)
    results: dict[str, RunResult] = {}
    for label, overrides in variants.items():
        slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in label).strip("_")
        results[label] = run(config, data=data_path, out=out_root / f"{config}_{slug}", overwrite=True,
                             overrides=common + list(overrides))
    return results


def l1_sweep_variants(coefs) -> dict[str, list[str]]:
    """Variants of :func:`train_variants` for an L1 sweep: one per coefficient (0: the dense twin)."""
    return {f"L1 {float(c):g}": [f"sparsity.l1_coef={float(c)!r}"] for c in coefs}


def reinit_variants(every: int | None = None) -> dict[str, list[str]]:
    """The re-initialisation ablation: the same recipe with and without re-drawing dead gate rows."""
    on = ["sparsity.reinit_dead=true"] + ([f"sparsity.reinit_every={int(every)}"] if every else [])
    return {"no re-init": ["sparsity.reinit_dead=false"], "re-init dead": on}


def resolve_runs(runs: Mapping[str, str | Path]) -> dict[str, tuple[Path, Path | None]]:
    """``label -> (metrics.jsonl, summary.json or None)`` for finished runs given by metrics path or run directory.

    Relative paths are taken from the repository root. Missing files raise, naming what to run.
    """
    out = {}
    for label, p in runs.items():
        path = Path(p).expanduser()
        if not path.is_absolute():
            path = repo_root() / path
        metrics = path / "metrics.jsonl" if path.is_dir() else path
        if not metrics.is_file():
            raise FileNotFoundError(
                f"run {label!r}: no metrics at {metrics}. For GPU runs: run scripts/train_small_gpu.sh on the GPU "
                "machine and copy its $OUT/<run>/metrics.jsonl and summary.json there"
            )
        summary = metrics.with_name("summary.json")
        out[label] = (metrics, summary if summary.is_file() else None)
    return out


def publish_run_files(runs: Mapping[str, tuple[Path, Path | None]], reports_dir: str | Path | None = None,
                      prefix: str = "02") -> list[Path]:
    """Copy each run's metrics.jsonl (+ summary.json) to ``<reports>/runs/<prefix>_<label slug>/``.

    Runs whose files already lie under the reports folder (e.g. reports/runs/small) are not copied again."""
    from twell.paths import reports_dir as default_reports

    root = Path(reports_dir) if reports_dir is not None else default_reports()
    written = []
    for label, (metrics, summary) in runs.items():
        if metrics.resolve().is_relative_to(root.resolve()):
            continue
        slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in label).strip("_")
        d = root / "runs" / f"{prefix}_{slug}"
        d.mkdir(parents=True, exist_ok=True)
        for src in (metrics, summary):
            if src is not None and src.resolve() != (d / src.name).resolve():
                shutil.copyfile(src, d / src.name)
                written.append(d / src.name)
    return written


def figures_and_table(runs: Mapping[str, tuple[Path, Path | None]], reports_dir: str | Path | None = None,
                      prefix: str = "02", note: str = ""):
    """Draw and save notebook 02's four figures and its summary table.

    Returns ``(figures, table, paths)``: name -> Figure (left open so a notebook shows them), the
    summary DataFrame, and name -> written files (``<reports>/figures/<prefix>_<name>.png``,
    ``<reports>/tables/<prefix>_summary.csv/.md``).
    """
    import json

    from twell.reports import save_figure, save_table
    from twell.train import plots

    metrics = {k: m for k, (m, _) in runs.items()}
    summaries = {k: s for k, (_, s) in runs.items() if s is not None}
    widths = {k: json.loads(Path(s).read_text())["config"]["model"]["intermediate_size"] for k, s in summaries.items()}
    figs = {
        "loss": plots.plot_loss(metrics, title=note or None),
        "active_per_layer": plots.plot_active(metrics, widths=widths, title=note or None),
        "dead_fraction": plots.plot_dead(metrics, title=note or None),
        "active_by_position": plots.plot_positions(metrics, title=note or None),
        "throughput": plots.plot_throughput(metrics, title=note or None),
    }
    paths = {name: list(save_figure(fig, f"{prefix}_{name}", reports_dir)) for name, fig in figs.items()}
    table = plots.summary_table(metrics, summaries)
    paths["table"] = list(save_table(table, f"{prefix}_summary", reports_dir))
    return figs, table, paths


def data_note(runs: Mapping[str, tuple[Path, Path | None]]) -> str:
    """The corpus labels of the runs (from their summaries), for figure titles: which data, and that it is
    not FineWeb-Edu when it is not."""
    import json

    labels = []
    for _, summary in runs.values():
        if summary is not None:
            lab = json.loads(Path(summary).read_text())["data"]["label"]
            if lab not in labels:
                labels.append(lab)
    return "data: " + "; ".join(labels) if labels else "data: unknown (runs without summary.json)"


def training_kernel_bench(bench_dir: str | Path | None = None):
    """The committed ``python -m twell.bench train-ffn`` record on the generator's inputs (an ffn-*.json with
    training cases run by the sparse training kernels and no checkpoint's captured layers): of those with the most
    cases the newest, so a later run of one or two cases does not replace the full table. As a DataFrame:
    per case, dense and sparse ms, speed-up, peak memory above inputs and energy per token; ``(None, None)`` when
    there is none. Returns ``(table, json path)``."""
    import json

    import pandas as pd

    root = Path(bench_dir) if bench_dir is not None else repo_root() / "reports" / "bench"
    found = []
    for p in sorted(root.glob("ffn-*.json")):
        try:
            res = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        cases = [c for c in res.get("cases", []) if c.get("case", {}).get("kind") == "train"
                 and "twell-train-kernel" in c.get("impls", {})]
        if any(c["case"].get("layer") is not None for c in cases):
            continue  # a record of a checkpoint's layers (docs/training_kernels.md shows those), not the generator's
        if cases:
            found.append((len(cases), res["meta"].get("timestamp", ""), p, res, cases))
    if not found:
        return None, None
    _, _, path, res, cases = max(found, key=lambda f: f[:2])
    rows = []
    for c in cases:
        d, k = c["dense"], c["impls"]["twell-train-kernel"]
        mb = lambda b: None if b is None else b / 2**20  # noqa: E731
        uj = lambda j: None if j is None else 1e6 * j  # noqa: E731
        rows.append({"case": c["name"], "device": res["meta"].get("device_name"),
                     "nnz (target)": c["case"]["nnz"], "tail": c["case"]["tail"],
                     "dense ms": d["timing"]["median_ms"], "sparse ms": k["timing"]["median_ms"],
                     "speed-up": k.get("speedup"), "rel. error": k.get("rel_err"),
                     "dense peak MB": mb(d.get("peak_bytes_above_inputs")),
                     "sparse peak MB": mb(k.get("peak_bytes_above_inputs")),
                     "dense uJ/token": uj(d.get("joules_per_token")), "sparse uJ/token": uj(k.get("joules_per_token"))})
    return pd.DataFrame(rows), path


def activity_of_runs(runs: Mapping[str, str | Path], device: str = "cpu", max_tokens: int | None = None,
                     seq: int | None = None) -> dict:
    """``python -m twell.bench activity`` for finished runs (``label -> run directory`` holding ``final/`` and
    ``summary.json``), each on the held-out split of the data it trained on: the same JSON layout
    (``{"label", "meta", "models": {label: ...}}``) that :func:`twell.train.plots.activity_table` reads."""
    import json

    from twell.bench.activity import checkpoint_activity

    models = {}
    for label, run_dir in runs.items():
        run_dir = Path(run_dir)
        if not run_dir.is_absolute():
            run_dir = repo_root() / run_dir
        summary = run_dir / "summary.json"
        if not (run_dir / "final").is_dir() or not summary.is_file():
            raise FileNotFoundError(f"{run_dir}: expected a finished run (final/ and summary.json); train it first")
        prepared = json.loads(summary.read_text())["data"].get("prepared_dir")
        if not prepared:
            raise ValueError(f"{summary} records no prepared data directory to take held-out tokens from")
        models[label] = checkpoint_activity(run_dir / "final", prepared, seq=seq, max_tokens=max_tokens, device=device)
    return {"label": ", ".join(runs), "meta": {"device": device}, "models": models}


def activity_findings(result: dict) -> str:
    """Two sentences from an activity result: which layers are most and least active in each model, and
    how much more active the first position bin is than the later ones."""
    from twell.train.plots import activity_table

    t = activity_table(result)
    out = []
    for name, g in t.groupby("model", sort=False):
        order = g.sort_values("active %")
        ratio = g["first bin / later bins"]
        out.append(f"{name}: least active layer {int(order.iloc[0]['layer'])} ({order.iloc[0]['active %']:.2f}% of H), "
                   f"most active layer {int(order.iloc[-1]['layer'])} ({order.iloc[-1]['active %']:.2f}%); the first "
                   f"position bin holds {ratio.min():.1f}-{ratio.max():.1f}x the later bins' active neurons per token")
    return ". ".join(out) + "."
