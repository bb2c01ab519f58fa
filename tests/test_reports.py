"""twell.reports: saving figures/tables, and notebook 00's format measurements and pictures."""
from __future__ import annotations

import math
import random

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from twell.formats import HybridStatus, pack_hybrid, pack_twell
from twell.reports import markdown_table, save_figure, save_table
from twell.reports import format_plots as fp
from twell.reports import format_study as fs


def _sparse_bf16(M, H, density, seed, heavy_rows=()):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, H, generator=g).abs() + 0.01
    keep = torch.rand(M, H, generator=g) < density
    for r in heavy_rows:
        keep[r] = torch.rand(H, generator=g) < 0.9
    return (h * keep).to(torch.bfloat16)


# -- saving ----------------------------------------------------------------------------------------
def test_save_figure_png_and_svg(tmp_path):
    fig = Figure()
    fig.subplots().plot([0, 1], [1, 0])
    paths = save_figure(fig, "t_fig", tmp_path, svg=True)
    assert paths == (tmp_path / "figures" / "t_fig.png", tmp_path / "figures" / "t_fig.svg")
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in paths[1].read_bytes()[:2000]
    assert save_figure(fig, "t_fig2", tmp_path) == (tmp_path / "figures" / "t_fig2.png",)


def test_save_uses_twell_reports_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("TWELL_REPORTS", str(tmp_path / "r"))
    (png,) = save_figure(Figure(), "default_dir")
    csv, md = save_table(pd.DataFrame({"a": [1]}), "default_dir")
    assert png.parent == tmp_path / "r" / "figures" and csv.parent == md.parent == tmp_path / "r" / "tables"


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "fig.png", "t.csv", ".hidden", 3])
def test_bad_names_raise(tmp_path, bad):
    with pytest.raises(ValueError, match="plain file stem"):
        save_figure(Figure(), bad, tmp_path)
    with pytest.raises(ValueError, match="plain file stem"):
        save_table(pd.DataFrame({"a": [1]}), bad, tmp_path)


def test_bad_objects_raise(tmp_path):
    with pytest.raises(TypeError, match="matplotlib Figure"):
        save_figure("not a figure", "x", tmp_path)
    with pytest.raises(TypeError, match="pandas DataFrame"):
        save_table({"a": [1]}, "x", tmp_path)
    assert not (tmp_path / "tables" / "x.csv").exists()


def test_save_table_csv_roundtrip_and_markdown(tmp_path, seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    df = pd.DataFrame({"name": [f"r|{i}" for i in range(n)], "x": [rng.random() for _ in range(n)],
                       "k": list(range(n))})
    df.loc[0, "x"] = float("nan")
    csv, md = save_table(df, "t_table", tmp_path)
    back = pd.read_csv(csv)
    pd.testing.assert_frame_equal(back, df)
    lines = md.read_text().splitlines()
    assert lines[0] == "| name | x | k |" and lines[1] == "|:---|---:|---:|"
    assert len(lines) == n + 2
    assert lines[2].startswith("| r\\|0 |  | 0")  # pipe escaped, NaN blank
    if n > 1:
        assert f"{df.loc[1, 'x']:.4g}" in lines[3]
    big = markdown_table(pd.DataFrame({"b": [11264.0, 12044.25, 0.000123456]}))
    assert big.splitlines()[2:] == ["| 11264 |", "| 12044.2 |", "| 0.0001235 |"]
    # Values that round up to 10**digits keep their digits instead of turning into "1e+04".
    edge = markdown_table(pd.DataFrame({"b": [9999.7, 99999.97]}))
    assert edge.splitlines()[2:] == ["| 9999.7 |", "| 100000.0 |"]


# -- format study ------------------------------------------------------------------------------------
def test_toy_activation_has_requested_counts(seed):
    rng = random.Random(seed)
    T = rng.choice([16, 32, 64])
    counts = [[rng.randint(0, T) for _ in range(rng.randint(1, 3))]]
    counts += [[rng.randint(0, T) for _ in counts[0]] for _ in range(rng.randint(0, 6))]
    h = fs.toy_activation(counts, tile=T, seed=rng.randint(0, 999))
    assert h.dtype == torch.bfloat16 and h.shape == (len(counts), len(counts[0]) * T)
    assert (h >= 0).all()
    got = (h != 0).view(len(counts), -1, T).sum(-1)
    assert got.tolist() == counts
    with pytest.raises(ValueError, match="same number of tiles"):
        fs.toy_activation([[1, 2], [1]], tile=T)
    with pytest.raises(ValueError, match=r"in \[0, "):
        fs.toy_activation([[T + 1]], tile=T)


@pytest.mark.parametrize("T,C", [(64, 4), (32, 8), (128, 2), (256, 8)])
def test_word_grid_decodes_the_packed_words(T, C, seed):
    rng = random.Random(seed)
    M, H = rng.randint(1, 13), rng.randint(T // 2, 3 * T + 5)
    h = _sparse_bf16(M, H, rng.uniform(0.02, 0.3), rng.randint(0, 10**6), heavy_rows=[M - 1])
    t = pack_twell(h, tile=T, compression=C)
    g = fs.word_grid(t)
    S = T // C
    assert g["kind"].shape == (M, t.n_tiles * S)
    assert (g["kind"][:, ::S] == 0).all()  # word 0 of each tile is the count
    true_counts = torch.nn.functional.pad(h != 0, (0, t.n_tiles * T - H)).view(M, t.n_tiles, T).sum(-1)
    assert torch.equal(g["count"], true_counts.to(g["count"].dtype))
    n_entries = (g["kind"] == 1).view(M, t.n_tiles, S).sum(-1)
    assert torch.equal(n_entries, true_counts.clamp(max=S - 1))
    assert torch.equal(g["overflow"], (true_counts > S - 1).any(-1))
    # Every decoded entry is a real nonzero of h at its global column; unused slots carry nothing.
    r, k = (g["kind"] == 1).nonzero(as_tuple=True)
    cols = g["column"][r, k]
    assert torch.equal(torch.div(cols, T, rounding_mode="floor"), k // S)
    assert torch.equal(g["value"][r, k], h[r, cols].float())
    assert torch.isnan(g["value"][g["kind"] != 1]).all() and (g["column"][g["kind"] != 1] == -1).all()
    # Non-overflow rows are rebuilt exactly from the decoded words.
    rebuilt = torch.zeros(M, H)
    rebuilt[r, cols] = g["value"][r, k]
    light = ~g["overflow"]
    assert torch.equal(rebuilt[light], h[light].float())


def test_decode_words_fields(seed):
    h = fs.toy_activation(seed=seed % 1000)
    t = pack_twell(h, tile=64, compression=4)
    row = 3
    df = fs.decode_words(t, row=row, tile=1)
    count = int((h[row, 64:128] != 0).sum())
    assert list(df["kind"]) == ["count"] + ["entry"] * count + ["unused"] * (15 - count)
    entries = df[df["kind"] == "entry"]
    cols = torch.tensor(entries["bits 15..0 (column)"].astype(int).tolist())
    assert ((cols >= 64) & (cols < 128)).all()
    assert entries["value"].tolist() == h[row, cols].float().tolist()
    for word, hi, col in zip(entries["word (hex)"], entries["bits 31..16 (bf16)"], cols.tolist()):
        assert int(word, 16) == (int(hi, 16) << 16) | int(col)
    with pytest.raises(IndexError, match="expected row < 8"):
        fs.decode_words(t, row=8)


def test_measure_formats_counts_bytes_from_objects(seed):
    rng = random.Random(seed)
    M, H = rng.randint(20, 60), rng.randint(300, 700)
    heavy = rng.sample(range(M), k=rng.randint(1, 4))
    h = _sparse_bf16(M, H, 0.01, rng.randint(0, 10**6), heavy_rows=heavy)
    recs = {r["format"]: r for r in fs.measure_formats(h, tiles=(64, 256), compressions=(2, 8), hybrid_width=16)}
    assert recs["dense bf16"]["bytes"] == M * H * 2
    for T in (64, 256):
        for C in (2, 8):
            rec, S = recs[f"TwELL T={T} C={C}"], T // C
            n_tiles = math.ceil(H / T)
            per_tile = torch.nn.functional.pad(h != 0, (0, n_tiles * T - H)).view(M, n_tiles, T).sum(-1)
            n_over = int((per_tile > S - 1).any(-1).sum())
            assert rec["overflow_rows"] == n_over
            assert rec["overflow_tile_rows"] == int((per_tile > S - 1).sum())
            assert rec["tile_rows"] == M * n_tiles
            # packed words + overflow row ids (int64) + dense bf16 copies
            assert rec["bytes"] == M * n_tiles * S * 4 + n_over * (8 + 2 * H)
    hy = recs["hybrid W=16"]
    n_heavy = int(((h != 0).sum(-1) > 16).sum())
    assert hy["heavy_rows"] == n_heavy
    assert hy["hybrid_status"] == ("ok" if n_heavy <= math.ceil(M / 8) else "backup_full")
    # Capacity too small: status says so, and the grown footprint holds every heavy row.
    recs0 = {r["format"]: r for r in fs.measure_formats(h, (64,), (8,), hybrid_width=16, hybrid_capacity=0)}
    assert recs0["hybrid W=16"]["hybrid_status"] == HybridStatus.BACKUP_FULL.value
    assert recs0["hybrid W=16"]["bytes_grown"] == pack_hybrid(h, width=16, capacity=n_heavy).nbytes()


@pytest.fixture(scope="module")
def small_study():
    cases = fs.cases_from([(6, 0.1), (20, 0.1), [6, 0.35]])
    return cases, fs.study_cases(cases, M=48, D=24, H=517, tiles=(64, 128), compressions=(4, 8),
                                 hybrid_width=16, seed=random.randint(0, 999), progress=False)


def test_study_cases_tables(small_study):
    cases, df = small_study
    assert set(df["case"]) == {c.label for c in cases}
    assert len(df) == len(cases) * (1 + 4 + 1)
    dense = df[df["format"] == "dense bf16"]
    assert (dense["vs_dense"] == 1).all() and (dense["bytes_per_token"] == 517 * 2).all()
    tw = df[df["format"].str.startswith("TwELL")]
    assert tw["overflow_row_frac"].between(0, 1).all() and tw["overflow_tile_row_frac"].between(0, 1).all()
    stats = fs.case_table(df)
    assert list(stats["case"]) == [c.label for c in cases]
    assert np.allclose(stats["mean_active"], [6, 20, 6], rtol=0.1)  # the generator hits its target mean
    fp_table = fs.footprint_table(df)
    assert list(fp_table["case"]) == [c.label for c in cases]
    assert {"dense bf16", "TwELL T=64 C=8", "hybrid W=16", "hybrid status"} <= set(fp_table.columns)
    ov = fs.overflow_table(df, [cases[2], cases[0]])
    assert list(dict.fromkeys(ov["case"])) == [cases[2].label, cases[0].label]  # caller's order
    assert len(ov) == 2 * 4
    with pytest.raises(ValueError, match="not measured"):
        fs.overflow_table(df, fs.cases_from([(99, 0.1)]))
    text = fs.overflow_summary(ov, tile=64, compression=8)
    assert "T=64 C=8 (7 entries per tile row)" in text and cases[2].label in text
    with pytest.raises(ValueError, match="no TwELL T=256"):
        fs.overflow_summary(ov, tile=256, compression=8)


def test_cases_from_rejects_bad_pairs():
    assert fs.cases_from([(8, 0.1), [8, 0.1], (29, 0.35)]) == [fs.SparsityCase(8, 0.1), fs.SparsityCase(29, 0.35)]
    with pytest.raises(ValueError, match=r"\(nnz, tail\) pairs"):
        fs.cases_from([(8, 0.1, 3)])


# -- pictures ----------------------------------------------------------------------------------------
def test_plot_tile_packing_marks_overflow_rows(tmp_path, seed):
    h = fs.toy_activation(seed=seed % 1000)
    t = pack_twell(h, tile=64, compression=4)
    fig = fp.plot_tile_packing(h, t)
    ax_packed = fig.axes[1]
    red = [p for p in ax_packed.patches if isinstance(p, Rectangle) and p.get_edgecolor()[:3] == (1.0, 0.0, 0.0)]
    assert len(red) == t.n_overflow_rows == 1
    texts = {x.get_text() for x in ax_packed.texts}
    assert {"21", "11"} <= texts  # row 6's count words, overflow included
    (png,) = save_figure(fig, "tile", tmp_path)
    assert png.stat().st_size > 10_000


def test_plot_footprint_and_overflow(small_study, tmp_path):
    cases, df = small_study
    fig = fp.plot_footprint(df, sweep_tail=0.1)
    assert [a.get_title() for a in fig.axes] == ["T = 64", "T = 128"]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "hybrid W=16, backup M/8" in legend and "tail 0.35,\nsame colours" in legend  # as the study ran
    swept = fp.plot_footprint(df[df["tail"] == 0.1], sweep_tail=0.1)  # no off-sweep cases: no star entry
    assert not any("tail" in t.get_text() for t in swept.legends[0].get_texts())
    ov = fs.overflow_table(df, cases)
    fig2 = fp.plot_overflow(ov)
    assert len(fig2.axes) == 2
    assert [t.get_text() for t in fig2.axes[0].get_yticklabels()] == [c.label for c in cases]
    n_cells = len(cases) * 4
    assert len(fig2.axes[0].texts) == n_cells and len(fig2.axes[1].texts) == n_cells
    for f, name in ((fig, "fp"), (fig2, "ov")):
        (png,) = save_figure(f, name, tmp_path)
        assert png.stat().st_size > 10_000
