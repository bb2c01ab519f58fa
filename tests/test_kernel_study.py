"""twell.reports.kernel_study (notebook 01): verification, benchmark JSON lookup, speedup table and figure."""
from __future__ import annotations

import copy
import json
import math
import random
import re
import types
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pandas as pd
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

import twell.reference as ref
from twell.bench.ffn import BenchConfig, BenchRunner
from twell.paths import repo_root
from twell.reports import kernel_study as ks
from twell.reports import save_figure, save_table

REPO_BENCH = repo_root() / "reports" / "bench"


def _record_json() -> Path:
    """The table of record: the benchmark that README.md links as such (its .md, the .json beside it)."""
    readme = (repo_root() / "README.md").read_text()
    m = re.search(r"\[table of record\]\((reports/bench/ffn-[^)]+)\.md\)", readme)
    assert m, "README.md links no [table of record](reports/bench/ffn-....md)"
    path = repo_root() / (m.group(1) + ".json")
    assert path.is_file(), f"the table of record {path} is not committed"
    return path


# -- verification ------------------------------------------------------------------------------------
def test_verify_reference_passes_on_random_odd_shapes(seed):
    rng = random.Random(seed)
    shapes = [[rng.randrange(2, 300), rng.choice([64, 96, 130]), rng.randrange(100, 700), 8, 0.35],
              [1, 64, 256, 8, 0.1]]
    # heavy_scale 8: at the default 4, 3 of 1000 draws of these shapes had no row with 15% of H active
    # (the precondition below); at 8 none did, the smallest margin 1.75x.
    table = ks.verify_ops(ref, shapes, seed=rng.randrange(1000), heavy_rows=3, progress=False, heavy_scale=8.0)
    ks.assert_verified(table)
    assert set(table["op"]) == set(ks.OPS)
    first = table[table["M"] == shapes[0][0]]
    assert set(first["rows"]) == {f"heavy ({min(3, shapes[0][0] // 2)})", "other"}
    assert set(table[table["M"] == 1]["rows"]) == {"all"}  # M = 1: no row can be made heavy
    # The heavy rows really are heavy: a large share of H active (the target mean is 8).
    assert (first["nnz max"] >= 0.15 * shapes[0][2]).all() and (first["nnz max"] > 2 * 8).all()
    assert (table["rel. error vs fp64"] <= 3 * table["dense bf16 error"] + 1e-4).all()
    assert table["vs reference"].isna().all() and (table["output poisoned"] == "n/a").all()


def _broken(**overrides):
    """The reference ops with some replaced (a stand-in for a buggy kernel)."""
    ns = types.SimpleNamespace(twell_gate=ref.twell_gate, twell_gated_ffn=ref.twell_gated_ffn,
                               twell_ffn=ref.twell_ffn)
    for k, v in overrides.items():
        setattr(ns, k, v)
    return ns


def test_verify_flags_dropped_overflow_rows_and_nan(seed):
    # Like the published kernels: rows that overflow a tile come out wrong (here: zero).
    def drop_overflow(x, gate, w_up, w_down_t):
        out = ref.twell_gated_ffn(x, gate, w_up, w_down_t)
        out[gate.overflow_mask()] = 0
        return out

    # At the published kernels' compression (8: 31 entries a tile) only the heavy rows overflow here; at
    # a fuller one (16: 15 entries) ordinary rows at nnz 8 may too.
    def gate_c8(x, w_gate):
        return ref.twell_gate(x, w_gate, compression=8)

    shapes = [[150, 128, 512, 8, 0.1]]
    table = ks.verify_ops(_broken(twell_gate=gate_c8, twell_gated_ffn=drop_overflow), shapes, seed=seed % 1000,
                          heavy_rows=4, progress=False)
    bad = table[table["ok"] != "yes"]
    assert list(bad["op"]) == ["fused gated up/down"] and bad["rows"].iloc[0].startswith("heavy")
    with pytest.raises(AssertionError, match=r"fused gated up/down \(heavy \(4\) rows\)"):
        ks.assert_verified(table)

    def nan_row(act, w_down_t):
        out = ref.twell_ffn(act, w_down_t)
        out[-1, 0] = float("nan")
        return out

    table = ks.verify_ops(_broken(twell_ffn=nan_row), shapes, heavy_rows=0, progress=False)
    assert list(table[table["ok"] != "yes"]["op"]) == ["non-gated down"]

    def slightly_off(x, gate, w_up, w_down_t):
        return (ref.twell_gated_ffn(x, gate, w_up, w_down_t).float() * 1.02).to(torch.bfloat16)

    table = ks.verify_ops(_broken(twell_gated_ffn=slightly_off), shapes, heavy_rows=2, progress=False)
    assert set(table[table["ok"] != "yes"]["op"]) == {"fused gated up/down"}


def _scaled_gated_ffn(factor: float):
    def op(x, gate, w_up, w_down_t):
        return (ref.twell_gated_ffn(x, gate, w_up, w_down_t).float() * factor).to(torch.bfloat16)
    return op


@pytest.mark.parametrize("factor, lo, hi, ok", [
    (1.0, 0.0, 0.0, "yes"),
    # about half a bf16 step (values move by a whole step or not at all): the difference shows, and it
    # stays within 3x dense bf16's error against fp64, so the op still passes
    (1.004, 2e-3, 1e-2, "yes"),
    (1.05, 0.04, 0.06, "NO"),
])
def test_verify_against_reference_reports_difference(factor, lo, hi, ok):
    ops = _broken(twell_gated_ffn=_scaled_gated_ffn(factor))
    table = ks.verify_ops(ops, [[40, 64, 300, 8, 0.1]], heavy_rows=2, reference=ref, progress=False)
    gated = table["op"] == "fused gated up/down"
    assert table.loc[gated, "vs reference"].between(lo, hi).all(), table[["op", "rows", "vs reference"]]
    assert (table.loc[~gated, "vs reference"] == 0).all()  # the ops left alone match the reference exactly
    assert set(table.loc[gated, "ok"]) == {ok} and set(table.loc[~gated, "ok"]) == {"yes"}


@pytest.mark.parametrize("bad", [[1, 2, 3], [0, 64, 256, 8, 0.1], [8, 64, 256, 300, 0.1], [8, 64, 256, 8, -1],
                                 "256,2048", [8.0, 64, 256, 8, 0.1]])
def test_verify_bad_shapes_raise(bad):
    with pytest.raises(ValueError, match=r"\[M, D, H, nnz, tail\]"):
        ks.verify_ops(ref, [bad], progress=False)


def test_verify_bad_arguments_raise():
    with pytest.raises(ValueError, match="at least one"):
        ks.verify_ops(ref, [], progress=False)
    with pytest.raises(TypeError, match="twell_gated_ffn"):
        ks.verify_ops(types.SimpleNamespace(twell_gate=ref.twell_gate), [[8, 64, 256, 8, 0.1]], progress=False)
    with pytest.raises(ValueError, match="heavy_rows"):
        ks.verify_ops(ref, [[8, 64, 256, 8, 0.1]], heavy_rows=-1, progress=False)
    with pytest.raises(AssertionError, match="empty"):
        ks.assert_verified(ks.pd.DataFrame())


# -- benchmark JSON lookup ---------------------------------------------------------------------------
def _result(timestamp: str, device: str = "cuda", name: str = "NVIDIA H100 80GB HBM3", kind: str = "inference") -> dict:
    return {"meta": {"timestamp": timestamp, "device": device, "device_name": name, "clock": "cuda-events"},
            "complete": True, "cases": [{"case": {"kind": kind}}], "failures": [], "unavailable": {}}


def test_find_bench_json_picks_newest_gpu_result_by_timestamp(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    # File names sort the other way round from the timestamps, so a name/mtime order would pick wrong.
    (a / "ffn-z-old.json").write_text(json.dumps(_result("2026-01-01T00:00:00+00:00")))
    (b / "ffn-a-new.json").write_text(json.dumps(_result("2026-03-01T12:00:00+00:00")))
    (a / "ffn-cpu-newest.json").write_text(json.dumps(_result("2027-01-01T00:00:00+00:00", "cpu", "x86_64")))
    (a / "ffn-broken.json").write_text("{not json")
    (a / "ffn-nometa.json").write_text(json.dumps({"cases": []}))
    (b / "parts-newest.json").write_text(json.dumps(_result("2028-01-01T00:00:00+00:00")))
    # A run of a checkpoint's layers alone has no generator case to show against the bars.
    (b / "ffn-real-newest.json").write_text(json.dumps(_result("2028-01-01T00:00:00+00:00", kind="real")))
    # A quick run below the protocol (10 reps) is not shown as the newest result either.
    quick = _result("2028-01-01T00:00:00+00:00")
    quick["meta"]["config"] = {"reps": 10, "warmup": 3, "flush_l2": True, "energy": True, "energy_seconds": 2.0}
    (b / "ffn-quick-newest.json").write_text(json.dumps(quick))
    assert "10 reps" in ks.BenchRun(quick, None, this_run=False).banner()
    assert ks.find_bench_json([a, b]) == b / "ffn-a-new.json"
    assert ks.find_bench_json([a]) == a / "ffn-z-old.json"
    assert ks.find_bench_json([tmp_path / "missing"]) is None



def test_a_timestamp_without_a_zone_is_read_as_utc(tmp_path):
    (tmp_path / "ffn-aware.json").write_text(json.dumps(_result("2026-03-01T12:00:00+00:00")))
    (tmp_path / "ffn-naive.json").write_text(json.dumps(_result("2026-03-01T13:00:00")))  # written by hand
    assert ks.find_bench_json([tmp_path]) == tmp_path / "ffn-naive.json"


def test_a_near_miss_is_not_shown_as_the_bar(cpu_run):
    """2.1996x at the nnz 29 bar of 2.2x: the table's 4 digits would read 2.2 next to "no"."""
    import copy

    result = copy.deepcopy(cpu_run.result)
    rec = result["cases"][0]
    rec["case"].update(kind="inference", M=65536, D=2048, H=5632, sparsity="nnz29")
    impl = next(iter(rec["impls"]))
    rec["impls"][impl].update(ok=True, speedup=2.1996)
    run = ks.BenchRun(result, None, this_run=True)
    row = ks.speedup_table(run, impl).iloc[0]
    assert row["meets bar"] == "no (2.19960x)"
    rec["impls"][impl]["speedup"] = 2.199996  # 5 decimals would round it up to the bar again
    assert ks.speedup_table(run, impl).iloc[0]["meets bar"] == "no (2.19999x)"
    rec["impls"][impl]["speedup"] = 2.1996
    assert any("2.200x" in line and "met: no (2.19960x)" in line for line in ks.summary_lines(ks.speedup_table(run, impl)))


def test_bench_dirs_include_the_repository_results(tmp_path):
    dirs = ks.bench_dirs(tmp_path / "rep")
    assert dirs == [tmp_path / "rep" / "bench", repo_root() / "reports" / "bench"]
    assert ks.bench_out_dir(tmp_path / "rep") == tmp_path / "rep" / "bench"


def test_earlier_bench_explicit_path_and_errors(tmp_path):
    good = tmp_path / "ffn-good.json"
    good.write_text(json.dumps(_result("2026-05-05T05:05:05+00:00", name="NVIDIA H100 PCIe")))
    run = ks.earlier_bench(good, tmp_path)
    assert run.path == good and not run.this_run
    banner = run.banner()
    assert "NOT IN THIS RUN" in banner and "NVIDIA H100 PCIe" in banner and "2026-05-05T05:05:05+00:00" in banner
    with pytest.raises(FileNotFoundError, match="ffn-missing.json"):
        ks.earlier_bench(tmp_path / "ffn-missing.json")
    cpu = tmp_path / "ffn-cpu.json"
    cpu.write_text(json.dumps(_result("2026-05-05T05:05:05+00:00", "cpu", "x86_64")))
    with pytest.raises(ValueError, match="not on a GPU"):
        ks.earlier_bench(cpu)
    junk = tmp_path / "ffn-junk.json"
    junk.write_text(json.dumps({"meta": {"timestamp": "yesterday"}}))
    with pytest.raises(ValueError, match="not a result of python -m twell.bench ffn"):
        ks.load_bench(junk)


# -- table, summary, figure --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_run():
    """A real (tiny, CPU) harness result: the table must follow the harness's JSON layout."""
    cfg = BenchConfig(device="cpu", shapes="inference", cases=("nnz8", "nnz29-heavy"), Ms=(64,), D=64, H=256,
                      odd_M=37, odd_H=200, reps=2, warmup=0, energy=False, memory=False, fp32_check=False)
    result = BenchRunner(cfg, progress=False).run()
    return ks.BenchRun(json.loads(json.dumps(result, default=str)), None, this_run=True)


def test_speedup_table_follows_the_harness_result(cpu_run):
    table = ks.speedup_table(cpu_run)
    assert len(table) == 4 and list(table["M"]) == [64, 64, 37, 37]
    for (_, row), rec in zip(table.iterrows(), cpu_run.result["cases"]):
        impl = rec["impls"]["twell-reference"]
        assert row["impl"] == "twell-reference"
        assert row["nnz mean"] == rec["sparsity"]["mean_active"] and row["nnz max"] == rec["sparsity"]["max_active"]
        assert math.isclose(row["speedup"], rec["dense"]["timing"]["median_ms"] / impl["timing"]["median_ms"])
        assert row["ceiling"] == rec["ceiling"] and row["rel. error"] == impl["rel_err"]
        assert row["correct"] == "yes"
    # The bar and the published numbers are defined at M = 65536, D = 2048, H = 5632 only.
    assert table["bar"].isna().all() and (table["meets bar"] == "n/a").all() and (table["published"] == "").all()
    assert (table["in this run"] == "yes").all()
    with pytest.raises(ValueError, match="not in the result"):
        ks.speedup_table(cpu_run, impl="no-such-impl")


def test_impl_names_puts_the_default_first_and_skips_training_implementations(cpu_run):
    res = copy.deepcopy(cpu_run.result)
    ref = res["cases"][0]["impls"]["twell-reference"]
    res["cases"][0]["impls"] = {"twell-kernel-union": ref, "twell-reference": ref, "twell-kernel": ref}
    res["cases"].append(copy.deepcopy(res["cases"][1]))
    res["cases"][-1]["case"]["kind"] = "train"
    res["cases"][-1]["impls"] = {"train-only": ref}
    assert ks.impl_names(res) == ["twell-kernel", "twell-kernel-union", "twell-reference"]
    with pytest.raises(ValueError, match="not in the result"):
        ks.speedup_table(ks.BenchRun(res, None, this_run=False), impl="train-only")


def test_meets_bar_needs_speed_and_correctness(cpu_run):
    res = copy.deepcopy(cpu_run.result)
    for rec in res["cases"]:
        rec["case"].update(kind="inference", M=ks.BAR_M, D=2048, H=5632)
    light, heavy = res["cases"][0], res["cases"][1]
    light["impls"]["twell-reference"]["speedup"] = ks.SPEED_BAR["nnz8"] + 0.01
    heavy["impls"]["twell-reference"].update(speedup=ks.SPEED_BAR["nnz29-heavy"] + 1, ok=False)
    res["cases"][2]["impls"]["twell-reference"]["speedup"] = ks.SPEED_BAR["nnz8"] - 0.01
    res["cases"][3]["impls"]["twell-reference"]["speedup"] = ks.SPEED_BAR["nnz29-heavy"]  # exactly at the bar
    table = ks.speedup_table(ks.BenchRun(res, None, this_run=False))
    assert list(table["meets bar"]) == ["yes", "no (wrong or failed)", "no", "yes"]
    assert table["bar"].iloc[0] == ks.SPEED_BAR["nnz8"] and table["bar"].iloc[1] == ks.SPEED_BAR["nnz29-heavy"]
    assert math.isclose(table["published"].iloc[0], 7.13 / 3.16)
    assert table["published"].iloc[1] == ks.PUBLISHED_HEAVY and table["correct"].iloc[1] == "no"
    assert (table["in this run"] == "NO (earlier run)").all()
    lines = "\n".join(ks.summary_lines(table))
    assert "bar met in 2 of 4" in lines and f"{table['speedup'].iloc[0]:.3f}x" in lines


def test_plot_speedup_marks_cases_ceiling_and_provenance(cpu_run, tmp_path):
    table = ks.speedup_table(cpu_run)
    fig = ks.plot_speedup(table, cpu_run)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    ys = sorted(round(line.get_ydata()[0], 9) for line in ax.lines
                if len(line.get_ydata()) == 2 and line.get_ydata()[0] == line.get_ydata()[1])
    assert round(float(table["ceiling"].median()), 9) in ys and 1.0 in ys  # ceiling and 1x lines
    stars = [line for line in ax.lines if line.get_marker() == "*" and len(line.get_xdata())]
    assert sum(len(s.get_xdata()) for s in stars) == int((table["case"] == ks.HEAVY_CASE).sum())
    assert "measured in this run" in fig._suptitle.get_text()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("heavy tail" in t for t in labels) and any("published" in t for t in labels)
    (png,) = save_figure(fig, "01_test_speedup", tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    earlier = ks.plot_speedup(table, ks.BenchRun(cpu_run.result, tmp_path / "ffn-x.json", this_run=False))
    assert "NOT IN THIS RUN" in earlier._suptitle.get_text() and "ffn-x.json" in earlier._suptitle.get_text()
    with pytest.raises(ValueError, match="non-empty"):
        ks.plot_speedup(table.iloc[:0], cpu_run)


VALUE_LABEL = re.compile(r"(\S+: )?\d+\.\d\dx")  # a speedup label: "2.74x", "layer1: 2.96x"


def _value_label_boxes(fig):
    """Display boxes of the figure's speedup labels ("2.74x", "layer1: 2.96x")."""
    renderer = FigureCanvasAgg(fig).get_renderer() if not isinstance(fig.canvas, FigureCanvasAgg) else fig.canvas.get_renderer()
    fig.draw_without_rendering()
    texts = [t for t in fig.axes[0].texts if VALUE_LABEL.fullmatch(t.get_text())]
    return [t.get_window_extent(renderer) for t in texts]


def _overlapping(boxes):
    return [(i, j) for i in range(len(boxes)) for j in range(i) if boxes[i].overlaps(boxes[j])]


def _assert_labels_clear(fig):
    """No value label on another, on a caption or the legend, or outside the axes."""
    boxes = _value_label_boxes(fig)
    assert not _overlapping(boxes)
    ax, renderer = fig.axes[0], fig.canvas.get_renderer()
    others = [t.get_window_extent(renderer) for t in ax.texts
              if not VALUE_LABEL.fullmatch(t.get_text())]
    others.append(ax.get_legend().get_window_extent(renderer))
    frame = ax.get_window_extent(renderer)
    for b in boxes:
        assert not any(b.overlaps(o) for o in others)
        assert frame.x0 - 1 <= b.x0 and b.x1 <= frame.x1 + 1 and frame.y0 - 1 <= b.y0 and b.y1 <= frame.y1 + 1
    return boxes


def test_plot_speedup_labels_do_not_overlap_where_curves_coincide(cpu_run):
    table = ks.speedup_table(cpu_run)
    # Four curves of other M with the same speedups: every label wants the same place.
    same = pd.concat([table.assign(M=table["M"] + k) for k in range(4)], ignore_index=True)
    fig = ks.plot_speedup(same, cpu_run)
    boxes = _assert_labels_clear(fig)
    assert len(boxes) == len(same)  # no M = 65536 in the run: every point is labelled
    # The labels stay near their points (within the placement's reach plus the usual offset).
    ax = fig.axes[0]
    for t in (t for t in ax.texts if t.get_text().endswith("x")):
        y_point = ax.transData.transform(t.xy)[1]
        box = t.get_window_extent(fig.canvas.get_renderer())
        assert abs((box.y0 + box.y1) / 2 - y_point) < 130


def test_plot_speedup_labels_of_the_table_of_record_do_not_overlap():
    """Notebook 01's figure: the table of record, every implementation in it."""
    run = ks.earlier_bench(_record_json())
    table = ks.speedup_table(run)
    others = [ks.speedup_table(run, name) for name in ks.impl_names(run.result)[1:]]
    assert others, "the table of record holds both implementations"
    boxes = _assert_labels_clear(ks.plot_speedup(table, run, others=others))
    assert len(boxes) == int(((table["shape"] == "inference") & (table["M"] == ks.BAR_M)).sum()) == len(ks.SPEED_BAR)


# The table of record has no real layers; this committed run mixes them into the generator cases.
REAL_JSON = REPO_BENCH / "ffn-NVIDIA-H100-80GB-HBM3-20261125T152554Z-full-real-s29-H100.json"


def test_plot_speedup_labels_of_a_full_run_with_real_layers_do_not_overlap():
    assert REAL_JSON.is_file(), f"{REAL_JSON} (committed, with real layers) is missing"
    run = ks.earlier_bench(REAL_JSON)
    table = ks.speedup_table(run)
    others = [ks.speedup_table(run, name) for name in ks.impl_names(run.result)[1:]]
    fig = ks.plot_speedup(table, run, others=others)
    boxes = _assert_labels_clear(fig)
    # The M = 65536 curve (the bar's shape) and every real layer, both implementations, carry values.
    n_real = sum(int((t["shape"] == "real").sum()) for t in (table, *others))
    assert len(boxes) == int(((table["shape"] == "inference") & (table["M"] == ks.BAR_M)).sum()) + n_real
    # Real layers near the ceiling caption and at the right edge: labels keep clear of both.
    edge = table.copy()
    real = edge["shape"] == "real"
    edge.loc[real, "speedup"] = [3.5, 3.53, 3.57, 3.6][:int(real.sum())]
    edge.loc[real, "nnz mean"] = [62.0, 63.5, 64.5, 65.0][:int(real.sum())]
    _assert_labels_clear(ks.plot_speedup(edge, run, others=others))


def test_notebook_01_shows_the_table_of_record():
    """The newest protocol-compliant run in reports/bench is the one the README calls the table of record."""
    assert ks.find_bench_json([REPO_BENCH]) == _record_json()


def test_table_of_record_speedups_match_its_json_and_the_readme():
    run = ks.earlier_bench(_record_json())
    table = ks.speedup_table(run)
    at_bar = table[(table["shape"] == "inference") & (table["M"] == ks.BAR_M)]
    assert set(at_bar["case"]) == set(ks.SPEED_BAR)
    recs = {r["case"]["sparsity"]: r for r in run.result["cases"]
            if r["case"]["kind"] == "inference" and r["case"]["M"] == ks.BAR_M}
    for _, row in at_bar.iterrows():
        assert row["speedup"] == recs[row["case"]]["impls"]["twell-kernel"]["speedup"]
        want = "yes" if row["speedup"] >= ks.SPEED_BAR[row["case"]] and row["correct"] == "yes" else "no"
        assert row["meets bar"].split()[0] == want
    assert "NOT IN THIS RUN" in run.banner() and run.device_name in run.banner()
    # The README's headline: nnz 8 / 29 / 64 and the heavy tail, to two decimals.
    speed = dict(zip(at_bar["case"], at_bar["speedup"]))
    readme = (repo_root() / "README.md").read_text()
    headline = " / ".join(f"{speed[c]:.2f}x" for c in ("nnz8", "nnz29", "nnz64"))
    assert f"**{headline}**" in readme and f"**{speed['nnz29-heavy']:.2f}x**" in readme


def test_committed_speedup_table_is_the_table_of_record(tmp_path):
    """reports/tables/01_kernel_speedup.csv: what notebook 01 makes of the table of record."""
    committed = repo_root() / "reports" / "tables" / "01_kernel_speedup.csv"
    assert committed.is_file(), f"{committed} is not committed"
    run = ks.earlier_bench(_record_json())
    tables = [ks.speedup_table(run, name) for name in ks.impl_names(run.result)]
    csv, _ = save_table(pd.concat(tables, ignore_index=True), "01_kernel_speedup", tmp_path)
    pd.testing.assert_frame_equal(pd.read_csv(committed), pd.read_csv(csv), check_exact=False, rtol=1e-12)


@pytest.mark.gpu
def test_verify_kernels_on_gpu(seed):
    """The notebook's GPU path: the CUDA kernels verified against fp64 and twell.reference."""
    from twell import kernels

    ok, why = kernels.available()
    assert ok, f"kernels unavailable on this GPU machine: {why}"
    shapes = [[777, 320, 1000, 8, 0.1], [1, 64, 256, 8, 0.1], [2000, 2048, 5632, 29, 0.35]]
    table = ks.verify_ops(kernels, shapes, device="cuda", seed=seed % 1000, heavy_rows=5,
                          reference=ref, progress=False)
    ks.assert_verified(table)
    assert (table["vs reference"] < 2e-2).all()
    assert set(table["output poisoned"]) <= {"yes", "no", "n/a"}
