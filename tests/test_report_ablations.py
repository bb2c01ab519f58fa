"""Notebook 02's ablation table and activity-profile sentence, and notebook 03's key table, each checked against
values computed here straight from the committed JSON files (runs, model benchmarks, evaluation logs)."""
from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path

import pytest
import yaml

from twell.reports import markdown_table, readable
from twell.reports.ablations import PAPER_ABLATIONS, ablation_table, activity_profile_note, prefill_ratios
from twell.reports.downstream import PAPER_DOWNSTREAM, at_chance, chance_note, key_table

ROOT = Path(__file__).resolve().parents[1]
PIPE = ROOT / "configs" / "pipeline"
NB02 = yaml.safe_load((PIPE / "02_sparse_training.yaml").read_text())["profiles"]["gpu-small"]
NB03 = yaml.safe_load((PIPE / "03_downstream_eval.yaml").read_text())["profiles"]["gpu-small"]


def _json(path) -> dict:
    p = ROOT / path
    return json.loads(gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_text())


@pytest.fixture(scope="module")
def ablations():
    return ablation_table(NB02["ablation_runs"], NB02["ablation_bench"])


def test_ablation_rows_match_the_run_summaries(ablations):
    assert ablations["model"].tolist() == list(NB02["ablation_runs"])
    for row, run in zip(ablations.to_dict("records"), NB02["ablation_runs"].values()):
        s = _json(Path(run) / "summary.json")
        f = s["final"]
        assert row["val CE"] == f["val_ce"]
        assert row["active % (train end)"] == pytest.approx(100 * f["active_frac_mean"], rel=1e-12)
        assert row["active % (held out)"] == pytest.approx(100 * f["val_active_frac"], rel=1e-12)
        dead = f["dead_frac_per_layer"]
        assert row["dead % (train end)"] == pytest.approx(100 * sum(dead) / len(dead), rel=1e-12)
        assert row["L1"] == s["config"]["sparsity"]["l1_coef"]
        assert row["tokens (M)"] == pytest.approx(s["steps_done"] * s["tokens_per_step"] / 1e6)
    # the four FFNs the ablations compare, and the SiLU model's every neuron active
    assert ablations["FFN"].tolist() == ["ReLU-gated", "ReLU-gated", "SiLU-gated (Llama)", "ReLU, non-gated"]
    silu = ablations.set_index("model").loc["SiLU-gated, dense"]
    assert silu["active % (held out)"] == pytest.approx(100, abs=1e-6) and silu["dead % (train end)"] == 0


def test_prefill_ratios_are_the_benchmarks_throughputs_divided(ablations):
    for label, path in NB02["ablation_bench"].items():
        res = _json(path)
        row = ablations.set_index("model").loc[label]
        for r in res["rows"]:
            if r["measure"] != "prefill":
                continue
            want = r["sparse"]["tokens_per_ms"] / r["dense"]["tokens_per_ms"]
            assert row[f"prefill ratio, batch {r['batch']}"] == pytest.approx(want, rel=1e-12)
            assert want == pytest.approx(r["speedup"], rel=1e-9)  # the benchmark's own ratio
    by = ablations.set_index("model")
    assert by.loc["SiLU-gated, dense", "ratio of"] == "this model / small_books_dense"
    assert by.loc["ReLU-gated, L1 2e-5", "ratio of"] == "sparse path / its dense path"
    assert by.loc["ReLU-gated, dense"].isna()[["prefill ratio, batch 8", "ratio of"]].all()  # no benchmark of its own
    assert not any("decode" in c for c in ablations.columns)  # 8 new tokens: noise, left out


def test_paper_findings_sit_beside_their_ffn(ablations):
    by = ablations.set_index("model")["paper"]
    assert "47.1%" in by["SiLU-gated, dense"] and "5632" in by["SiLU-gated, dense"]
    assert "46.4%" in by["ReLU-gated, L1 2e-5"]
    assert "+11.2%" in by["ReLU non-gated, L1 2e-5"]
    assert by["ReLU-gated, dense"] == ""
    assert set(PAPER_ABLATIONS) == {("relu_gated", True), ("silu_gated", False), ("relu", True)}


def test_ablation_table_refuses_a_benchmark_without_its_run(tmp_path):
    with pytest.raises(KeyError, match="name no run"):
        ablation_table({"a": NB02["ablation_runs"]["ReLU-gated, L1 2e-5"]},
                       {"b": NB02["ablation_bench"]["ReLU-gated, L1 2e-5"]})


def _fake_activity(pct_per_layer, bins=4):
    return {"models": {"m": {"active_frac_per_layer": [p / 100 for p in pct_per_layer],
                             "positions": {"edges": [0, 8, 16, 24, 32],
                                           "active": [[3.0] + [1.0] * (bins - 1) for _ in pct_per_layer]}}}}


def test_activity_note_names_the_layers_the_json_holds():
    act = _json(NB02["activity"])
    note = activity_profile_note(act)
    for name, m in act["models"].items():
        pct = [100 * f for f in m["active_frac_per_layer"]]
        least = min(range(len(pct)), key=pct.__getitem__)
        assert f"the least active is layer {least} of {len(pct)} ({pct[least]:.2f}%)" in note, name
        top = sorted(sorted(range(len(pct)), key=pct.__getitem__)[-2:])
        if top == [0, len(pct) - 1]:
            assert "the first and last layers are the most active" in note
        b = m["positions"]["active"]
        ratios = [row[0] / (sum(row[1:]) / (len(row) - 1)) for row in b]
        assert f"{min(ratios):.1f}-{max(ratios):.1f}x" in note
    # a profile of the paper's kind (early layers least active) reads so, with random other layers
    rng = random.Random()
    n = rng.randint(6, 12)
    pct = [rng.uniform(1.0, 5.0) for _ in range(n)]
    pct[1] = 0.01
    text = activity_profile_note(_fake_activity(pct))
    assert "as in the paper, the least active layer is in the first third" in text
    assert "3.0-3.0x" in text
    pct[1], pct[n - 2] = 3.0, 0.01
    assert "not in the first third" in activity_profile_note(_fake_activity(pct))


def _eval_logs():
    from twell.eval.harness import EvalRun

    return {k: EvalRun.load_json(ROOT / v) for k, v in NB03["results"].items()}


def test_key_table_matches_the_evaluation_logs():
    runs = _eval_logs()
    raw = {k: _json(v) for k, v in NB03["results"].items()}
    table = key_table(runs)
    tasks = table[~table.task.str.startswith("mean")]
    assert len(tasks) == 7
    paper_metric = {"arc_easy": "acc_norm", "arc_challenge": "acc_norm", "hellaswag": "acc_norm",
                    "openbookqa": "acc_norm", "piqa": "acc_norm", "winogrande": "acc", "commonsense_qa": "acc"}
    vals = {}
    for r in tasks.to_dict("records"):
        assert r["metric"] == paper_metric[r["task"]]
        for side in ("dense", "sparse"):
            m = raw[side]["tasks"][r["task"]]["metrics"][r["metric"]]
            assert r[f"{side} %"] == pytest.approx(100 * m["value"], rel=1e-12)
            assert r[f"{side} se"] == pytest.approx(100 * m["stderr"], rel=1e-12)
            vals.setdefault(side, []).append((m["value"], m["stderr"]))
        assert r["gap (pts)"] == pytest.approx(r["sparse %"] - r["dense %"])
        assert r["gap se"] == pytest.approx(math.hypot(r["dense se"], r["sparse se"]))
        assert math.isnan(r["paper 2B dense %"])
    mean = table[table.task.str.startswith("mean")].iloc[0]
    k = len(vals["dense"])
    for side in ("dense", "sparse"):
        assert mean[f"{side} %"] == pytest.approx(100 * sum(v for v, _ in vals[side]) / k, rel=1e-12)
        assert mean[f"{side} se"] == pytest.approx(100 * math.sqrt(sum(s * s for _, s in vals[side])) / k, rel=1e-12)
    gap_se = 100 * math.sqrt(sum(a * a + b * b for (_, a), (_, b) in zip(vals["dense"], vals["sparse"]))) / k
    assert mean["gap se"] == pytest.approx(gap_se, rel=1e-12)
    assert (mean["paper 2B dense %"], mean["paper 2B sparse %"]) == (49.1, 48.8)
    assert mean["paper 2B gap (pts)"] == pytest.approx(-0.3)
    assert PAPER_DOWNSTREAM["scale"] == "2B"


def test_the_books_pair_is_at_chance_on_every_task():
    table = key_table(_eval_logs())
    for side in ("dense", "sparse"):
        assert len(at_chance(table, side)) == 7
    assert chance_note(table) == ("dense: within 2 standard errors of chance on 7 of 7 tasks; "
                                  "sparse: within 2 standard errors of chance on 7 of 7 tasks.")
    # a score four standard errors above chance is not at chance
    moved = table.copy()
    moved.loc[0, "dense %"] = moved.loc[0, "chance %"] + 4 * moved.loc[0, "dense se"]
    assert moved.loc[0, "task"] not in at_chance(moved, "dense")
    assert "6 of 7 tasks (" in chance_note(moved)


def test_missing_values_read_as_a_dash():
    import pandas as pd

    df = pd.DataFrame({"ms": [1.5, 2.25], "uJ/token": [None, None], "gain": [float("nan"), 3.0]})
    html = readable(df).to_html()
    assert "None" not in html and "nan" not in html.lower() and html.count(">-<") == 3
    assert "None" not in markdown_table(df) and "| 1.5 | - |" in markdown_table(df)
