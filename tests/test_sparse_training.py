"""The sparse training backend on CPU (pure-PyTorch reference): routes, statistics, refusals, and the
trainer's switch."""
from __future__ import annotations

import pytest
import torch

from twell.nn import SparseFFN
from twell.nn.sparse_training import SparseTraining
from twell.reference.training import train_gated_ffn
from twell.train.config import load_config
from twell.train.metrics import read_metrics
from test_train_runs import _cfg, smoke_data  # noqa: F401 (a fixture)


def _ffn(D=32, H=48, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    f = SparseFFN(D, H).to(dtype)
    f.track = True
    return f


def test_reference_backend_matches_dense_and_fills_stats():
    f = _ffn()
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16, requires_grad=True)
    out_d = f(x)
    l1_d = f.stats.l1
    (out_d.float().sum() + l1_d).backward()
    grads_d = [x.grad.clone()] + [p.grad.clone() for p in f.parameters()]
    x.grad = None
    f.zero_grad()
    backend = SparseTraining(min_rows=0, impl="reference", start="sparse")
    f.train_backend = backend
    out_s = f(x)
    assert f.last_path == "train-reference"
    assert f.stats.active_per_token.shape == (3, 5) and f.stats.neuron_active.shape == (48,)
    (out_s.float().sum() + f.stats.l1).backward()
    grads_s = [x.grad] + [p.grad for p in f.parameters()]
    assert torch.equal(out_s, out_d)
    for a, b in zip(grads_s, grads_d):
        assert torch.equal(a, b)


def test_routes_switch_with_hysteresis():
    fs = [_ffn(H=100), _ffn(H=100)]
    b = SparseTraining(min_rows=0, impl="reference", max_active=0.1, smoothing=0.0)
    assert b.route(fs[0]) == "dense"
    assert b.update(fs, [50, 9]) == ["dense", "sparse"]
    assert b.update(fs, [50, 11]) is None  # 11% is inside the band (10%, 12.5%]: stays sparse
    assert b.update(fs, [10, 13]) == ["sparse", "dense"]
    with pytest.raises(ValueError, match="2 layers"):
        b.update(fs, [1])


def test_smoothing_holds_a_route_through_one_step():
    f = _ffn(H=100)
    b = SparseTraining(min_rows=0, impl="reference", max_active=0.1, smoothing=0.5)
    assert b.update([f], [5]) == ["sparse"]
    assert b.update([f], [20]) is None  # smoothed 12.5%: inside the band
    assert abs(b.layer(f).activity - 0.125) < 1e-9
    assert b.update([f], [20]) == ["dense"]  # 16.25%


def test_unsupported_layers_run_dense_and_say_so():
    """A layer the training op cannot run runs dense, and its route records that and why; a strict
    backend (train.sparse_kernels=always) raises instead."""
    f = _ffn(dtype=torch.float32)
    b = SparseTraining(min_rows=0, impl="reference", start="sparse")
    f.train_backend = b
    x = torch.randn(4, 32, requires_grad=True)
    f(x)
    assert b.route(f) == "sparse"  # asked for ...
    assert f.last_path == "dense" and "bfloat16" in f.last_route.reason  # ... but not what ran
    events = b.route_events([f])
    assert events == {"routes": ["sparse"], "ran": ["dense"], "why": [f.last_route.reason]}
    assert b.route_events([f]) is None  # nothing changed since
    g = _ffn()
    g.train_backend = SparseTraining(min_rows=0, impl="kernel", start="sparse")
    g(torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True))
    assert g.last_path == "dense" and "cpu" in g.last_route.reason
    f.train_backend = SparseTraining(min_rows=0, impl="reference", start="sparse", strict=True)
    with pytest.raises(ValueError, match="sparse_kernels=always.*bfloat16"):
        f(x)


def test_route_events_follow_what_ran():
    f = _ffn(H=100)
    b = SparseTraining(min_rows=0, impl="reference", max_active=0.1, smoothing=0.0)
    f.train_backend = b
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    assert b.route_events([f]) == {"routes": ["dense"], "ran": [None], "why": [""]}  # no call yet
    f(x)
    ev = b.route_events([f])
    assert ev["routes"] == ["dense"] and ev["ran"] == ["dense"] and "not measured" in ev["why"][0]
    b.update([f], [5])
    f(x)
    ev = b.route_events([f])
    assert ev["routes"] == ["sparse"] and ev["ran"] == ["train-reference"] and "5.00% active" in ev["why"][0]
    f(x)
    assert b.route_events([f]) is None


def test_bad_backend_settings():
    with pytest.raises(ValueError, match="impl"):
        SparseTraining(min_rows=0, impl="fast")
    with pytest.raises(ValueError, match="max_active"):
        SparseTraining(max_active=2)


def test_config_switch_is_validated():
    cfg = load_config("tiny")
    cfg.train.sparse_kernels = "maybe"
    with pytest.raises(ValueError, match="sparse_kernels"):
        cfg.validate()


def test_reference_signature_matches_the_kernels():
    import inspect

    from twell.kernels import training as kt

    assert inspect.signature(kt.train_gated_ffn) == inspect.signature(train_gated_ffn)


def test_trainer_switch_on_cpu(tmp_path, smoke_data):
    from twell.train import run

    cfg = _cfg(smoke_data, steps=2, eval_every=2, ckpt_every=2)
    res = run(cfg, out=tmp_path / "auto")
    start = next(r for r in read_metrics(res.out_dir / "metrics.jsonl")["event"] if r["event"] == "start")
    assert "sparse training kernels: no, device cpu" in start["describe"]
    cfg["train"]["sparse_kernels"] = "always"
    with pytest.raises(ValueError, match="sparse_kernels is always"):
        run(cfg, out=tmp_path / "always")


def test_training_kernel_bench_table_and_figures(tmp_path):
    import json
    import shutil

    import matplotlib

    matplotlib.use("Agg")
    from twell.paths import repo_root
    from twell.train import plots
    from twell.train.study import training_kernel_bench

    assert training_kernel_bench(tmp_path) == (None, None)
    src = sorted((repo_root() / "reports" / "bench").glob("ffn-*-train.json"))[-1]
    shutil.copy(src, tmp_path / src.name)
    table, path = training_kernel_bench(tmp_path)
    res = json.loads(src.read_text())
    assert path.name == src.name and len(table) == sum(c["case"]["kind"] == "train" for c in res["cases"])
    first = res["cases"][0]
    assert table["speed-up"][0] == first["impls"]["twell-train-kernel"]["speedup"]
    assert plots.plot_kernel_bench(table) is not None
    # a newer record of a checkpoint's captured layers is not the generator's table
    captured = sorted((repo_root() / "reports" / "bench").glob("ffn-*-captured.json"))[-1]
    shutil.copy(captured, tmp_path / captured.name)
    assert training_kernel_bench(tmp_path)[1].name == src.name
    # so is a newer record of fewer cases: the full table stays
    partial = json.loads(src.read_text())
    partial["cases"] = [c for c in partial["cases"] if c["case"]["kind"] == "train"][:1]
    partial["meta"]["timestamp"] = "9999-12-31T00:00:00+00:00"
    (tmp_path / "ffn-partial.json").write_text(json.dumps(partial))
    assert training_kernel_bench(tmp_path)[1].name == src.name
    full = json.loads(src.read_text())
    full["meta"]["timestamp"] = "9999-12-31T00:00:00+00:00"
    (tmp_path / "ffn-newer-full.json").write_text(json.dumps(full))
    assert training_kernel_bench(tmp_path)[1].name == "ffn-newer-full.json"
    recs = [{"kind": "train", "step": s, "tok_s": 1000.0 + s, "active_frac": 0.5 / s, "peak_mem_mb": 10.0,
             "ce": 1.0} for s in range(1, 30)]
    recs.append({"kind": "event", "step": 12, "event": "ffn-routes", "routes": ["sparse"]})
    m = tmp_path / "metrics.jsonl"
    m.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    fig = plots.plot_throughput({"run": m})
    assert len(fig.axes) == 3


def test_l1_sweep_table_and_figure(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from twell.train import plots

    def summ(coef, act, ce, dead):
        return {"l1_coef": coef, "steps_done": 10, "final": {"active_frac_mean": act, "val_ce": ce,
                                                             "dead_frac_per_layer": [dead, dead]}}

    table = plots.l1_sweep_table({"a": summ(2e-5, 0.01, 4.1, 0.3), "d": summ(0.0, 0.4, 4.0, 0.0),
                                  "b": summ(5e-6, 0.05, 4.02, 0.1)})
    assert table["L1 coef"].tolist() == [0.0, 5e-6, 2e-5]  # sorted, the dense run first
    assert table["val CE vs L1 0 (%)"].tolist() == pytest.approx([0.0, 0.5, 2.5])
    assert table["active %"].tolist() == pytest.approx([40.0, 5.0, 1.0])
    assert len(plots.plot_l1_sweep(table).axes) == 3


def test_variant_overrides():
    from twell.train import study

    assert study.l1_sweep_variants([0, 2e-5]) == {"L1 0": ["sparsity.l1_coef=0.0"],
                                                  "L1 2e-05": ["sparsity.l1_coef=2e-05"]}
    v = study.reinit_variants(50)
    assert v["re-init dead"] == ["sparsity.reinit_dead=true", "sparsity.reinit_every=50"]
    assert v["no re-init"] == ["sparsity.reinit_dead=false"]


@pytest.mark.parametrize("impl", ["reference", pytest.param("kernel", marks=pytest.mark.gpu)])
def test_reinit_dead_gates_reaches_the_training_path(impl, request):
    """Dead-neuron re-initialisation rewrites gate rows in place between steps; the training path must see
    the new rows at its next call (the kernels keep no copy of the weights). Same batch before and after:
    64 dead neurons (zero gate rows, never open) revived with random rows open for about half the tokens.
    After it, the path's activity, output and gate gradient are the dense path's on the new weights. With
    256 slots most rows stay light (the row kernels and the work list run), a few are heavy."""
    from twell.train.tracker import reinit_dead_gates

    if impl == "kernel":
        request.getfixturevalue("kernels_ready")
    device = "cuda" if impl == "kernel" else "cpu"
    f = _ffn(D=256, H=512).to(device)
    backend = SparseTraining(min_rows=0, impl=impl, start="sparse", slots=256)
    f.train_backend = backend
    x = torch.randn(4, 64, 256, dtype=torch.bfloat16, device=device)
    dy = torch.randn_like(x)
    dead = torch.zeros(1, 512, dtype=torch.bool)
    dead[0, :64] = True
    with torch.no_grad():
        f.gate_proj.weight[:64] = 0
    f(x)
    assert f.last_path == f"train-{impl}"
    before = f.stats.active_per_token.float().mean().item()
    assert not f.stats.neuron_active[:64].any()
    opt = torch.optim.AdamW(f.parameters())
    n = reinit_dead_gates([f], dead, opt, std=0.05, generator=torch.Generator().manual_seed(1))

    def step():
        f.zero_grad()
        out = f(x)
        (out.float() * dy.float()).sum().backward()
        return out.detach().float(), f.stats.active_per_token.float(), f.gate_proj.weight.grad.float().clone()

    out, active, grad = step()
    after = active.mean().item()
    print(f"{impl}: active per token {before:.1f} -> {after:.1f}, light rows {(active <= 256).float().mean():.2f}")
    assert n == 64 and f.stats.neuron_active[:64].all()
    assert 0.3 * 64 <= after - before <= 0.7 * 64, (before, after)
    assert 0.3 <= (active <= 256).float().mean() < 1.0  # light rows on the sparse path, and some heavy ones
    f.train_backend = None
    out_d, active_d, grad_d = step()
    assert abs(after - active_d.mean().item()) <= 0.005 * active_d.mean().item()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(out, out_d) < 1e-2 and rel(grad[:64], grad_d[:64]) < 2e-2, (rel(out, out_d), rel(grad[:64], grad_d[:64]))


def test_forwards_below_the_row_floor_train_dense_and_say_why():
    """Below min_rows (the trainer's train.sparse_min_tokens) a layer asked to run sparse trains dense:
    the training op is slower there; the route events carry the reason."""
    f = _ffn(H=100)
    b = SparseTraining(impl="reference", start="sparse", min_rows=64)
    f.train_backend = b
    f(torch.randn(63, 32, dtype=torch.bfloat16, requires_grad=True))
    assert f.last_path == "dense" and "63 rows per forward < min_rows 64" in f.last_route.reason
    f(torch.randn(2, 32, 32, dtype=torch.bfloat16, requires_grad=True))
    assert f.last_path == "train-reference"
    assert SparseTraining().min_rows == 8192 and load_config("tiny").train.sparse_min_tokens == 8192
    with pytest.raises(ValueError, match="min_rows"):
        SparseTraining(min_rows=-1)
    cfg = load_config("tiny")
    cfg.train.sparse_min_tokens = -5
    with pytest.raises(ValueError, match="sparse_min_tokens"):
        cfg.validate()


def test_compiled_layers_train_without_graph_breaks_as_routes_and_activity_move():
    """Per-layer torch.compile (as train.compile applies it) of layers on the training backend: the
    activities differ between layers and move every step, the routes switch once; planning must not
    break the graphs (a float formatted in traced code did), and recompiles stay bounded."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    be = SparseTraining(impl="reference", start="sparse", min_rows=0, max_active=0.1, smoothing=0.5)
    fs = [_ffn(D=64, H=256, seed=i) for i in range(3)]
    for f in fs:
        f.train_backend = be
    compiled = [torch.compile(f, backend="eager") for f in fs]
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    for step in range(6):
        for c in compiled:
            (c(x).float().sum() + c._orig_mod.stats.l1).backward()
        be.update(fs, [5.0 + step + 3 * i + (40 if step == 3 else 0) for i in range(3)])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert {f.last_path for f in fs} <= {"train-reference", "dense"}


def test_compiled_layers_share_their_graphs_whatever_their_reasons():
    """Layers that share one compiled forward (train.compile compiles each decoder layer; the layers share
    its code) and differ only in why their route was set, or in what inference's "auto" measured on them,
    share its graphs: either read in traced code gave each layer its own graph, and past dynamo's
    recompile limit (8) the rest ran eager. The reported reason is still each layer's own."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    be = SparseTraining(impl="reference", start="sparse", min_rows=0, max_active=0.5)
    fs = [_ffn(D=64, H=256, seed=i) for i in range(10)]
    for f in fs:
        f.train_backend = be
    be.update(fs, [2.0 + i for i in range(10)])  # ten different activities, all sparse: ten reasons
    assert len({be.layer(f).why for f in fs}) == 10
    for i, f in enumerate(fs):  # and ten different measurements of inference's "auto" (its activity, note)
        f._set_activity(0.001 * (i + 1))
    compiled = [torch.compile(f, backend="eager") for f in fs]
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    for c in compiled:
        (c(x).float().sum() + c._orig_mod.stats.l1).backward()
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert {f.last_path for f in fs} == {"train-reference"}
    ev = be.route_events(fs)
    assert ev["why"] == [f"training: sparse ({be.layer(f).why})" for f in fs]


def test_trainer_routes_follow_the_activity_one_step_late():
    """The trainer hands a step's activity to the backend at the next step's end (no per-step host sync)."""
    from types import SimpleNamespace

    from twell.train.loop import Trainer

    seen, events = [], []
    backend = SimpleNamespace(update=lambda ffns, values: seen.append(values),
                              route_events=lambda ffns: {"routes": ["dense"]})
    t = SimpleNamespace(sparse_training=backend, ffns=[None], _pending_activity=None,
                        _event=lambda name, **kw: events.append((name, kw)))
    Trainer._update_routes(t, torch.tensor([3.0]))
    assert seen == [] and events == []
    Trainer._update_routes(t, torch.tensor([5.0]))
    assert seen == [[3.0]] and events == [("ffn-routes", {"routes": ["dense"]})]
    Trainer._update_routes(t, torch.tensor([7.0]))
    assert seen == [[3.0], [5.0]]
    Trainer._update_routes(t, None)  # the run's end: the last step's values, nothing pending after
    assert seen == [[3.0], [5.0], [7.0]] and t._pending_activity is None
