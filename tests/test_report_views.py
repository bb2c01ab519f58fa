"""The views notebooks show in place of whole tables and reports: notebook 04's table beside the paper's
numbers, its figures, notebook 01's report summary and speed-up view, links and paths in outputs."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import matplotlib
import pytest
import yaml

matplotlib.use("agg")

from twell.reports import display_path, efficiency, file_link, kernel_study as ks, relative_source  # noqa: E402
from twell.reports.save import NOTEBOOK_DIR_VARIABLE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = yaml.safe_load((ROOT / "configs" / "pipeline" / "04_efficiency.yaml").read_text())[
    "profiles"]["gpu-small"]["results"]


@pytest.fixture(scope="module")
def results():
    return efficiency.load_results(RESULTS)


def test_paper_view_puts_ours_beside_the_papers_numbers(results):
    table = efficiency.efficiency_table(results)
    view = efficiency.paper_view(table)
    assert len(view) == len(results) and view.index.tolist() == list(range(len(results)))
    assert view[("model", "scale")].tolist() == ["0.5B", "1B", "1.5B", "2B"]
    for measure in ("prefill throughput gain %", "energy per token change %", "training throughput gain %"):
        assert {"ours", "paper"} <= set(view[measure].columns), measure
    assert view[("prefill throughput gain %", "ours")].tolist() == table["prefill gain %"].round(1).tolist()
    assert view[("prefill throughput gain %", "paper")].tolist() == ["+17.0", "", "", "+20.5"]
    train = [next(r for r in res["rows"] if r["measure"] == "training") for res in results]
    want = [round(100 * (t["sparse"]["peak_bytes"] / t["dense"]["peak_bytes"] - 1), 1) for t in train]
    assert view[("training peak memory change %", "ours")].tolist() == pytest.approx(want, abs=0.051)
    assert all(w < 0 for w in want)
    # the 0.5B run has no CUDA-graph decode rows: blank, not nan, in the display
    html = efficiency.show_view(view).to_html()
    assert "nan" not in html.lower() and "+17.0" in html and "-15.8" in html
    assert "<th" in html and "blank level0 row0" not in html  # no index column


def test_figures_draw_no_prefill_peak_and_say_what_is_missing(results):
    figs = efficiency.figures(results, title="NVIDIA H200")
    assert set(figs) == {"speedup", "energy", "memory"}
    for fig in figs.values():
        titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
        assert len(titles) == 1 and titles[0].count("NVIDIA H200") == 1 and fig._suptitle is None
    memory = figs["memory"].axes[0]
    assert "Training" in memory.get_title() and memory.get_ylabel() == "peak GB"
    heights = [p.get_height() for p in memory.patches]
    assert len(set(heights)) == len(heights)  # dense and sparse differ at every scale
    speed = figs["speedup"]
    texts = [t.get_text() for ax in speed.axes for t in ax.texts] + [t.get_text() for t in speed.texts]
    assert texts.count("not measured") == 2  # 0.5B, CUDA-graph decode at batch 1 and 32
    assert any("0.5B's run has no 'decode, CUDA graph' rows (batch 1, 32)" in t for t in texts)


def test_ffn_view_keeps_the_file_names_whole():
    files = yaml.safe_load((ROOT / "configs" / "pipeline" / "04_efficiency.yaml").read_text())[
        "profiles"]["gpu-small"]["ffn_results"]
    html = efficiency.ffn_view(efficiency.ffn_at_paper_sparsity(files)).to_html()
    for f in files.values():
        assert Path(f).name in html


def test_report_summary_and_speedup_view_of_the_record():
    run = ks.earlier_bench(None, ROOT / "reports")
    summary = ks.report_summary(run)
    assert summary["section"].tolist() == ["inference FFN", "inference FFN, odd shape", "training FFN"]
    assert summary["correct"].tolist()[:2] == ["24 of 24", "8 of 8"]
    assert "dense only" in summary["implementations"].iloc[2]  # the record timed no sparse training FFN
    speeds = [ks.speedup_table(run, n) for n in ks.impl_names(run.result)]
    view = ks.speedup_view(speeds)
    assert len(view) == len(speeds[0]) and "measured at" not in view and "device" not in view
    at_bar = view[(view["M"] == 65536) & (view["case"] == "nnz29")].iloc[0]
    assert at_bar["twell-kernel (x)"] == round(speeds[0].loc[at_bar.name, "speedup"], 2)
    assert at_bar["bar (x)"] == 2.2 and at_bar["twell-kernel meets bar"] == "no"


def test_report_summary_counts_wrong_results():
    run = ks.earlier_bench(None, ROOT / "reports")
    result = json.loads(json.dumps(run.result))
    result["cases"][0]["impls"]["twell-kernel"]["ok"] = False
    summary = ks.report_summary(dataclasses.replace(run, result=result))
    assert summary["correct"].iloc[0] == "23 of 24"


def test_file_link_is_relative_to_the_executed_notebook(tmp_path, monkeypatch):
    table = ROOT / "reports" / "tables" / "04_efficiency.md"
    monkeypatch.setenv(NOTEBOOK_DIR_VARIABLE, str(ROOT / "reports" / "notebooks"))
    assert file_link(table) == "[`reports/tables/04_efficiency.md`](../tables/04_efficiency.md)"
    monkeypatch.delenv(NOTEBOOK_DIR_VARIABLE)
    monkeypatch.chdir(ROOT / "notebooks")  # a notebook run in JupyterLab: its own folder
    assert file_link(table) == "[`reports/tables/04_efficiency.md`](../reports/tables/04_efficiency.md)"


def test_display_path_names_no_machine_folder():
    assert display_path("/somewhere/else/checkout/runs/eff_0p5b/final") == "runs/eff_0p5b/final"
    assert display_path(ROOT / "runs" / "x" / "final") == "runs/x/final"
    assert display_path("/data/models/model.safetensors") == "model.safetensors"
    assert display_path("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"  # a hub id


def test_relative_source_of_a_committed_evaluation():
    from twell.eval.harness import EvalRun

    path = ROOT / "reports" / "eval" / "0p5b" / "sparse.json"
    run = EvalRun.load_json(path)
    assert Path(run.source).is_absolute()  # what the GPU machine recorded
    shown = relative_source(run)
    assert shown.source == "runs/eff_0p5b/final" and shown.tasks == run.tasks and run.source != shown.source


def test_paper_view_of_a_run_without_energy_or_training_rows(results):
    """A CPU run (cpu-smoke) measures no energy and may lack rows: those columns hold None, shown blank."""
    table = efficiency.efficiency_table(results)
    for col in ("energy change %", "decode CUDA graph gain %", "training gain %"):
        table[col] = [None] * len(table)
    view = efficiency.paper_view(table)
    assert view[("energy per token change %", "ours")].isna().all()
    assert view[("prefill throughput gain %", "ours")].tolist() == table["prefill gain %"].round(1).tolist()
    assert "nan" not in efficiency.show_view(view).to_html().lower()
