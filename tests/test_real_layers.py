"""twell.reports.real_layers: real (checkpoint layer) cases pooled over benchmark JSONs."""
from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

import pandas as pd
import pytest
from matplotlib.figure import Figure

from twell.paths import repo_root
from twell.reports import real_layers as rl
from twell.reports import save_table


def _case(layer: int, nnz: float, speedups: dict[str, float], ok: bool = True, M: int = 65536) -> dict:
    return {"case": {"kind": "real", "sparsity": f"layer{layer}", "M": M, "D": 2048, "H": 5632, "layer": layer},
            "sparsity": {"mean_active": nnz, "max_active": int(nnz * 10), "p99_active": nnz * 4,
                         "union_reuse_64": 5.0},
            "dense": {"timing": {"median_ms": 7.0}},
            "impls": {name: {"ok": ok, "speedup": s, "rel_err": 1e-3, "timing": {"median_ms": 7.0 / s}}
                      for name, s in speedups.items()}}


def _result(timestamp: str, cases: list[dict], reps: int = 30, device: str = "cuda", code: dict | None = None) -> dict:
    meta = {"timestamp": timestamp, "device": device, "device_name": "NVIDIA H100 80GB HBM3", "clock": "cuda-events",
            "config": {"reps": reps, "warmup": 3, "flush_l2": True, "energy": True, "energy_seconds": 2.0,
                       "memory": True, "checkpoint": "/tmp/ckpt"}}
    if code is not None:
        meta["code"] = code
    return {"meta": meta, "complete": True, "cases": cases, "failures": [], "unavailable": {}}


@pytest.fixture
def bench_dir(tmp_path):
    d = tmp_path / "bench"
    d.mkdir()
    both = ("twell-kernel", "twell-kernel-union")
    (d / "ffn-a.json").write_text(json.dumps(_result("2026-11-25T10:00:00+00:00", [
        _case(0, 6.0, dict(zip(both, (2.9, 2.7)))), _case(1, 40.0, dict(zip(both, (1.6, 2.1))))])))
    (d / "ffn-b.json").write_text(json.dumps(_result("2026-11-26T10:00:00+00:00", [
        _case(0, 25.0, dict(zip(both, (2.0, 2.4)))), _case(1, 90.0, dict(zip(both, (0.9, 1.6)))),
        _case(2, 12.0, {"twell-kernel": 2.5, "twell-kernel-union": 9.9}, ok=False),
    ], code={"csrc": "abc123"})))
    # Skipped: a generator-only run, a run below the protocol, a CPU run, files that are no results.
    gen = _result("2026-11-26T11:00:00+00:00", [_case(0, 29.0, {"twell-kernel": 1.8})])
    gen["cases"][0]["case"]["kind"] = "inference"
    (d / "ffn-gen.json").write_text(json.dumps(gen))
    (d / "ffn-quick.json").write_text(json.dumps(_result("2026-11-26T12:00:00+00:00",
                                                         [_case(0, 29.0, {"twell-kernel": 5.0})], reps=5)))
    (d / "ffn-cpu.json").write_text(json.dumps(_result("2026-11-26T12:00:00+00:00",
                                                       [_case(0, 29.0, {"twell-kernel": 5.0})], device="cpu")))
    (d / "ffn-broken.json").write_text("{not json")
    partial = _result("2026-11-26T12:00:00+00:00", [_case(0, 29.0, {"twell-kernel": 5.0})])
    partial["complete"] = False  # a run that stopped part-way
    (d / "ffn-partial.json").write_text(json.dumps(partial))
    # A layer at another M is listed but does not bracket the bars (defined at M = 65536).
    (d / "ffn-smallM.json").write_text(json.dumps(_result("2026-11-26T13:00:00+00:00",
                                                          [_case(0, 28.0, {"twell-kernel-union": 3.3}, M=8192)])))
    (d / "parts-x.json").write_text(json.dumps(_result("2026-11-26T12:00:00+00:00",
                                                       [_case(0, 29.0, {"twell-kernel": 5.0})])))
    return d


def test_table_pools_real_layers_of_protocol_runs(bench_dir, tmp_path):
    copy = tmp_path / "scratch"
    copy.mkdir()
    (copy / "ffn-a.json").write_text((bench_dir / "ffn-a.json").read_text())  # the same run in a second folder
    t = rl.real_layer_table([bench_dir, bench_dir / ".." / "bench", copy, bench_dir / "missing"])
    assert list(t.columns) == rl.COLUMNS
    assert len(t) == 11 and set(t["run"]) == {"a", "b", "smallM"}  # 5 layers x 2 implementations + 1, each once
    assert 5.0 not in set(t["speedup"])  # the quick, CPU and partial runs (5.0x) are left out
    assert set(t["device"]) == {"NVIDIA H100 80GB HBM3"}
    row = t[(t["run"] == "b") & (t["layer"] == 1) & (t["impl"] == "twell-kernel-union")].iloc[0]
    assert row["nnz mean"] == 90.0 and row["speedup"] == 1.6 and row["correct"] == "yes"
    assert row["csrc"] == "abc123" and row["reuse 64"] == 5.0 and row["M"] == 65536
    assert set(t[t["run"] == "a"]["csrc"]) == {"not recorded"}
    assert set(t[(t["layer"] == 2)]["correct"]) == {"no"}
    # write_outputs' names carry the device; the run column drops it.
    named = tmp_path / "named"
    named.mkdir()
    (named / "ffn-NVIDIA-H100-80GB-HBM3-20261126T171534Z-real6-s32.json").write_text((bench_dir / "ffn-a.json").read_text())
    assert set(rl.real_layer_table([named])["run"]) == {"20261126T171534Z-real6-s32"}
    assert rl.real_layer_table([bench_dir / "missing"]).empty


def test_bar_brackets_name_the_nearest_correct_layers(bench_dir):
    t = rl.real_layer_table([bench_dir])
    b = rl.bar_brackets(t, "twell-kernel-union").set_index("bar case")
    assert list(b.index) == ["nnz8", "nnz29", "nnz64"]
    assert (b.loc["nnz8", "below nnz"], b.loc["nnz8", "below speedup"]) == (6.0, 2.7)
    # The wrong layer at nnz 12 (9.9x) is not a bracket: the next correct layer above 8 is at 25.
    assert (b.loc["nnz8", "above nnz"], b.loc["nnz8", "above speedup"]) == (25.0, 2.4)
    # The 8192-token layer at nnz 28 (3.3x) is not the nearest below 29: the bars are at M = 65536.
    assert b.loc["nnz29", "below layer"] == "b layer 0" and b.loc["nnz29", "above layer"] == "a layer 1"
    assert (b.loc["nnz64", "below nnz"], b.loc["nnz64", "above nnz"]) == (40.0, 90.0)
    assert b.loc["nnz64", "bar"] == 1.5
    empty = rl.bar_brackets(t, "no-such-impl")
    assert empty["below nnz"].isna().all() and (empty["above layer"] == "").all()



def test_another_gpu_with_the_same_stamp_is_kept_apart(bench_dir):
    """Runs on two GPUs may share a file stamp and tag: the bars (H100 numbers) bracket H100 layers only,
    and the figure counts two runs, not one."""
    other = _result("2026-11-25T10:00:00+00:00", [_case(0, 28.5, {"twell-kernel": 2.6})])
    other["meta"]["device_name"] = "NVIDIA H200"
    (bench_dir / "ffn-NVIDIA-H200-x.json").write_text(json.dumps(other))
    (bench_dir / "ffn-NVIDIA-H100-80GB-HBM3-x.json").write_text(json.dumps(
        _result("2026-11-25T10:00:00+00:00", [_case(0, 28.0, {"twell-kernel": 2.1})])))
    t = rl.real_layer_table([bench_dir])
    assert len(t[t["run"] == "x"]) == 2
    h100 = rl.bar_brackets(t, "twell-kernel").set_index("bar case")
    assert (h100.loc["nnz29", "below nnz"], h100.loc["nnz29", "below layer"]) == (28.0, "x layer 0")
    anywhere = rl.bar_brackets(t, "twell-kernel", device=None).set_index("bar case")
    assert anywhere.loc["nnz29", "below layer"] == "x layer 0 (NVIDIA H200)"
    fig = rl.plot_real_layers(t[t["run"] == "x"])
    assert "2 layers of 2 benchmark runs" in fig._suptitle.get_text()
    assert rl.count_line(t[t["run"] == "x"]) == "2 layers from 2 runs; correct: 2 of 2 measurements"
    h200 = t[t["device"] == "NVIDIA H200"]
    with pytest.warns(UserWarning, match="no twell-kernel layer measured on a H100"):
        assert rl.bar_brackets(h200, "twell-kernel")["below nnz"].isna().all()


def test_plot_marks_layers_bars_generator_and_wrong_results(bench_dir):
    t = rl.real_layer_table([bench_dir])
    gen = rl.pd.DataFrame([{"shape": "inference", "M": 65536, "case": c, "nnz mean": n, "speedup": s,
                            "impl": "twell-kernel"}
                           for c, n, s in (("nnz8", 8.0, 2.7), ("nnz29", 29.0, 1.8), ("nnz64", 64.0, 1.2),
                                           ("nnz29-heavy", 29.0, 2.1))])
    fig = rl.plot_real_layers(t, gen, "ffn-gen.json")
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    labels = [txt.get_text() for txt in ax.get_legend().get_texts()]
    assert any("per-row" in s for s in labels) and any("block-union" in s for s in labels)
    assert any("generator" in s and "ffn-gen.json" in s for s in labels)
    assert any("WRONG" in s for s in labels) and any("speed bar" in s for s in labels)
    gen_line = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
    assert len(gen_line) == 1 and list(gen_line[0].get_xdata()) == [8.0, 29.0, 64.0]  # heavy tail left out
    assert "6 layers of 3 benchmark runs" in fig._suptitle.get_text()
    assert "M = 8192/65536" in fig._suptitle.get_text() and "NVIDIA H100 80GB HBM3" in fig._suptitle.get_text()
    only_row = rl.plot_real_layers(t, impls=("twell-kernel",))
    assert not any("block-union" in s.get_text() for s in only_row.axes[0].get_legend().get_texts())
    with pytest.raises(ValueError, match="no real layers"):
        rl.plot_real_layers(t.iloc[0:0])
    with pytest.raises(ValueError, match="no real layers"):
        rl.plot_real_layers(t, impls=("no-such-impl",))


def _committed_table(name: str):
    path = repo_root() / "reports" / "tables" / f"{name}.csv"
    assert path.is_file(), f"{path} is not committed"
    return pd.read_csv(path)


def test_committed_real_layer_tables_are_what_the_committed_runs_give(tmp_path):
    """reports/tables/01_real_layers{,_bars}.csv, the tables of record of the real layers, are what notebook
    01 makes of the committed runs in reports/bench: they cover nnz below 8 and above 64, all correct."""
    t = rl.real_layer_table([repo_root() / "reports" / "bench"])
    assert not t.empty, "no committed benchmark run with real layers in reports/bench"
    assert (t["correct"] == "yes").all()
    assert t["nnz mean"].min() < 8 and t["nnz mean"].max() > 64
    assert t["speedup"].notna().all()
    brackets = pd.concat([rl.bar_brackets(t, impl) for impl in ("twell-kernel", "twell-kernel-union")],
                         ignore_index=True)
    for name, df in (("01_real_layers", t), ("01_real_layers_bars", brackets)):
        csv, _ = save_table(df, name, tmp_path)
        pd.testing.assert_frame_equal(_committed_table(name), pd.read_csv(csv), check_exact=False, rtol=1e-12)


def test_plot_shows_layers_that_failed_without_a_timing(tmp_path):
    """A layer whose implementation raised has no speedup (NaN): its cross sits on the axis, not at NaN
    (invisible), and a run where every layer failed still plots."""
    d = tmp_path / "bench"
    d.mkdir()
    failed = _case(1, 40.0, {"twell-kernel": 1.0}, ok=False)
    del failed["impls"]["twell-kernel"]["speedup"], failed["impls"]["twell-kernel"]["timing"]
    (d / "ffn-a.json").write_text(json.dumps(_result("2026-11-25T10:00:00+00:00", [
        _case(0, 6.0, {"twell-kernel": 2.9}), failed])))
    t = rl.real_layer_table([d])
    assert t.loc[t["layer"] == 1, "speedup"].isna().all() and (t.loc[t["layer"] == 1, "correct"] == "no").all()
    ax = rl.plot_real_layers(t).axes[0]
    crosses = [ln for ln in ax.get_lines() if ln.get_marker() == "x" and len(ln.get_xdata())]
    assert [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in crosses] == [([40.0], [0.0])]
    assert any("failed" in s.get_text() for s in ax.get_legend().get_texts())
    ax = rl.plot_real_layers(t[t["layer"] == 1]).axes[0]  # every layer failed
    assert ax.get_ylim()[1] > 0
