"""``python -m twell.bench decode`` on CPU: the same code as on a GPU (reference in place of the kernels), its
files, its report and its exit status."""
from __future__ import annotations

import json

import pytest

from twell.bench.__main__ import main as bench_main
from twell.bench.decode import DecodeBenchConfig


def test_cli_writes_its_result_and_says_cpu(tmp_path, capsys):
    code = bench_main(["decode", "--M", "1", "40", "--cases", "nnz8", "--D", "128", "--H", "300", "--reps", "2",
                       "--warmup", "0", "--device", "cpu", "--out", str(tmp_path), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "not GPU numbers" in out
    (jpath,) = tmp_path.glob("decode-*.json")
    res = json.loads(jpath.read_text())
    assert [r["M"] for r in res["rows"]] == [1, 40] and res["failures"] == []
    assert "decode-kernel (reference)" in res["rows"][0]["impls"]  # at 1 row; 40 rows is past the op's limit
    assert "decode-kernel" in res["rows"][1]["skipped"]
    assert jpath.with_suffix(".md").read_text() in out


def test_bad_settings_exit_with_an_error():
    with pytest.raises(SystemExit, match="multiple of 64"):
        bench_main(["decode", "--D", "100", "--device", "cpu", "--quiet"])
    with pytest.raises(ValueError, match="unknown case"):
        DecodeBenchConfig(cases=("nnz",))
    with pytest.raises(ValueError, match="unknown case"):
        DecodeBenchConfig(cases=("nnz0",))
    with pytest.raises(ValueError, match="more active neurons than H"):
        DecodeBenchConfig(cases=("nnz400",), H=300)


def test_cases_beyond_the_defaults(tmp_path):
    """"nnz<N>" asks the generator for N active neurons per row (here 40 of 300)."""
    code = bench_main(["decode", "--M", "1", "4", "--cases", "nnz40", "--D", "128", "--H", "300", "--reps", "2",
                       "--warmup", "0", "--device", "cpu", "--out", str(tmp_path), "--quiet"])
    (jpath,) = tmp_path.glob("decode-*.json")
    rows = json.loads(jpath.read_text())["rows"]
    assert code == 0 and [(r["case"], r["nnz_target"]) for r in rows] == [("nnz40", 40.0)] * 2
    assert all(30 <= r["nnz_measured"] <= 50 for r in rows), [r["nnz_measured"] for r in rows]
