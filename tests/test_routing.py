"""The planner (twell.nn.routing.plan): every case on its own, from a LayerState and an input; and the
module's executor, which records what ran from the Route it ran."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from twell.nn import SparseFFN, routing
from twell.nn.routing import LayerState, Route, ceiling, plan, plan_training
from twell.nn.sparse_training import SparseTraining

BF = torch.bfloat16


def _state(**kw) -> LayerState:
    base = dict(path="auto", hidden_size=64, intermediate_size=128, gated=True, activation="relu", track=False,
                keep_gate=False, backend="none", no_sparse_why="", weight_dtypes=(BF,), no_kernel_why="", no_decode_why="",
                no_train_why="", decode_rows=16, dense_rows=(17, 2047), auto_dense=False, timed=False,
                activity=0.002, activity_text="0.20%", auto_max_active=0.01, ceilings=routing.AUTO_CEILINGS, decode_max_rows=16,
                choice_note=None, train_slots=128)
    base.update(kw)
    return LayerState(**base)


class FakeX:
    """What plan reads of an input: shape, numel, dtype, device. Stands in for a CUDA tensor on CPU."""

    def __init__(self, rows, D=64, dtype=BF, cuda=True):
        self.shape = (rows, D)
        self.dtype = dtype
        self.is_cuda = cuda
        self.device = torch.device("cuda" if cuda else "cpu")

    def numel(self):
        return self.shape[0] * self.shape[1]


def _plan(state, rows, **kw):
    x = FakeX(rows, **{k: kw.pop(k) for k in ("D", "dtype", "cuda") if k in kw})
    return plan(state, x, grad_enabled=kw.pop("grad", False), **kw)


# -- "auto" ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows,op", [(1, "decode"), (16, "decode"), (17, "dense"), (2047, "dense"),
                                     (2048, "sparse"), (65536, "sparse")])
def test_auto_on_a_sparse_layer_by_row_count(rows, op):
    r = _plan(_state(activity=0.002), rows)  # 0.2% active: under every ceiling
    assert r.op == op and r.impl == ("torch" if op == "dense" else "kernel"), r
    assert r.reason and (op != "dense" or "dense_rows" in r.note)
    assert r.checked == (op == "decode")


@pytest.mark.parametrize("activity,rows,op", [
    (0.002, 2048, "sparse"), (0.005, 2048, "dense"), (0.005, 4095, "dense"), (0.005, 4096, "sparse"),
    (0.009, 65536, "sparse"), (0.011, 65536, "dense"), (0.011, 8, "decode")])
def test_auto_activity_ceilings_depend_on_rows(activity, rows, op):
    """Between 2048 and 4096 rows the sparse op beats dense only on sparser layers than at large batch."""
    st = _state(activity=activity, auto_dense=activity > 0.01, decode_max_rows=16, dense_rows=(17, 1023))
    r = _plan(st, rows)
    assert r.op == op, (r, ceiling(rows, 0.01))
    if op == "dense":
        assert "active" in r.reason


def test_ceilings_below_the_first_entry_and_without_any():
    st = _state(activity=0.0001, dense_rows=None)
    assert _plan(st, 1500).op == "dense" and "slower than dense" in _plan(st, 1500).reason
    assert _plan(dataclasses.replace(st, ceilings=()), 1500).op == "sparse"  # auto_max_active alone


def test_ceiling_table():
    assert ceiling(2047, 0.01) < 0 and ceiling(2048, 0.01) == 0.0025 and ceiling(4095, 0.01) == 0.0025
    assert ceiling(4096, 0.01) == 0.01 and ceiling(4096, 0.5) == 0.5 and ceiling(10**6, 0.01) == 0.01
    assert ceiling(2048, 0.001) == 0.001  # auto_max_active caps every ceiling
    assert ceiling(5, 0.02, ()) == 0.02
    assert routing.check_ceilings([(10, 0.5)]) == ((10, 0.5),)
    for bad in ([(10, 0.5), (5, 0.1)], [(0, 0.1)], [(10, 2.0)], "x", [(1,)]):
        with pytest.raises(ValueError, match="auto_ceilings"):
            routing.check_ceilings(bad)


def test_auto_measures_on_the_first_call():
    st = _state(auto_dense=None, activity=None)
    r = _plan(st, 100)  # in dense_rows: measured on the dense path
    assert (r.op, r.measure) == ("dense", True)
    r = _plan(st, 2047)
    assert (r.op, r.measure) == ("dense", True)
    r = _plan(st, 65536)
    assert (r.op, r.impl, r.measure) == ("gate-ffn", "kernel", True)  # the TwELL is needed to count
    r = _plan(st, 4)  # few rows: the TwELL route too, not the decoding op, since it must count
    assert r.op == "gate-ffn" and r.measure
    r = _plan(st, 65536, capturing=True)  # no host read inside a CUDA graph capture
    assert not r.measure and r.op == "sparse" and "captured" in r.note
    r = _plan(st, 100, compiling=True)
    assert r.op == "dense" and not r.measure


def test_auto_on_a_layer_dense_by_activity():
    st = _state(auto_dense=True, activity=0.03, decode_max_rows=9, choice_note="auto: 3% active")
    assert _plan(st, 9).op == "decode" and _plan(st, 10).op == "dense"
    assert _plan(st, 65536).note == "auto: 3% active"
    assert _plan(dataclasses.replace(st, keep_gate=True), 2).op == "dense"  # the decoding op keeps no TwELL
    assert _plan(dataclasses.replace(st, dense_rows=(1, 64)), 2).op == "dense"  # dense_rows wins


def test_auto_timed_choice_skips_the_ceilings():
    st = _state(activity=0.009, timed=True, choice_note="timed by choose_union_paths")
    r = _plan(dataclasses.replace(st, dense_rows=(17, 1023)), 2048)  # above the ceiling; the timings chose sparse
    assert r.op == "sparse" and r.note == "timed by choose_union_paths"


@pytest.mark.parametrize("change,route,why", [
    (dict(activation="silu"), "dense", "relu"),
    (dict(track=True), "dense", "tracking"),
    (dict(no_sparse_why="bias!"), "dense", "bias!"),
    (dict(weight_dtypes=(torch.float32,)), "dense", "bfloat16"),
    (dict(no_kernel_why="kernels unavailable: no nvcc"), "reference", "no nvcc"),
])
def test_auto_leaves_the_kernels_and_says_why(change, route, why):
    r = _plan(_state(**change), 65536)
    assert r.path == ("dense" if route == "dense" else "twell-reference") and why in r.note, r


def test_auto_on_cpu_and_fp32_input():
    r = _plan(_state(), 65536, cuda=False)
    assert r.impl == "reference" and "input on cpu" in r.note
    r = _plan(_state(), 65536, dtype=torch.float32)
    assert r.op == "dense" and "x is torch.float32" in r.note


def test_nongated_and_keep_gate_ops():
    assert _plan(_state(gated=False), 65536).op == "ffn"
    assert _plan(_state(keep_gate=True), 65536).op == "gate-ffn"
    assert _plan(_state(keep_gate=True), 4).op == "gate-ffn"


def test_width_mismatch_raises():
    with pytest.raises(ValueError, match="hidden_size=64"):
        _plan(_state(), 4, D=32)
    with pytest.raises(ValueError, match="hidden_size=64"):
        _plan(_state(path="kernel"), 4, D=32)


# -- explicit paths -------------------------------------------------------------------------------
def test_explicit_dense_and_sparse_paths():
    assert _plan(_state(path="dense"), 4).op == "dense"
    assert _plan(_state(path="kernel"), 4).op == "decode"
    assert not _plan(_state(path="kernel"), 4).checked
    assert _plan(_state(path="kernel"), 65536).op == "sparse"
    assert _plan(_state(path="reference"), 4, cuda=False).path == "twell-reference"


@pytest.mark.parametrize("change,err,match", [
    (dict(activation="silu"), ValueError, "needs activation='relu'"),
    (dict(no_sparse_why="bias!"), ValueError, "cannot run this layer: bias!"),
    (dict(no_kernel_why="kernels unavailable: no nvcc"), RuntimeError, "unavailable: no nvcc"),
    (dict(no_kernel_why="D too wide"), ValueError, "D too wide"),
])
def test_explicit_sparse_path_raises_where_auto_would_leave_it(change, err, match):
    with pytest.raises(err, match=match):
        _plan(_state(path="kernel", **change), 65536)


def test_explicit_sparse_path_with_tracking_takes_the_training_op():
    """Statistics need the hidden state; the training op computes them sparse, so tracking no longer turns
    an explicit sparse path dense."""
    r = _plan(_state(path="reference", track=True), 64, cuda=False)
    assert r.op == "train" and r.impl == "reference"
    with pytest.raises(ValueError, match="tracking.*ReLU-gated"):
        _plan(_state(path="reference", track=True, no_train_why="the training kernels run ReLU-gated layers"), 64)


# -- training -------------------------------------------------------------------------------------
def test_training_without_a_backend():
    assert _plan(_state(path="auto"), 64, grad=True).op == "dense"
    assert _plan(_state(path="dense"), 64, grad=True).training
    r = _plan(_state(path="reference"), 64, grad=True, cuda=False)
    assert (r.op, r.impl, r.training) == ("train", "reference", True)
    with pytest.raises(ValueError, match="path=.kernel.*unavailable"):
        _plan(_state(path="kernel", no_kernel_why="kernels unavailable: CPU-only torch"), 64, grad=True, cuda=False)
    with pytest.raises(ValueError, match="path='kernel'.*input on cpu"):
        _plan(_state(path="kernel"), 64, grad=True, cuda=False)
    assert _plan(_state(backend="custom"), 64, grad=True).op == "backend"


@pytest.mark.parametrize("change,cast,why", [
    (dict(no_train_why="the training kernels run ReLU-gated layers"), None, "ReLU-gated"),
    (dict(weight_dtypes=(torch.float32,)), None, "x is torch.bfloat16"),
    (dict(), torch.float16, "compute in bfloat16, this forward in torch.float16"),
])
def test_plan_training_runs_dense_or_raises(change, cast, why):
    st, x = _state(**change), FakeX(64)
    r = plan_training(st, x, sparse=True, impl="kernel", autocast_dtype=cast)
    assert r.op == "dense" and why.split(",")[0] in r.reason and r.training
    with pytest.raises(ValueError, match="train.sparse_kernels=always"):
        plan_training(st, x, sparse=True, impl="kernel", strict="train.sparse_kernels=always", autocast_dtype=cast)


def test_plan_training_under_autocast_takes_fp32_weights():
    st = _state(weight_dtypes=(torch.float32,))
    r = plan_training(st, FakeX(64, dtype=torch.float32), sparse=True, impl="kernel", autocast_dtype=BF)
    assert r.op == "train"
    r = plan_training(_state(), FakeX(64), sparse=False, impl="kernel", why="0.9% active per token > 0.8%")
    assert r.op == "dense" and "0.9%" in r.reason


def test_route_paths():
    assert Route("dense", "torch", "r").path == "dense"
    assert Route("train", "kernel", "r").path == "train-kernel"
    assert Route("decode", "kernel", "r").path == "twell-kernel"
    assert Route("backend", "torch", "r").path == "train-backend"


# -- the module: plan, run, record ------------------------------------------------------------------
def _layer(D=64, H=128, dtype=BF, seed=0, **kw):
    torch.manual_seed(seed)
    return SparseFFN(D, H, **kw).to(dtype)


def test_module_records_the_route_it_ran():
    f = _layer()
    x = torch.randn(8, 64, dtype=BF)
    with torch.no_grad():
        planned = f.plan(x)
        f(x)
    assert f.last_route == planned and f.last_path == planned.path == "twell-reference"
    assert f.auto_note == planned.note and "input on cpu" in f.auto_note


def test_layer_state_follows_changes_made_without_setters():
    """The cached state sees hooks, a replaced projection, a dtype change and a patched forward."""
    f = _layer()
    x = torch.randn(8, 64, dtype=BF)
    with torch.no_grad():
        assert f.plan(x).impl == "reference"
        h = f.up_proj.register_forward_hook(lambda *a: None)
        assert f.plan(x).op == "dense" and "hooks" in f.plan(x).note
        h.remove()
        assert f.plan(x).impl == "reference"
        f.up_proj.forward = lambda t: t  # a patched forward: the sparse paths would skip it
        assert f.plan(x).op == "dense"
        del f.up_proj.forward
        assert f.plan(x).impl == "reference"
        f.gate_proj = torch.nn.Linear(64, 128, bias=True).to(BF)
        assert "bias" in f.plan(x).note
        g = _layer()
        f.gate_proj = g.gate_proj
        assert f.plan(x).impl == "reference"
        f.float()
        assert "bfloat16" in f.plan(x.float()).note
        f.to(BF)
        f.track = True
        assert "tracking" in f.plan(x).note
        f.track = False
        f.path = "dense"
        assert f.plan(x).op == "dense"
        f.path = "auto"
        f.decode_rows = 0
        assert f.plan(x).impl == "reference"


def test_explicit_reference_path_under_autograd_runs_the_training_op():
    """path='reference' outside no_grad (e.g. in eval() mode without no_grad) runs sparse, never dense:
    the reference training op, whose outputs and gradients match the dense computation."""
    f = _layer()
    g = _layer()
    g.path = "dense"
    f.path = "reference"
    f.eval()
    x = torch.randn(3, 5, 64, dtype=BF, requires_grad=True)
    out = f(x)
    assert f.last_path == "train-reference" and f.last_route.training
    out.float().sum().backward()
    xg = x.detach().clone().requires_grad_(True)
    want = g(xg)
    want.float().sum().backward()
    assert torch.equal(out, want)
    assert torch.equal(x.grad, xg.grad) and torch.equal(f.gate_proj.weight.grad, g.gate_proj.weight.grad)


def test_explicit_kernel_path_under_autograd_on_cpu_raises():
    f = _layer()
    f.path = "kernel"
    x = torch.randn(4, 64, dtype=BF, requires_grad=True)
    with pytest.raises((RuntimeError, ValueError), match="kernel"):
        f(x)
    assert f.last_path is None  # nothing ran


def test_explicit_path_with_tracking_fills_stats_from_the_training_op():
    f = _layer()
    f.path = "reference"
    f.track = True
    x = torch.randn(6, 64, dtype=BF)
    with torch.no_grad():
        out = f(x)
        pre = f.gate_proj(x)
        want = f.down_proj(torch.relu(pre) * f.up_proj(x))
    assert f.last_path == "train-reference" and torch.equal(out, want)
    assert torch.equal(f.stats.active_per_token, (pre > 0).sum(-1, dtype=torch.int32))


def test_sparse_training_on_fp32_reports_the_dense_path_it_ran():
    """The reproduction of a silent fallback: a backend asked to start sparse on an fp32 layer runs dense;
    the route events say so with the reason, and strict (train.sparse_kernels=always) raises."""
    f = _layer(dtype=torch.float32)
    f.track = True
    b = SparseTraining(min_rows=0, impl="reference", start="sparse")
    f.train_backend = b
    f(torch.randn(4, 64, requires_grad=True))
    ev = b.route_events([f])
    assert ev["routes"] == ["sparse"] and ev["ran"] == ["dense"] and "bfloat16" in ev["why"][0]
    f.train_backend = SparseTraining(min_rows=0, impl="reference", start="sparse", strict=True)
    with pytest.raises(ValueError, match="always"):
        f(torch.randn(4, 64, requires_grad=True))


def test_auto_on_the_kernels_route_measures_once_then_plans_from_the_state(monkeypatch):
    """With the kernels' route forced on CPU (the reference op stands in), the first large call measures the
    layer; the next ones take the memoised Route of the new state."""
    import twell.kernels
    from twell import reference

    f = _layer()
    monkeypatch.setattr(routing, "auto_route", lambda state, x: ("kernel", ""))
    for name in ("twell_gate", "twell_gated_ffn", "sparse_gated_ffn"):
        monkeypatch.setattr(twell.kernels, name, getattr(reference, name))
    monkeypatch.setattr(twell.kernels, "misaligned", lambda t: False)
    f.auto_max_active = 1.0
    f.auto_ceilings = ()
    x = torch.randn(4096, 64, dtype=BF)
    with torch.no_grad():
        f(x)
        assert f.last_route.measure and f._activity is not None
        first = f.plan(x)
        assert first.op == "sparse" and not first.measure and f.plan(x) is first
        f(x)
    assert f.last_route is first


def test_layer_state_survives_a_replaced_parameter_and_sees_tiling():
    """A new Parameter object for a weight (load_state_dict(assign=True)) rebuilds the state instead of
    comparing tensors; tile and compression are part of what the state depends on."""
    f = _layer()
    x = torch.randn(8, 64, dtype=BF)
    with torch.no_grad():
        f(x)
        f.load_state_dict({k: v.clone() for k, v in f.state_dict().items()}, assign=True)
        assert f.plan(x).impl == "reference"
        f.up_proj.weight = torch.nn.Parameter(f.up_proj.weight.detach().clone())
        f(x)
    before = f.layer_state()
    f.tile, f.compression = 128, 8
    assert f.layer_state() is not before


def test_training_slots_reach_the_op(monkeypatch):
    import twell.reference.training as rt

    seen = []
    real = rt.train_gated_ffn

    def spy(*a, slots):
        seen.append(slots)
        return real(*a, slots=slots)

    monkeypatch.setattr(rt, "train_gated_ffn", spy)
    f = _layer()
    f.track = True
    f.train_backend = SparseTraining(min_rows=0, impl="reference", start="sparse", slots=32)
    f(torch.randn(4, 64, dtype=BF, requires_grad=True))
    assert seen == [32] and f.last_route.slots == 32


def test_route_reasons_change_only_with_the_route():
    """The smoothed activity moves every step; the reason (and so the route events) only when the route
    changes: the log is not one event per step."""
    f = _layer(H=100)
    f.track = True
    b = SparseTraining(min_rows=0, impl="reference", max_active=0.1, smoothing=0.5)
    f.train_backend = b
    x = torch.randn(4, 64, dtype=BF, requires_grad=True)
    events = 0
    for a in (5, 6, 7, 6, 5, 30, 30, 30):
        f(x)
        b.update([f], [a])
        events += b.route_events([f]) is not None
    # step 1 (dense ran, sparse asked), step 2 (sparse ran), step 6 (dense asked), step 7 (dense ran)
    assert b.route(f) == "dense" and events == 4


def test_compiled_auto_layers_share_graphs_whatever_their_measured_activity():
    """Inference's "auto" under torch.compile, layers sharing one compiled forward (as compiled decoder
    layers do): each layer's measured activity, read in traced code, was a guard, so every layer got its own
    graph and past dynamo's recompile limit (8) the rest ran eager. Planning now reads the activity's class
    (the thresholds it falls between), so the layers share a graph per class; outputs stay eager's."""
    from torch._dynamo.utils import counters

    from twell.nn.ffn import COMPILED_NOTE

    torch._dynamo.reset()
    counters.clear()
    fs = []
    for i in range(10):
        f = _layer(seed=i)
        f.path, f.track = "auto", True
        f._set_activity(0.0002 * (i + 1) + (0.05 if i % 3 == 0 else 0.0))  # ten activities, two classes + dense
        fs.append(f)
    classes = {f._auto_stable for f in fs}
    assert len(classes) <= 4
    x = torch.randn(8, 64, dtype=BF)
    with torch.no_grad():
        want = [f(x) for f in fs]
        got = [torch.compile(f, backend="eager")(x) for f in fs]
    assert counters["stats"]["unique_graphs"] <= len(classes), dict(counters["stats"])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(f.auto_note != COMPILED_NOTE for f in fs)
    # every setting the class is made from remakes it (its setter), so compiled planning follows it
    fs[0].auto_max_active = 0.5
    assert fs[0]._build_state(compiled=True).activity == 0.5
    fs[1].auto_ceilings = ()
    assert fs[1]._build_state(compiled=True).activity == fs[1].auto_max_active
    fs[3].decode_rows = 4  # a layer run dense: its decoding rows are part of the class
    assert fs[3]._auto_dense and fs[3]._build_state(compiled=True).decode_max_rows == fs[3].decode_max_rows() == 4


def test_the_activity_class_answers_every_threshold_as_the_activity_does():
    f = _layer()
    f.path = "auto"
    ts = sorted({min(c, f.auto_max_active) for _, c in f.auto_ceilings} | {f.auto_max_active})
    for a in [0.0, 1e-5, *ts, *(t * 1.0001 for t in ts), 0.3, 1.0]:
        f._set_activity(a)
        cls = f._auto_stable[0]
        assert all((a > t) == (cls > t) for t in ts), (a, cls)
        state = f._build_state(compiled=True)
        assert state.activity == cls and state.decode_max_rows == (f.decode_max_rows() if f._auto_dense else 0)
    f.reset_auto()
    assert f._auto_stable[0] is None and f._build_state(compiled=True).activity is None


# -- layers only the decoding op runs ------------------------------------------------------------------
@pytest.mark.parametrize("change", [dict(activation="fatrelu", gate_why="FATReLU (gate threshold 0.01): no epilogue"),
                                    dict(no_kernel_why="the fused TwELL kernels support D <= 8192, got D=8256")])
def test_auto_on_a_decode_only_layer(change):
    """A gate variant or a width only the decoding op takes: dense (measuring the activity on the first call
    with rows outside a capture or compile), then the decoding op on up to decode_max_rows rows."""
    why = change.get("gate_why") or change["no_kernel_why"]
    fresh = _state(auto_dense=None, activity=None, decode_max_rows=0, **change)
    r = _plan(fresh, 4096)
    assert r.op == "dense" and r.measure and why in r.note
    assert not _plan(fresh, 0).measure
    assert not routing.plan(fresh, FakeX(4), grad_enabled=False, capturing=True).measure
    assert not routing.plan(fresh, FakeX(4), grad_enabled=False, compiling=True).measure
    measured = dataclasses.replace(fresh, auto_dense=True, activity=0.05, decode_max_rows=5, choice_note="5% active")
    for rows, op in ((1, "decode"), (5, "decode"), (6, "dense"), (65536, "dense")):
        r = _plan(measured, rows)
        assert r.op == op and why in r.note and "up to 5 rows" in r.note, (rows, r)
    assert _plan(measured, 1).checked and _plan(measured, 1).impl == "kernel"
    assert _plan(dataclasses.replace(measured, auto_dense=False), 3).op == "decode"  # sparse by activity too
    assert _plan(dataclasses.replace(measured, keep_gate=True), 1).op == "dense"
    assert _plan(dataclasses.replace(measured, dense_rows=(1, 64)), 1).op == "dense"
    # where the decoding op cannot run the layer either: as before
    r = _plan(dataclasses.replace(measured, no_decode_why="D=100: not a multiple of 64"), 1)
    assert r.op == ("dense" if "gate_why" in change else "sparse") and r.impl != "kernel"


def test_kernels_unavailable_is_never_decode_only():
    st = _state(no_kernel_why="kernels unavailable: no nvcc", no_decode_why="")
    assert _plan(st, 1).impl == "reference"
