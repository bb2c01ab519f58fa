"""``python -m twell.bench decode`` on CPU: the same code as on a GPU (reference in place of the kernels), its
files, its report and its exit status."""
from __future__ import annotations

import json
import sys

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


def test_record_holds_the_run_environment_and_marks_a_dirty_tree(tmp_path, monkeypatch):
    from twell.bench import provenance as pv
    from twell.bench.decode import markdown_report, run_decode_bench, write_outputs

    cfg = DecodeBenchConfig(rows=(1,), cases=("nnz8",), D=128, H=300, reps=2, warmup=0, device="cpu")
    state = {"repository": True, "dirty": False, "changed": [], "changed_count": 0, "diff_digest": None}
    monkeypatch.setattr(pv, "tree_state", lambda root=None: dict(state))
    monkeypatch.setattr(sys, "argv", ["python -m twell.bench", "decode", "--M", "1"])
    clean = run_decode_bench(cfg, progress=False)
    meta = clean["meta"]
    assert meta["command"] == "'python -m twell.bench' decode --M 1" and meta["allow_dirty"] is False
    for key in ("timestamp", "host", "python", "torch", "cuda", "device", "device_name", "code"):
        assert key in meta, key
    assert meta["code"]["dirty"] is False and "LOCAL CHANGES" not in markdown_report(clean)
    assert pv.code_line(meta["code"]) in markdown_report(clean)
    state.update(dirty=True, changed=["?? scratch.py"], changed_count=1, diff_digest="e" * 16)
    dirty = run_decode_bench(cfg, progress=False, allow_dirty=True)
    jpath, mpath = write_outputs(dirty, tmp_path)
    saved = json.loads(jpath.read_text())["meta"]
    assert saved["allow_dirty"] is True and saved["code"]["dirty"] is True and saved["code"]["diff_digest"] == "e" * 16
    assert "> LOCAL CHANGES (allowed by allow_dirty): 1 paths" in mpath.read_text()


@pytest.mark.parametrize("gate", ["fatrelu", "drelu"])
def test_gate_variants_keep_the_case_activity_and_are_checked_against_their_dense(tmp_path, gate):
    """FATReLU keeps the case's activity (the gate bias moves by the threshold); dReLU keeps the gate's and makes
    about up_active of the up values positive; the op's answer is checked against the variant's dense layer, and
    the paths that cannot run the variant are skipped with the reason."""
    from twell.bench.decode import run_decode_bench

    cfg = DecodeBenchConfig(rows=(1, 8), cases=("nnz60",), D=128, H=600, reps=1, warmup=0, device="cpu",
                            energy_rows=(), gate=gate, threshold=0.2, up_active=0.3)
    res = run_decode_bench(cfg, progress=False, allow_dirty=True)
    assert res["failures"] == []
    for r in res["rows"]:
        assert r["gate"] == gate and "twell-kernel" in r["skipped"] and "auto" not in r["skipped"]
        assert r["impls"]["decode-kernel (reference)"]["rel_err"] < 1e-2
        assert r["impls"]["auto"]["rel_err"] < 1e-2  # the layer's own path with the variant (CPU: the reference)
        if gate == "fatrelu":
            assert 45 <= r["nnz_measured"] <= 75, r["nnz_measured"]
        else:  # positive in both: about 0.3 of the gate's 60
            assert 8 <= r["nnz_measured"] <= 30 and r["union"] <= r["gate_union"], r
    with pytest.raises(ValueError, match="gate"):
        DecodeBenchConfig(gate="silu")
    with pytest.raises(ValueError, match="threshold"):
        DecodeBenchConfig(gate="fatrelu", threshold=-1.0)
