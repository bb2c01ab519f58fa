"""Tests of twell.bench: the calibrated sparsity generator and the FFN benchmark harness (CPU)."""
import json
import math
import random

import pytest
import torch

from twell.bench.generator import (FFNInputs, bisect_bias, calibrated_ffn_inputs, gate_activation,
                                   sparsity_stats)


# ---------------------------------------------------------------- generator
@pytest.mark.parametrize("nnz,tail", [(8, 0.1), (29, 0.1), (64, 0.1), (29, 0.35)])
def test_generator_small_hits_target(nnz, tail):
    M, D, H = random.choice([(1000, 256, 1500), (777, 192, 1111), (2048, 128, 2304)])
    seed = random.randrange(1 << 30)
    inp = calibrated_ffn_inputs(M, D, H, nnz, tail, seed=seed)
    assert isinstance(inp, FFNInputs)
    assert inp.x.shape == (M, D) and inp.w_gate.shape == (H, D)
    assert inp.w_up.shape == (H, D) and inp.w_down.shape == (D, H)
    assert all(t.dtype == torch.bfloat16 for t in (inp.x, inp.w_gate, inp.w_up, inp.w_down))
    assert inp.nnz == nnz and inp.tail == tail and math.isfinite(inp.bias)
    stats = sparsity_stats(gate_activation(inp))
    # bf16 rounding moves a few near-threshold entries; the mean stays within a few percent.
    assert abs(stats["mean_active"] - nnz) / nnz < 0.03, stats
    assert stats["max_active"] >= stats["max_per_tile"] >= 1


@pytest.mark.slow
def test_generator_real_width_hits_target():
    """The real D=2048, H=5632 at M=8192 (the smallest benchmark M)."""
    inp = calibrated_ffn_inputs(8192, 2048, 5632, 29, 0.35, seed=random.randrange(1 << 30))
    stats = sparsity_stats(gate_activation(inp))
    assert abs(stats["mean_active"] - 29) / 29 < 0.02, stats
    assert stats["max_active"] > 200  # heavy tail: rows with hundreds of active neurons


def test_generator_tail_raises_max():
    M, D, H = 2048, 256, 2048
    light = sparsity_stats(gate_activation(calibrated_ffn_inputs(M, D, H, 29, 0.1, seed=3)))
    heavy = sparsity_stats(gate_activation(calibrated_ffn_inputs(M, D, H, 29, 0.35, seed=3)))
    assert abs(light["mean_active"] - heavy["mean_active"]) < 2.0
    assert heavy["max_active"] > 1.5 * light["max_active"], (light, heavy)
    assert heavy["p99_active"] > light["p99_active"]


def test_generator_is_deterministic_and_seeded():
    a = calibrated_ffn_inputs(300, 64, 500, 8, 0.1, seed=11)
    b = calibrated_ffn_inputs(300, 64, 500, 8, 0.1, seed=11)
    c = calibrated_ffn_inputs(300, 64, 500, 8, 0.1, seed=12)
    assert torch.equal(a.x, b.x) and torch.equal(a.w_gate, b.w_gate) and a.bias == b.bias
    assert not torch.equal(a.x, c.x)
    assert torch.all(a.x[:, 0] == 1)


def test_generator_dtype_and_device_args():
    inp = calibrated_ffn_inputs(64, 32, 96, 4, 0.2, seed=1, device="cpu", dtype=torch.float32)
    assert inp.x.dtype == torch.float32 and inp.x.device.type == "cpu"
    h = gate_activation(inp)
    assert h.shape == (64, 96) and h.dtype == torch.float32 and bool((h >= 0).all())


@pytest.mark.parametrize("bad", [dict(nnz=0), dict(nnz=96), dict(tail=-1.0), dict(M=0), dict(D=1)])
def test_generator_rejects_bad_args(bad):
    kw = dict(M=64, D=32, H=96, nnz=4, tail=0.1)
    kw.update(bad)
    with pytest.raises(ValueError):
        calibrated_ffn_inputs(**kw)


def test_bisect_bias_exact_count():
    z = torch.randn(4001, 513)
    target = random.randint(1, z.numel() - 1)
    b = bisect_bias(z, target)
    assert abs(int((z > b).sum()) - target) <= 1


def test_sparsity_stats_known_pattern():
    h = torch.zeros(3, 600, dtype=torch.bfloat16)
    h[0, :40] = 1.0          # 40 active, all in tile 0 (> 31 slots -> overflow row)
    h[1, 250:262] = 2.0      # 12 active straddling tiles 0 and 1 (6 + 6)
    h[2, 599] = 0.5          # last, partial tile
    s = sparsity_stats(h, tile=256, compression=8)
    assert s["mean_active"] == pytest.approx((40 + 12 + 1) / 3)
    assert s["max_active"] == 40 and s["min_active"] == 1
    assert s["max_per_tile"] == 40
    assert s["overflow_rows"] == 1 and s["overflow_tiles"] == 1 and s["twell_slots"] == 31
    with pytest.raises(ValueError):
        sparsity_stats(torch.zeros(4))


# ---------------------------------------------------------------- harness (CPU, tiny shapes)
from twell.bench import ffn as bench_ffn  # noqa: E402
from twell.bench.__main__ import main as bench_main  # noqa: E402
from twell.bench.registry import ImplUnavailable, Registry, default_registry  # noqa: E402
from twell.bench.timing import Timing, run_for, time_alternating  # noqa: E402


def _tiny_cfg(tmp_path, **kw):
    base = dict(device="cpu", shapes="inference", cases=("nnz8", "nnz29-heavy"), Ms=(96,), D=64, H=320,
                odd_M=37, odd_H=300, train_M=64, impls=(), reps=3, warmup=1, energy=False, fp32_check=False,
                out=tmp_path)
    base.update(kw)
    return bench_ffn.BenchConfig(**base)


def _masked_ffn(x, w_gate, w_up, w_down_t):
    """A correct 'sparse' implementation written differently from the dense baseline (fp32 math)."""
    h = torch.relu(x.float() @ w_gate.float().t())
    return ((h * (x.float() @ w_up.float().t())) @ w_down_t.float()).to(torch.bfloat16)


def _registry(**impls):
    reg = Registry()
    for name, fn in impls.items():
        reg.register_fn(name, fn)
    return reg


def test_harness_correct_impl_passes_and_writes_outputs(tmp_path):
    cfg = _tiny_cfg(tmp_path, impls=("masked",))
    result = bench_ffn.BenchRunner(cfg, registry=_registry(masked=_masked_ffn), progress=False).run()
    assert result["failures"] == [] and bench_ffn.exit_code(result) == 0
    assert len(result["cases"]) == 4  # 1 M x 2 sparsities + odd shape x 2
    for rec in result["cases"]:
        r = rec["impls"]["masked"]
        assert r["ok"] and r["rel_err"] < 1e-2 and r["nonfinite"] == 0
        assert r["speedup"] == pytest.approx(rec["dense"]["timing"]["median_ms"] / r["timing"]["median_ms"])
        assert rec["gate"]["timing"]["median_ms"] > 0 and rec["ceiling"] > 0
        assert rec["dense"]["timing"]["reps"] == 3
        assert abs(rec["sparsity"]["mean_active"] - rec["case"]["nnz"]) / rec["case"]["nnz"] < 0.1
    odd = [r for r in result["cases"] if r["case"]["kind"] == "odd"]
    assert odd and all(r["case"]["M"] % 256 and r["case"]["H"] % 256 for r in odd)
    jpath, mpath = bench_ffn.write_outputs(result, tmp_path, tag="t")
    data = json.loads(jpath.read_text())
    for key in ("timestamp", "device_name", "torch", "cuda", "config", "clock", "protocol"):
        assert key in data["meta"]
    assert "NOT the benchmark protocol" in data["meta"]["protocol"]
    md = mpath.read_text()
    assert "| masked |" in md and "FAIL" not in md and "NOT the benchmark protocol" in md
    assert "gate GEMM ms (floor)" in md and "ceiling" in md


@pytest.mark.parametrize("kind", ["scaled", "drops_heavy_rows", "nan", "raises", "wrong_shape"])
def test_harness_flags_wrong_impl(tmp_path, kind):
    def wrong(x, w_gate, w_up, w_down_t):
        out = _masked_ffn(x, w_gate, w_up, w_down_t)
        if kind == "scaled":
            return out * 1.05
        if kind == "drops_heavy_rows":  # like a kernel that mishandles overflow rows
            h = torch.relu(x.float() @ w_gate.float().t())
            out[(h > 0).sum(1) > 60] = 0
            return out
        if kind == "nan":
            out[-1, -1] = float("nan")
            return out
        if kind == "raises":
            raise RuntimeError("kernel launch failed")
        return out[:, :-1]

    cfg = _tiny_cfg(tmp_path, impls=("good", "wrong"), cases=("nnz29-heavy",), Ms=(400,), D=64, H=1024)
    reg = _registry(good=_masked_ffn, wrong=wrong)
    result = bench_ffn.BenchRunner(cfg, registry=reg, progress=False).run()
    assert bench_ffn.exit_code(result) == 1
    assert result["failures"] and all(": wrong:" in f for f in result["failures"])
    for rec in result["cases"]:
        assert rec["impls"]["good"]["ok"]
        assert not rec["impls"]["wrong"]["ok"]
    md = bench_ffn.markdown_report(result)
    assert "CORRECTNESS FAILURES" in md and "**FAIL**" in md
    if kind == "raises":
        assert "kernel launch failed" in md


def test_harness_unavailable_impl_exit_code(tmp_path):
    def factory():
        raise ImplUnavailable("needs an H100")

    reg = Registry()
    reg.register("kernel", factory)
    cfg = _tiny_cfg(tmp_path, impls=("kernel", "nonexistent"), shapes="odd", cases=("nnz8",))
    runner = bench_ffn.BenchRunner(cfg, registry=reg, progress=False)
    assert "needs an H100" in runner.unavailable["kernel"] and "unknown" in runner.unavailable["nonexistent"]
    result = runner.run()
    assert result["failures"] == [] and bench_ffn.exit_code(result) == 2
    assert "needs an H100" in bench_ffn.markdown_report(result)


def test_harness_training_cases(tmp_path):
    def good(x, w_gate, w_up, w_down):
        h = torch.relu(x @ w_gate.t()) * (x @ w_up.t())  # the recipe's hidden activation
        return h @ w_down.t(), h.abs().sum(-1, dtype=torch.float32).mean()

    def bad_l1(x, w_gate, w_up, w_down):
        out, l1 = good(x, w_gate, w_up, w_down)
        return out, 2 * l1  # wrong L1 term: gradients of w_gate change too

    reg = Registry()
    reg.register_fn("good", good, kind="training")
    reg.register_fn("bad", bad_l1, kind="training")
    cfg = _tiny_cfg(tmp_path, shapes="train", cases=("nnz29",), train_impls=("good", "bad"))
    result = bench_ffn.BenchRunner(cfg, registry=reg, progress=False).run()
    (rec,) = result["cases"]
    assert rec["case"]["kind"] == "train" and rec["case"]["M"] == 64
    assert rec["impls"]["good"]["ok"], rec["impls"]["good"]
    assert not rec["impls"]["bad"]["ok"] and rec["impls"]["bad"]["rel_err_parts"]["l1"] > 0.5
    assert rec["dense"]["timing"]["median_ms"] > 0
    assert bench_ffn.exit_code(result) == 1
    assert "Training FFN" in bench_ffn.markdown_report(result)


def test_harness_reference_impl(tmp_path):
    """The registered pure-PyTorch TwELL reference passes the protocol, heavy tail and odd shape included."""
    cfg = _tiny_cfg(tmp_path, impls=("twell-reference",), cases=("nnz29", "nnz29-heavy"), Ms=(300,), H=600,
                    fp32_check=True)
    partials = []
    result = bench_ffn.BenchRunner(cfg, registry=default_registry(), progress=False).run(on_case=partials.append)
    assert result["unavailable"] == {} and result["complete"]
    assert result["failures"] == [], result["failures"]
    assert any(r["sparsity"]["overflow_rows"] > 0 for r in result["cases"])  # overflow path exercised
    for r in result["cases"]:
        # Context numbers: both bf16 computations sit well inside the tolerance of an fp32 FFN.
        assert r["dense"]["rel_err_vs_fp32"] < 1e-2 and r["impls"]["twell-reference"]["rel_err_vs_fp32"] < 1e-2
    assert [len(p["cases"]) for p in partials] == list(range(1, len(result["cases"])))
    assert not partials[0]["complete"] and "PARTIAL RESULTS" in bench_ffn.markdown_report(partials[0])


def test_default_registry_kernel_unavailable_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(ImplUnavailable, match="CUDA"):
        default_registry().resolve("twell-kernel")


def test_registry_rejects_duplicates_and_bad_kind():
    reg = Registry()
    reg.register_fn("a", _masked_ffn)
    with pytest.raises(ValueError):
        reg.register_fn("a", _masked_ffn)
    with pytest.raises(ValueError):
        reg.register_fn("b", _masked_ffn, kind="bogus")
    with pytest.raises(ValueError, match="reserved"):
        reg.register_fn("dense", _masked_ffn)


def test_cli_writes_json_and_markdown(tmp_path, capsys):
    code = bench_main(["ffn", "--shapes", "odd", "--cases", "nnz8", "--D", "64", "--odd-M", "45", "--odd-H", "200",
                       "--reps", "2", "--out", str(tmp_path), "--quiet", "--tag", "cli"])
    assert code == 0
    js, mds = list(tmp_path.glob("ffn-*-cli.json")), list(tmp_path.glob("ffn-*-cli.md"))
    assert len(js) == 1 and len(mds) == 1
    data = json.loads(js[0].read_text())
    assert data["cases"][0]["impls"]["twell-reference"]["ok"]
    assert "| odd nnz8 |" in capsys.readouterr().out


def test_cli_unknown_impl_exits_nonzero(tmp_path):
    code = bench_main(["ffn", "--shapes", "odd", "--cases", "nnz8", "--D", "64", "--odd-M", "20", "--odd-H", "100",
                       "--reps", "1", "--out", str(tmp_path), "--quiet", "--impl", "no-such-impl"])
    assert code == 2


def test_build_cases_and_bad_names():
    cfg = bench_ffn.BenchConfig(device="cpu").resolved()
    cases = bench_ffn.build_cases(cfg)
    kinds = [c.kind for c in cases]
    assert kinds.count("inference") == 4 * len(cfg.Ms) and kinds.count("odd") == 4 and kinds.count("train") == 4
    assert all(c.M % 256 and c.H % 256 for c in cases if c.kind == "odd")
    with pytest.raises(ValueError, match="unknown cases"):
        bench_ffn.build_cases(bench_ffn.BenchConfig(device="cpu", cases=("nnz7",)).resolved())
    with pytest.raises(ValueError, match="shapes"):
        bench_ffn.build_cases(bench_ffn.BenchConfig(device="cpu", shapes="everything").resolved())


def test_protocol_shapes_on_cuda_config():
    cfg = bench_ffn.BenchConfig(device="cuda").resolved()
    assert cfg.Ms == (8192, 65536, 131072) and (cfg.D, cfg.H) == (2048, 5632) and cfg.train_M == 16384
    assert cfg.odd_M % 256 and cfg.odd_H % 256 and cfg.reps >= 30 and cfg.impls == ("twell-kernel",)


def test_time_alternating_cpu_order_and_stats():
    order = []
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    res = time_alternating(fns, "cpu", reps=5, warmup=2)
    assert order == ["a", "b"] * 7  # warm-up and timed calls alternate
    assert set(res) == {"a", "b"} and all(isinstance(t, Timing) and t.reps == 5 for t in res.values())
    assert res["a"].min_ms <= res["a"].median_ms <= res["a"].max_ms
    with pytest.raises(ValueError):
        time_alternating(fns, "cpu", reps=0)


def test_run_for_counts_every_call_it_makes():
    """The energy meter divides the joules read around run_for by its count: the estimating call
    must be in it."""
    made = []
    calls, seconds = run_for(lambda: made.append(1), "cpu", 0.02)
    assert calls == len(made) >= 2 and seconds >= 0.02


def test_protocol_deviations_and_report_banner(tmp_path):
    full = dict(reps=30, warmup=3, flush_l2=True, energy=True, energy_seconds=2.0, memory=True)
    assert bench_ffn.protocol_deviations(full) == []
    assert bench_ffn.protocol_deviations({**full, "energy": False, "memory": False}) == [
        "energy not measured", "peak memory not measured"]
    got = bench_ffn.protocol_deviations({**full, "reps": 10, "flush_l2": False, "energy_seconds": 0.5})
    assert len(got) == 3 and "10 reps" in got[0] and "L2" in got[1] and "0.5 s" in got[2]
    # A looser tolerance, other shapes on a GPU, and energy asked for but unavailable are deviations too.
    assert bench_ffn.protocol_deviations({**full, "tol": 0.1}) == ["tolerance 0.1 (protocol: 0.01)"]
    gpu = {**full, "device": "cuda", "shapes": "inference", "D": 2048, "H": 5632, "Ms": [8192, 65536]}
    assert bench_ffn.protocol_deviations(gpu) == []
    assert bench_ffn.protocol_deviations({**gpu, "D": 128, "Ms": [256]}) == [
        "D x H = 128 x 5632 (protocol: 2048 x 5632)", "no M = 65536 (the protocol's inference shape)"]
    assert bench_ffn.protocol_deviations({**gpu, "device": "cpu", "D": 128}) == []  # CPU runs say so elsewhere
    assert bench_ffn.run_deviations({"config": gpu, "energy_note": "no NVML"}) == ["energy not measured (no NVML)"]
    cfg = _tiny_cfg(tmp_path, impls=("masked",), cases=("nnz8",))
    result = bench_ffn.BenchRunner(cfg, registry=_registry(masked=_masked_ffn), progress=False).run()
    assert result["meta"]["protocol_deviations"] == ["median of 3 reps (protocol: at least 30)",
                                                     "energy not measured"]
    cfg = _tiny_cfg(tmp_path, impls=("masked",), cases=("nnz8",), energy=True, tol=0.05)
    runner = bench_ffn.BenchRunner(cfg, registry=_registry(masked=_masked_ffn), progress=False)
    runner.meter, runner.energy_note = None, "NVML has no energy counter here"  # as on a GPU without it
    below = runner.run()["meta"]["protocol_deviations"]
    assert "tolerance 0.05 (protocol: 0.01)" in below and "energy not measured (NVML has no energy counter here)" in below
    assert isinstance(result["meta"]["twell_env"], dict)
    result["meta"]["device"] = "cuda:0"  # the banner is for GPU runs (CPU runs carry their own note)
    assert "BELOW THE BENCHMARK.md PROTOCOL: median of 3 reps" in bench_ffn.markdown_report(result)


def test_record_holds_the_run_environment_and_marks_a_dirty_tree(tmp_path, monkeypatch):
    from twell.bench import provenance as pv

    cfg = _tiny_cfg(tmp_path, shapes="odd", cases=("nnz8",), impls=("masked",))
    state = {"repository": True, "dirty": False, "changed": [], "changed_count": 0, "diff_digest": None}
    monkeypatch.setattr(pv, "tree_state", lambda root=None: dict(state))
    clean = bench_ffn.BenchRunner(cfg, registry=_registry(masked=_masked_ffn), progress=False).run()
    meta = clean["meta"]
    for key in ("timestamp", "finished", "host", "python", "torch", "cuda", "device", "device_name", "argv",
                "command", "allow_dirty"):
        assert key in meta, key
    assert {"csrc", "package", "commit", "repository", "dirty", "changed", "diff_digest"} <= set(meta["code"])
    md = bench_ffn.markdown_report(clean)
    assert pv.code_line(meta["code"]) in md and "LOCAL CHANGES" not in md
    state.update(dirty=True, changed=[" M src/twell/x.py"], changed_count=1, diff_digest="d" * 16)
    dirty = bench_ffn.BenchRunner(cfg, registry=_registry(masked=_masked_ffn), progress=False, allow_dirty=True).run()
    assert dirty["meta"]["allow_dirty"] is True and dirty["meta"]["code"]["dirty"] is True
    jpath, mpath = bench_ffn.write_outputs(dirty, tmp_path)
    assert json.loads(jpath.read_text())["meta"]["code"]["changed"] == [" M src/twell/x.py"]
    assert "> LOCAL CHANGES (allowed by allow_dirty): 1 paths" in mpath.read_text()
    assert f"diff digest {'d' * 16}" in mpath.read_text()


def test_harness_fails_an_output_that_missed_the_poison(tmp_path, monkeypatch):
    """An output outside the poisoned blocks could hold a stale right answer: not counted as correct."""
    monkeypatch.setattr(bench_ffn.Poison, "hit", lambda self, out: False)
    cfg = _tiny_cfg(tmp_path, impls=("masked",), cases=("nnz8",))
    result = bench_ffn.BenchRunner(cfg, registry=_registry(masked=_masked_ffn), progress=False).run()
    res = result["cases"][0]["impls"]["masked"]
    assert res["rel_err"] < 1e-2 and not res["ok"] and "poisoned" in res["error"]
    assert bench_ffn.exit_code(result) != 0


def test_rel_error():
    a = torch.randn(50, 7)
    assert bench_ffn.rel_error(a, a) == 0.0
    assert bench_ffn.rel_error(a * 1.01, a) == pytest.approx(0.01, rel=1e-3)
    b = a.clone()
    b[3, 3] = float("nan")
    assert math.isnan(bench_ffn.rel_error(b, a))
    with pytest.raises(ValueError):
        bench_ffn.rel_error(a[:, :6], a)


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_poison_fills_the_free_rest_of_a_cached_segment():
    """A poisoned block carved from a larger cached segment merges, once freed, with the unpoisoned rest of
    that segment; a scratch tensor then takes the front and the output runs into the rest (the likely cause
    of the unverified outputs at M = 131072 on the H100). Every free byte of the cache must be poisoned, and
    no new memory reserved for it."""
    dev = torch.device("cuda")
    n = 64 * 2**20
    torch.cuda.empty_cache()
    seg = torch.zeros(3 * n // 2, dtype=torch.uint8, device=dev)
    # Its own 96 MiB segment: a larger cached one left by earlier tests could hide the old Poison's gap.
    assert [s["total_size"] for s in bench_ffn._snapshot() if s["address"] <= seg.data_ptr() < s["address"]
            + s["total_size"]] == [3 * n // 2]
    del seg  # a free 96 MiB segment of zeros
    poison = bench_ffn.Poison(dev, n, blocks=1)
    scratch = torch.empty(n // 4, dtype=torch.uint8, device=dev)
    out = torch.empty(n, dtype=torch.uint8, device=dev)
    assert poison.hit(out) and bool((out == 255).all())
    del scratch, out
    seg = torch.zeros(3 * n // 2, dtype=torch.uint8, device=dev)
    del seg
    # Free blocks of another stream are not this stream's to take: asking for them would reserve new memory.
    with torch.cuda.stream(torch.cuda.Stream(dev)):
        other = torch.empty(5 * n // 4, dtype=torch.uint8, device=dev)
        del other
    reserved = torch.cuda.memory_reserved(dev)
    bench_ffn.Poison(dev, 0, blocks=0)
    assert torch.cuda.memory_reserved(dev) == reserved
    whole = torch.empty(3 * n // 2, dtype=torch.uint8, device=dev)
    assert bool((whole == 255).all())
    del whole
    # Poisoned memory given back to the driver may come back at the same addresses, unpoisoned: not a hit.
    poison = bench_ffn.Poison(dev, n)
    torch.cuda.empty_cache()
    out = torch.empty(n, dtype=torch.uint8, device=dev)
    assert poison.hit(out) is False


@pytest.mark.gpu
def test_gpu_harness_poison_catches_unwritten_output(tmp_path):
    """On CUDA an implementation that allocates its output but never writes it must read back NaN."""
    def lazy(x, w_gate, w_up, w_down_t):
        return torch.empty(x.shape[0], w_down_t.shape[1], dtype=torch.bfloat16, device=x.device)

    # Outputs above 1 MB (large allocator pool), like every protocol shape.
    cfg = _tiny_cfg(tmp_path, device="cuda", impls=("good", "lazy"), cases=("nnz29",), Ms=(4096,), D=512, H=1536,
                    odd_M=3001, odd_H=1000, energy=True, energy_seconds=0.3)
    # allow_dirty: a test of the harness, run from whatever tree is on the GPU machine, not a record
    result = bench_ffn.BenchRunner(cfg, registry=_registry(good=_masked_ffn, lazy=lazy), progress=False,
                                   allow_dirty=True).run()
    for rec in result["cases"]:
        assert rec["impls"]["good"]["ok"]
        lazy_res = rec["impls"]["lazy"]
        assert lazy_res["poison_hit"] and not lazy_res["ok"] and lazy_res["nonfinite"] > 0
        assert rec["dense"]["timing"]["clock"] == "cuda-events"
        assert rec["dense"]["peak_bytes_above_inputs"] > 0
        if result["meta"]["energy_note"] is None:
            assert rec["dense"]["joules_per_token"] > 0


@pytest.mark.gpu
def test_gpu_generator_device_matches_cpu():
    a = calibrated_ffn_inputs(512, 128, 640, 8, 0.1, seed=5, device="cuda")
    b = calibrated_ffn_inputs(512, 128, 640, 8, 0.1, seed=5, device="cpu")
    assert a.x.is_cuda and torch.equal(a.x.cpu(), b.x) and torch.equal(a.w_gate.cpu(), b.w_gate)



two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@pytest.mark.gpu
@two_gpus
def test_gpu_timing_on_a_second_gpu_times_that_gpu():
    """Events must record on the benchmark's device: recorded on cuda:0 around work queued on cuda:1
    they time nothing."""
    import time

    torch.cuda.set_device(0)
    a = torch.randn(8192, 8192, device="cuda:1", dtype=torch.bfloat16)

    def work():
        for _ in range(4):
            a @ a

    timed = time_alternating({"mm": work}, "cuda:1", reps=5, warmup=1, flush_l2=False)["mm"].median_ms
    torch.cuda.synchronize(1)
    t0 = time.perf_counter()
    for _ in range(5):
        work()
    torch.cuda.synchronize(1)
    wall = (time.perf_counter() - t0) / 5 * 1e3
    assert 0.5 * wall < timed < 1.5 * wall, (timed, wall)
    assert torch.cuda.current_device() == 0


@pytest.mark.gpu
@two_gpus
def test_gpu_benchmark_on_a_second_gpu(tmp_path):
    """The whole harness on cuda:1 (kernels, poison, energy of that card) while cuda:0 is current."""
    torch.cuda.set_device(0)
    cfg = _tiny_cfg(tmp_path, device="cuda:1", impls=("twell-kernel",), cases=("nnz29-heavy",), Ms=(4096,),
                    D=512, H=1536, odd_M=3001, odd_H=1000, energy=True, energy_seconds=0.3)
    result = bench_ffn.BenchRunner(cfg, registry=default_registry(), progress=False, allow_dirty=True).run()
    assert result["failures"] == [] and bench_ffn.exit_code(result) == 0
    for rec in result["cases"]:
        r = rec["impls"]["twell-kernel"]
        assert r["ok"] and r["poison_hit"] and r["timing"]["median_ms"] > 0.01  # output landed in poisoned memory
    try:
        from twell.bench.energy import EnergyMeter, EnergyUnavailable
        meter = EnergyMeter("cuda:1")
    except (ImportError, EnergyUnavailable) as exc:
        pytest.skip(f"no NVML energy counter: {exc}")
    uuid = meter._nvml.nvmlDeviceGetUUID(meter.handle)
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    assert uuid.lower().removeprefix("gpu-") == str(torch.cuda.get_device_properties(1).uuid).lower()


# -- activity statistics (twell.bench.activity) --------------------------------------------------------
def test_union_reuse_extremes_and_a_hand_count():
    from twell.bench.activity import union_reuse

    M, H = 64, 40
    same = torch.zeros(M, H, dtype=torch.bool)
    same[:, [3, 7, 11]] = True  # every token uses the same 3 neurons: a block of B loads 3 rows for 3B pairs
    assert union_reuse(same, (1, 4, 16, 64)) == {1: 1.0, 4: 4.0, 16: 16.0, 64: 64.0}
    disjoint = torch.zeros(M, H * 2, dtype=torch.bool)
    disjoint[torch.arange(M), torch.arange(M)] = True  # no neuron shared by two tokens
    assert union_reuse(disjoint, (4, 64)) == {4: 1.0, 64: 1.0}
    hand = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1], [0, 0, 0, 1], [1, 0, 0, 0]], dtype=torch.bool)
    # blocks of 2: {0,1,2} for 4 pairs, {3} for 2 pairs; the fifth row is left out -> 6 / 4
    assert union_reuse(hand, (2, 8)) == {2: 1.5}
    with pytest.raises(ValueError, match="bool"):
        union_reuse(hand.float())
    with pytest.raises(ValueError, match=">= 1"):
        union_reuse(hand, (0,))


def test_gate_activity_on_random_inputs_matches_a_direct_count():
    from twell.bench.activity import gate_activity

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    M, D, H = int(torch.randint(40, 300, ())), 32, int(torch.randint(100, 700, ()))
    x, w = torch.randn(M, D, generator=g), torch.randn(H, D, generator=g) - 0.3
    stats = gate_activity(x, w, tile=64, blocks=(8, 32))
    act = (x @ w.t()) > 0
    assert stats["mean_active"] == pytest.approx(act.sum(1).float().mean().item())
    assert stats["max_active"] == int(act.sum(1).max())
    per_tile = max(int(act[:, i:i + 64].sum(1).max()) for i in range(0, H, 64))
    assert stats["max_per_tile"] == per_tile
    assert stats["dead_frac"] == pytest.approx((act.sum(0) == 0).float().mean().item())
    for b in (8, 32):
        m = M // b * b
        unions = sum(int(act[i:i + b].any(0).sum()) for i in range(0, m, b))
        assert stats["reuse"][b] == pytest.approx(act[:m].sum().item() / unions, abs=1e-3)


def test_config_refuses_cases_denser_than_H_and_poison_needs_the_whole_output(tmp_path):
    with pytest.raises(ValueError, match=r"cases \['nnz64'\] ask for at least as many active neurons as H=48"):
        bench_ffn.BenchRunner(_tiny_cfg(tmp_path, H=48, cases=("nnz8", "nnz64")), progress=False)
    # An output that starts inside a poisoned block but runs past its end was not all poisoned.
    buf = torch.zeros(64, dtype=torch.uint8)
    poison = bench_ffn.Poison(torch.device("cpu"), 0)
    poison.ranges = [(buf.data_ptr(), buf.data_ptr() + 32)]
    assert poison.hit(buf[:32]) and poison.hit(buf[8:24])
    assert not poison.hit(buf[16:48]) and not poison.hit(buf[40:])
    poison.ranges = [(buf.data_ptr() + 32, buf.data_ptr() + 64), (buf.data_ptr(), buf.data_ptr() + 32)]
    assert poison.hit(buf[16:48])  # two poisoned blocks side by side: the allocator merges them
    # A strided view reaches past numel elements from its start: a column slice of a wider buffer.
    poison.ranges = [(buf.data_ptr(), buf.data_ptr() + 32)]
    wide = buf.view(8, 8)
    assert poison.hit(wide[:4, :4]) and not poison.hit(wide[:, :4]) and not poison.hit(wide[:, :4].t())
