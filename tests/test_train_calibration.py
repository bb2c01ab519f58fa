"""The training route's threshold from timings (twell.train.calibration) and the trainer's auto settings."""
from __future__ import annotations

import pytest
import torch

from twell.train.calibration import calibrate, choose_max_active
from twell.train.config import RunConfig


def _pts(*speedups, H=1000):
    return [{"nnz": 10 * (i + 1), "active": 10 * (i + 1) / H, "speedup": s} for i, s in enumerate(speedups)]


def test_threshold_is_the_last_faster_point_before_any_slower_one():
    assert choose_max_active(_pts(3.0, 2.0, 1.3, 0.9, 0.8)) == pytest.approx(0.03)
    # a faster point past a slower one is not taken: the op would run across a slower activity
    assert choose_max_active(_pts(2.0, 0.95, 1.2, 0.8)) == pytest.approx(0.01)
    assert choose_max_active(_pts(0.9, 1.5)) == 0.0
    assert choose_max_active(_pts(1.04, 1.02), margin=1.05) == 0.0
    assert choose_max_active(list(reversed(_pts(1.5, 1.2, 1.1)))) == pytest.approx(0.03)  # any order
    assert choose_max_active([]) == 0.0


def test_calibrate_times_each_point_and_never_chooses_a_slower_one():
    """On CPU with the reference op (the timings mean nothing here; the bookkeeping is what is tested)."""
    cal = calibrate(32, 1024, 64, "cpu", impl="reference", ladder=(8, 29, 64), reps=2, warmup=1)
    assert [p["nnz"] for p in cal.points] == [1, 5, 12]  # scaled from H 5632 to 1024
    for p in cal.points:
        assert p["dense_ms"] > 0 and p["sparse_ms"] > 0
        assert p["speedup"] == pytest.approx(p["dense_ms"] / p["sparse_ms"])
    assert all(p["speedup"] > 1 for p in cal.points if p["active"] <= cal.max_active)
    assert cal.max_active == choose_max_active(cal.points)
    d = cal.as_dict()
    assert d["why"] and d["rows"] == 64 and len(d["points"]) == 3


def test_calibrate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="impl"):
        calibrate(32, 256, 64, "cpu", impl="fast")
    with pytest.raises(ValueError, match="positive"):
        calibrate(32, 256, 0, "cpu", impl="reference")


def _cfg(**train):
    return RunConfig.from_dict({"name": "t", "model": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                                                       "num_layers": 1, "num_heads": 2, "num_kv_heads": 2},
                                "train": {"steps": 1, "seq_len": 16, "global_batch": 2, "micro_batch": 2, **train}})


def test_auto_is_the_default_of_compile_and_of_the_threshold_and_other_names_fail():
    t = _cfg().train
    assert t.compile == "auto" and t.sparse_max_active == "auto"
    assert _cfg(compile=False).train.compile is False and _cfg(sparse_max_active=0.01).train.sparse_max_active == 0.01
    assert _cfg(sparse_max_active="2e-3").train.sparse_max_active == pytest.approx(0.002)
    with pytest.raises(ValueError, match="train.compile"):
        _cfg(compile="yes").validate()
    with pytest.raises(ValueError, match="sparse_max_active"):
        _cfg(sparse_max_active="fast").validate()
    with pytest.raises(ValueError, match="sparse_max_active"):
        _cfg(sparse_max_active=1.5).validate()


@pytest.mark.gpu
def test_timed_threshold_on_the_gpu_picks_no_point_measured_slower():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from twell import kernels

    ok, why = kernels.available()
    if not ok:
        pytest.skip(why)
    cal = calibrate(2048, 5632, 16384, "cuda", ladder=(8, 29, 64, 160), reps=5)
    assert all(p["speedup"] > 1 for p in cal.points if p["active"] <= cal.max_active)
    assert cal.max_active == choose_max_active(cal.points)
    # at 8 of 5632 the op measured 2.6-3.5x dense at these rows (docs/routing.md), at 160 far slower
    assert cal.max_active >= 8 / 5632
    assert cal.points[-1]["speedup"] < 1 and cal.max_active < 160 / 5632


def test_the_band_that_keeps_a_layer_sparse_ends_short_of_the_first_slower_point():
    from twell.train.calibration import Calibration

    cal = Calibration(rows=1, D=1, H=1000, compiled_dense=False, impl="kernel", points=_pts(2.0, 1.5, 0.9, 0.8))
    cal.max_active = choose_max_active(cal.points)
    assert cal.max_active == pytest.approx(0.02) and cal.keep_max == pytest.approx(0.025)  # 1.25 x: short of 0.03
    cal = Calibration(rows=1, D=1, H=1000, compiled_dense=False, impl="kernel",
                      points=[{"nnz": n, "active": n / 1000, "speedup": s} for n, s in ((40, 1.2), (44, 0.9))])
    cal.max_active = choose_max_active(cal.points)
    assert cal.keep_max == pytest.approx(0.042) and cal.keep_max < 0.044  # halfway to the slower point
    cal.points = [{"nnz": 40, "active": 0.04, "speedup": 1.2}]
    assert cal.keep_max == pytest.approx(0.05)  # nothing slower measured above: the default band


def test_sparse_training_keeps_its_band_and_checks_it():
    from twell.nn.sparse_training import SparseTraining

    assert SparseTraining(max_active=0.01).keep_max == pytest.approx(0.0125)
    assert SparseTraining(max_active=0.01, keep_max=0.011).keep_max == 0.011
    with pytest.raises(ValueError, match="keep_max"):
        SparseTraining(max_active=0.01, keep_max=0.005)


def test_a_resumed_run_reads_back_its_timing(tmp_path):
    import json

    from twell.train.calibration import Calibration

    path = tmp_path / "metrics.jsonl"
    assert Calibration.from_metrics(path, rows=8192, D=2048, H=5632, compiled_dense=True) is None
    first = Calibration(rows=8192, D=2048, H=5632, compiled_dense=True, impl="kernel", points=_pts(2.0, 0.9, H=5632))
    first.max_active = choose_max_active(first.points)
    other = Calibration(rows=16384, D=2048, H=5632, compiled_dense=True, impl="kernel", points=_pts(3.0, H=5632),
                        max_active=10 / 5632)
    lines = [{"kind": "train", "step": 1}, {"kind": "event", "step": 0, "event": "ffn-calibration", **first.as_dict()},
             {"kind": "event", "step": 0, "event": "ffn-calibration", **other.as_dict()}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = Calibration.from_metrics(path, rows=8192, D=2048, H=5632, compiled_dense=True)
    assert got is not None and got.max_active == first.max_active and got.points == first.points
    assert got.keep_max == first.keep_max and got.why == first.why
    assert Calibration.from_metrics(path, rows=8192, D=2048, H=5632, compiled_dense=False) is None  # eager dense


def test_compile_auto_is_on_where_inductor_can_run(monkeypatch):
    import importlib.util

    from twell.train.loop import resolve_compile

    assert resolve_compile(True, torch.device("cpu")) == (True, "")
    assert resolve_compile(False, torch.device("cuda")) == (False, "")
    assert resolve_compile("auto", torch.device("cpu")) == (False, "auto: not on a CPU")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real(name, *a))
    assert resolve_compile("auto", torch.device("cuda")) == (True, "auto")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    on, why = resolve_compile("auto", torch.device("cuda"))
    assert not on and "Triton" in why
