"""twell.eval.tables: dense/sparse table arithmetic, skipped tasks, files written (synthetic EvalRun records)."""
import math
import random

import pandas as pd
import pytest

from twell.eval.harness import EvalRun, TaskResult
from twell.eval.tables import comparison_table, to_markdown, write_comparison

NORM_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "openbookqa", "piqa")


def _metric(rng):
    p = rng.uniform(0.2, 0.8)
    return {"value": p, "stderr": rng.uniform(0.005, 0.03)}


def _run(name, rng, skip=(), fixture=False):
    tasks = {}
    for task in (*NORM_TASKS, "winogrande", "commonsense_qa"):
        if task in skip:
            tasks[task] = TaskResult(task, "skipped", "hub", reason=f"no data for {task} (test)")
            continue
        metrics = {"acc": _metric(rng)}
        if task in NORM_TASKS:
            metrics["acc_norm"] = _metric(rng)
        tasks[task] = TaskResult(task, "ok", "local", n=rng.randint(100, 1000), metrics=metrics)
    return EvalRun(name=name, source=f"/ckpt/{name}", loader="test", ffn_path="dense", ffn_paths_observed={},
                   device="cpu", dtype="float32", batch_size="8", batch_size_note="fixed 8", limit=None, offline=True,
                   fixture=fixture, notes=[], versions={"lm_eval": "0.4.13"}, seconds=1.0, tasks=tasks)


@pytest.fixture
def runs(seed):
    rng = random.Random(seed)
    dense, sparse = _run("dense", rng, skip=("piqa",)), _run("sparse", rng, skip=("piqa", "openbookqa"))
    for task in dense.tasks:  # the same documents in both runs
        sparse.tasks[task].n = dense.tasks[task].n
    return {"dense": dense, "sparse": sparse}


def test_rows_differences_and_standard_errors(runs):
    table = comparison_table(runs)
    ok = table[table.status == "ok"]
    for row in ok.itertuples():
        d, s = runs["dense"].tasks[row.task].metrics[row.metric], runs["sparse"].tasks[row.task].metrics[row.metric]
        assert row.dense == d["value"] and row.sparse == s["value"]
        assert row.diff == pytest.approx(s["value"] - d["value"])
        assert row.diff_se == pytest.approx(math.sqrt(d["stderr"] ** 2 + s["stderr"] ** 2))
    headline = ok[ok.block == "headline"].set_index("task").metric.to_dict()
    assert headline == {"arc_easy": "acc_norm", "arc_challenge": "acc_norm", "hellaswag": "acc_norm",
                        "winogrande": "acc", "commonsense_qa": "acc"}


def test_mean_rows_use_only_tasks_scored_in_both(runs):
    table = comparison_table(runs)
    scored = ["arc_easy", "arc_challenge", "hellaswag", "winogrande", "commonsense_qa"]
    mean = table[(table.status == "mean") & (table.block == "acc")].iloc[0]
    assert mean.task == "mean (5 tasks)"
    vals = [runs["sparse"].tasks[t].metrics["acc"]["value"] - runs["dense"].tasks[t].metrics["acc"]["value"]
            for t in scored]
    assert mean["diff"] == pytest.approx(sum(vals) / 5)
    ses = [math.hypot(runs["dense"].tasks[t].metrics["acc"]["stderr"], runs["sparse"].tasks[t].metrics["acc"]["stderr"])
           for t in scored]
    assert mean["diff_se"] == pytest.approx(math.sqrt(sum(s * s for s in ses)) / 5)
    norm_mean = table[(table.status == "mean") & (table.block == "acc_norm")].iloc[0]
    assert norm_mean.task == "mean (3 tasks)"


def test_skipped_tasks_have_no_number(runs):
    table = comparison_table(runs)
    skipped = table[table.status == "skipped"].set_index("task")
    assert set(skipped.index) == {"piqa", "openbookqa"}
    assert skipped[["dense", "sparse", "diff"]].isna().all().all()
    assert skipped.loc["piqa", "note"].startswith("both: no data for piqa")
    assert skipped.loc["openbookqa", "note"] == "sparse: no data for openbookqa (test)"
    md = to_markdown(table, runs)
    assert "Skipped (no score, not zero):" in md and "- openbookqa: sparse: no data" in md
    assert "| openbookqa |" not in md and "| piqa |" not in md


def test_files_are_written(runs, tmp_path):
    runs["sparse"].fixture = True
    out = write_comparison(runs, stem="test_eval", reports_root=tmp_path)
    assert out["csv"].parent == tmp_path / "tables" and out["figure"].parent == tmp_path / "figures"
    back = pd.read_csv(out["csv"])
    assert len(back) == len(comparison_table(runs))
    assert out["figure"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = out["markdown"].read_text()
    assert "FIXTURE" in md and "sqrt(se_dense² + se_sparse²)" in md and "independent" in md
    assert set(EvalRun.from_dict(v).name for v in __import__("json").loads(out["runs"].read_text()).values()) == \
        {"dense", "sparse"}


def test_unknown_run_name(runs):
    with pytest.raises(KeyError, match="'l1'"):
        comparison_table(runs, other="l1")


def test_paired_standard_error_from_logged_samples(runs, seed):
    rng = random.Random(seed + 1)  # not the stream that made the runs
    n = rng.randint(5, 40)
    b = [float(rng.random() < 0.5) for _ in range(n)]
    o = [float(rng.random() < 0.5) for _ in range(n)]
    for run, outcomes in ((runs["dense"], b), (runs["sparse"], o)):
        res = run.tasks["winogrande"]
        res.samples = [{"doc_id": i, "loglikelihoods": [0.0, 0.0], "acc": v} for i, v in enumerate(outcomes)]
    table = comparison_table(runs)
    row = table[(table.block == "acc") & (table.task == "winogrande")].iloc[0]
    diffs = pd.Series([y - x for x, y in zip(b, o)])
    assert row.diff_se_paired == pytest.approx(diffs.std(ddof=1) / math.sqrt(n))
    others = table[(table.status == "ok") & (table.task != "winogrande")]
    assert others.diff_se_paired.isna().all()
    assert "paired se" in to_markdown(table, runs)


def test_all_tasks_skipped_still_writes_files(tmp_path, seed):
    rng = random.Random(seed)
    every = (*NORM_TASKS, "winogrande", "commonsense_qa")
    runs = {"dense": _run("dense", rng, skip=every), "sparse": _run("sparse", rng, skip=every)}
    out = write_comparison(runs, stem="none", reports_root=tmp_path)
    table = pd.read_csv(out["csv"])
    assert (table.status == "skipped").all() and len(table) == 7
    assert "Skipped (no score, not zero):" in out["markdown"].read_text()
    assert out["figure"].is_file()


def test_fixture_data_is_flagged(runs):
    for run in runs.values():
        run.tasks["winogrande"].source = "fixture-data"
    table = comparison_table(runs)
    assert set(table[table.task == "winogrande"].data) == {"fixture-data"}
    assert "winogrande **[FIXTURE data]**" in to_markdown(table, runs)
    assert "**[FIXTURE data]**" in [l for l in to_markdown(table, runs).splitlines() if l.startswith("| mean")][0]


def test_mean_standard_error_is_nan_when_a_task_has_none(runs):
    # no samples logged: every task's paired se is NaN, so the mean's is too (not sqrt(0)/k = 0.0)
    table = comparison_table(runs)
    means = table[table.status == "mean"]
    assert table[table.status == "ok"].diff_se_paired.isna().all() and means.diff_se_paired.isna().all()
    assert "paired se" not in to_markdown(table, runs)
    # one lm-eval stderr 'N/A' (NaN): the means that include that task have no error rather than a too-small one
    runs["dense"].tasks["winogrande"].metrics["acc"]["stderr"] = math.nan
    table = comparison_table(runs)
    mean = table[(table.status == "mean") & (table.block == "acc")].iloc[0]
    assert math.isnan(mean.dense_se) and math.isnan(mean.diff_se) and not math.isnan(mean.sparse_se)
    norm_mean = table[(table.status == "mean") & (table.block == "acc_norm")].iloc[0]  # winogrande has no acc_norm
    assert not math.isnan(norm_mean.dense_se)


def test_markdown_flags_scores_over_different_documents(runs):
    runs["sparse"].tasks["winogrande"].n = runs["dense"].tasks["winogrande"].n - 7
    md = to_markdown(comparison_table(runs), runs)
    d, sp = runs["dense"].tasks["winogrande"].n, runs["sparse"].tasks["winogrande"].n
    rows = [l for l in md.splitlines() if l.startswith("| winogrande")]
    assert rows and all(f"different n: dense {d}, sparse {sp}" in l and f"| {d} / {sp} |" in l for l in rows)
    assert not any("different n" in l for l in md.splitlines() if l.startswith("| commonsense_qa"))


def test_chance_level_beside_each_score(runs):
    table = comparison_table(runs)
    ok = table[table.status == "ok"].set_index(["block", "task"])
    assert ok.loc[("acc", "commonsense_qa"), "chance"] == pytest.approx(0.2)
    assert ok.loc[("acc", "winogrande"), "chance"] == pytest.approx(0.5)
    assert ok.loc[("acc", "arc_easy"), "chance"] == pytest.approx(0.25)
    mean = table[(table.status == "mean") & (table.block == "acc")].iloc[0]
    assert mean.chance == pytest.approx((0.25 * 3 + 0.5 + 0.2) / 5)
    md = to_markdown(table, runs)
    assert "| task | metric | n | chance |" in md and "| 20.0 |" in md
