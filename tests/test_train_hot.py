"""Hot neurons of the training FFN (dense columns for the most active neurons, the rest pair by pair): the
choice of the set, its argument checks, and the split's bookkeeping with the reference in place of the
kernels (CPU), against the unsplit reference. The kernels' own split: tests/test_train_kernels.py."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from twell.kernels.training import _HotSplitFFN
from twell.reference import training as ref


def _layer(M, D, H, seed=0, bias=-1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g)
    x[:, 0] = 1.0
    wg = torch.randn(H, D, generator=g) / math.sqrt(D)
    wg[:, 0] = bias
    wu = torch.randn(H, D, generator=g) / math.sqrt(D)
    wd = torch.randn(D, H, generator=g) / math.sqrt(H)
    return [t.bfloat16() for t in (x, wg, wu, wd)]


def _run(fn, x, wg, wu, wd, seed=1, coef=0.3):
    leaves = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    out, l1, nnz, act = fn(*leaves)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).bfloat16()
    grads = torch.autograd.grad((out, l1), leaves, (dy, torch.tensor(coef)))
    return [out.detach(), l1.detach(), *grads], nnz, act


def _rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _hot_parts(grads, hot):
    """The hot neurons' rows of the gate and up gradients and columns of the down gradient."""
    return [grads[3][hot], grads[4][hot], grads[5][:, hot]]


@pytest.mark.parametrize("M,D,H,hot", [
    (64, 32, 96, [0, 5, 17]),
    (200, 48, 128, list(range(0, 128, 3))),
    (131, 40, 64, list(range(64))),  # every neuron hot: the cold pass sees an all-zero gate
    (50, 16, 80, [79]),
])
def test_split_matches_the_unsplit_reference(M, D, H, hot):
    x, wg, wu, wd = _layer(M, D, H, seed=M)
    wg[hot[0]] = 0
    wg[hot[0], 0] = 1.0  # active on every row
    hot_t = torch.tensor(hot)
    want, nnz_w, act_w = _run(lambda *a: ref.train_gated_ffn(*a), x, wg, wu, wd)
    got, nnz, act = _run(lambda *a: _HotSplitFFN.apply(*a, hot_t, 128, "reference"), x, wg, wu, wd)
    assert torch.equal(nnz, nnz_w) and torch.equal(act, act_w)
    for name, a, b in zip(("out", "l1", "dx", "d_gate", "d_up", "d_down"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert _rel(a, b) < 1e-2, name
    for name, a, b in zip(("hot d_gate", "hot d_up", "hot d_down"), _hot_parts(got, hot_t), _hot_parts(want, hot_t)):
        assert _rel(a, b) < 1e-2, name


@pytest.mark.parametrize("hot", [[0, 5, 17], list(range(0, 96, 2))])
def test_split_l1_gradient_alone(hot):
    """The L1 term's gradient by itself (no output gradient), where it is not a small share of the whole."""
    x, wg, wu, wd = _layer(64, 32, 96, seed=9)
    hot_t = torch.tensor(hot)

    def run(fn):
        leaves = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
        _, l1, _, _ = fn(*leaves)
        return torch.autograd.grad(l1, leaves, allow_unused=True, materialize_grads=True)

    want = run(lambda *a: ref.train_gated_ffn(*a))
    got = run(lambda *a: _HotSplitFFN.apply(*a, hot_t, 128, "reference"))
    for name, a, b in zip(("dx", "d_gate", "d_up", "d_down"), got, want):
        assert _rel(a, b) < 1e-2, name
    assert got[3].abs().sum() == 0  # the down projection is not in the L1 term
    g = [None, None, None, *got[1:3], got[3]]
    w = [None, None, None, *want[1:3], want[3]]
    for a, b in zip(_hot_parts(g, hot_t)[:2], _hot_parts(w, hot_t)[:2]):
        assert b.abs().sum() > 0 and _rel(a, b) < 1e-2


def test_split_without_l1_gradient():
    x, wg, wu, wd = _layer(80, 32, 64)
    hot = torch.tensor([1, 2, 30])
    leaves = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    out, l1, _, _ = _HotSplitFFN.apply(*leaves, hot, 128, "reference")
    out.float().sum().backward()
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    out_r, _, _, _ = ref.train_gated_ffn(*ref_leaves)
    out_r.float().sum().backward()
    for a, b in zip(leaves, ref_leaves):
        assert _rel(a.grad, b.grad) < 1e-2


def test_choose_hot_takes_the_most_active_rounded_up():
    counts = torch.zeros(300, dtype=torch.int64)
    counts[[7, 100, 250]] = torch.tensor([50, 30, 20])  # rates 0.5, 0.3, 0.2 of 100 rows
    counts[[3, 4]] = 5  # 0.05: the next most active, taken to round the set up
    hot = ref.choose_hot(counts, 100, min_freq=0.1, multiple=4)
    assert hot.tolist() == [3, 7, 100, 250]
    assert hot.dtype == torch.int64
    assert ref.choose_hot(counts, 100, min_freq=0.6).numel() == 0
    # capped at max_frac of H (a multiple of `multiple`)
    many = torch.full((256,), 90)
    assert ref.choose_hot(many, 100, min_freq=0.5, multiple=64, max_frac=0.25).numel() == 64
    assert ref.choose_hot(many, 100, min_freq=0.5, multiple=64, max_frac=0.1).numel() == 0


def test_choose_hot_is_deterministic_on_ties():
    counts = torch.full((128,), 10)
    a = ref.choose_hot(counts, 10, min_freq=0.5, multiple=8, max_frac=0.5)
    assert a.tolist() == list(range(64))
    assert torch.equal(a, ref.choose_hot(counts, 10, min_freq=0.5, multiple=8, max_frac=0.5))


def test_choose_hot_bad_arguments():
    c = torch.ones(10)
    with pytest.raises(ValueError, match="1-D"):
        ref.choose_hot(c.view(2, 5), 10)
    with pytest.raises(ValueError, match="rows"):
        ref.choose_hot(c, 0)
    with pytest.raises(ValueError, match="min_freq"):
        ref.choose_hot(c, 10, min_freq=0.0)
    with pytest.raises(ValueError, match="multiple"):
        ref.choose_hot(c, 10, multiple=0)


def test_reference_checks_a_hot_set():
    x, wg, wu, wd = _layer(8, 16, 32)
    out = ref.train_gated_ffn(x, wg, wu, wd, hot=torch.tensor([1, 4]))[0]
    assert torch.equal(out, ref.train_gated_ffn(x, wg, wu, wd)[0])
    with pytest.raises(ValueError, match="int64"):
        ref.train_gated_ffn(x, wg, wu, wd, hot=[1, 4])
    with pytest.raises(ValueError, match="distinct"):
        ref.train_gated_ffn(x, wg, wu, wd, hot=torch.tensor([4, 1]))
    with pytest.raises(ValueError, match="distinct"):
        ref.train_gated_ffn(x, wg, wu, wd, hot=torch.tensor([1, 32]))
    with pytest.raises(ValueError, match="more than"):
        ref.train_gated_ffn(x, wg, wu, wd, hot=torch.arange(33))


def test_chosen_set_covers_the_layers_busiest_neurons():
    """On a layer whose activity is concentrated, the set chosen from one batch takes most pairs of another."""
    x, wg, wu, wd = _layer(4096, 64, 512, seed=3, bias=-2.5)
    wg[:16, 0] = 0.5  # 16 neurons far more active than the rest
    a = F.linear(x, wg) > 0
    hot = ref.choose_hot(a[:2048].sum(0), 2048, 0.05, multiple=16)
    assert set(range(16)) <= set(hot.tolist())
    share = a[2048:, hot].sum() / a[2048:].sum()
    assert share > 0.5


def test_backend_gives_a_layer_its_hot_set_and_reports_it():
    from twell.nn import SparseFFN
    from twell.nn.sparse_training import SparseTraining

    torch.manual_seed(0)
    fs = [SparseFFN(32, 48).to(torch.bfloat16) for _ in range(2)]
    backend = SparseTraining(min_rows=0, impl="reference", start="sparse")
    for f in fs:
        f.track = True
        f.train_backend = backend
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16, requires_grad=True)
    fs[0](x)
    backend.update(fs, [1.0, 1.0])
    assert "hot_neurons" not in backend.route_events(fs)
    backend.set_hot(fs[0], torch.tensor([2, 9, 40]))
    assert backend.layer(fs[0]).hot.tolist() == [2, 9, 40]
    events = backend.route_events(fs)  # a new hot set is an event
    assert events["hot_neurons"] == [3, 0]
    assert backend.route_events(fs) is None
    backend.set_hot(fs[0], torch.empty(0, dtype=torch.int64))  # empty: none
    assert backend.layer(fs[0]).hot is None
    with pytest.raises(ValueError, match="distinct"):
        backend.set_hot(fs[1], torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="int64"):
        backend.set_hot(fs[1], torch.tensor([1.0]))


def _training_row(tmp_path, H, layers, **settings):
    """The model benchmark's training row of a small random model on CPU."""
    from twell.bench.model import ModelBenchConfig, run_model_bench
    from twell.model import ModelConfig, build_model, save_pretrained

    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=H, num_layers=layers, num_heads=2,
                     num_kv_heads=2, max_position_embeddings=64)
    save_pretrained(build_model(mc), None, tmp_path / "m", dtype=torch.bfloat16)
    cfg = ModelBenchConfig(checkpoint=str(tmp_path / "m"), device="cpu", prefill_batches=(), seq_len=16,
                           decode_batches=(), train_batch=2, train_steps=1, reps=2, warmup=1, energy=False,
                           decode_static=False, decode_graph=False, token_check=False, **settings)
    (row,) = [r for r in run_model_bench(cfg, progress=False)["rows"] if r["measure"] == "training"]
    return row


def test_model_bench_chooses_hot_sets_for_sparse_layers(tmp_path):
    from twell.bench.model import ModelBenchConfig

    row = _training_row(tmp_path, 256, 2, train_max_active=1.0, train_hot=0.05)
    (note,) = [n for n in row["sparse"]["notes"] if n.startswith("hot neurons")]
    sizes = json.loads(note.split(": ", 1)[1])
    # random weights: about half the gates open on any row, so every neuron passes 5% and the set is capped
    assert sizes == [int(256 * ref.HOT_MAX_FRAC)] * 2
    with pytest.raises(ValueError, match="train_hot"):
        ModelBenchConfig(checkpoint="x", train_hot=0.0).check()


def test_time_layer_times_every_route_and_picks_the_fastest():
    from twell.train.calibration import LAYER_ROUTES, ROUTE_MARGIN, time_layer

    x, wg, wu, wd = _layer(512, 32, 256, seed=4, bias=-2.5)
    wg[:16, 0] = 1.0  # 16 neurons on every row: a hot set
    rec, hot = time_layer(x, wg, wu, wd, impl="reference", hot_min_freq=0.05, reps=2, warmup=1)
    assert rec["route"] in LAYER_ROUTES and rec["rows"] == 512
    assert hot is not None and set(range(16)) <= set(hot.tolist()) and rec["hot_neurons"] == hot.numel()
    assert rec["hot_pair_share"] > 0.5
    ms = {"dense": rec["dense_ms"], "sparse": rec["sparse_ms"], "hot": rec["hot_ms"]}
    assert all(v > 0 for v in ms.values())
    best = min(("sparse", "hot"), key=ms.get)
    assert rec["margin"] == ROUTE_MARGIN > 1.0
    assert rec["route"] == (best if ms["dense"] / ms[best] > ROUTE_MARGIN else "dense")
    # the margin decides: never sparse under an unreachable one, always the fastest sparse route at none
    assert time_layer(x, wg, wu, wd, impl="reference", hot_min_freq=0.05, reps=1, warmup=0,
                      margin=1e9)[0]["route"] == "dense"
    rec0, _ = time_layer(x, wg, wu, wd, impl="reference", hot_min_freq=0.05, reps=1, warmup=0, margin=0.0)
    assert rec0["route"] == min(("sparse", "hot"), key=lambda k: rec0[f"{k}_ms"])
    json.dumps(rec)  # the record is JSON-ready (the set comes separately)
    rec, hot = time_layer(x, wg, wu, wd, impl="reference", reps=1, warmup=0)
    assert hot is None and rec["hot_ms"] is None and rec["route"] in ("dense", "sparse")
    with pytest.raises(ValueError, match="impl"):
        time_layer(x, wg, wu, wd, impl="cuda")


def test_timed_routes_stay_until_timed_again():
    from twell.nn import SparseFFN
    from twell.nn.sparse_training import SparseTraining

    fs = [SparseFFN(32, 64).to(torch.bfloat16) for _ in range(2)]
    b = SparseTraining(min_rows=0, impl="reference", max_active=0.1, smoothing=0.0)
    b.update(fs, [1.0, 1.0])  # 1.6% active: both sparse by activity
    b.set_route(fs[0], "dense", "timed: dense 1.00x")
    b.set_route(fs[1], "hot", "timed: hot 2.00x", torch.tensor([3, 4]))
    assert [b.route(f) for f in fs] == ["dense", "sparse"]
    assert b.layer(fs[1]).hot.tolist() == [3, 4] and b.layer(fs[0]).why == "timed: dense 1.00x"
    b.update(fs, [60.0, 60.0])  # far above the threshold: timed routes do not move
    assert [b.route(f) for f in fs] == ["dense", "sparse"]
    assert b.layer(fs[0]).activity == pytest.approx(60 / 64)
    b.set_route(fs[1], "sparse", "timed: sparse 1.50x")  # a plain sparse route drops the hot set
    assert b.layer(fs[1]).hot is None
    b.set_route(fs[0], "hot", "timed: hot 2.00x", torch.tensor([1]))
    b.untime(fs[0])  # e.g. neurons revived: back to the activity, without the set
    assert b.layer(fs[0]).hot is None and not b.layer(fs[0]).timed
    b.update(fs, [60.0, 60.0])
    assert [b.route(f) for f in fs] == ["dense", "sparse"]  # 94% active: dense by activity; fs[1] still timed
    with pytest.raises(ValueError, match="non-empty"):
        b.set_route(fs[1], "hot", "x")
    with pytest.raises(ValueError, match="route"):
        b.set_route(fs[1], "fast", "x")


def test_model_bench_timed_routes_say_why_not_on_a_cpu(tmp_path):
    from twell.bench.model import ModelBenchConfig

    row = _training_row(tmp_path, 64, 1, train_routes="timed")
    assert any("timing each layer's routes needs a GPU" in n for n in row["sparse"]["notes"])
    with pytest.raises(ValueError, match="train_routes"):
        ModelBenchConfig(checkpoint="x", train_routes="fast").check()


def test_trainer_settings_for_timed_routes():
    from twell.train.config import load_config

    cfg = load_config("tiny")
    cfg.validate()
    cfg.train.sparse_hot = 0.02
    with pytest.raises(ValueError, match="sparse_routes timed"):
        cfg.validate()
    cfg.train.sparse_routes = "timed"
    cfg.validate()
    cfg.train.global_batch = 2 * cfg.train.micro_batch  # two ranks' worth
    with pytest.raises(ValueError, match="one process"):
        cfg.validate(world_size=2)
    for key, bad in (("sparse_routes", "fast"), ("sparse_hot", 0.0), ("sparse_hot", True),
                     ("sparse_retime_every", 0)):
        keep = getattr(cfg.train, key)
        setattr(cfg.train, key, bad)
        with pytest.raises(ValueError, match=key):
            cfg.validate()
        setattr(cfg.train, key, keep)


def test_time_layer_takes_fp32_weights_as_the_trainer_holds_them():
    """The trainer's weights are fp32 under bf16 autocast: the timing counts and runs on their bf16 copies."""
    from twell.train.calibration import time_layer

    x, wg, wu, wd = _layer(256, 32, 256, seed=5, bias=-2.5)
    wg[:8, 0] = 1.0
    rec, hot = time_layer(x, wg.float(), wu.float(), wd.float(), impl="reference", hot_min_freq=0.05, reps=1,
                          warmup=0)
    assert hot is not None and set(range(8)) <= set(hot.tolist()) and rec["hot_pair_share"] > 0


def test_a_checked_set_is_checked_again_once_changed():
    hot = torch.tensor([1, 4, 9])
    ref.check_hot_values(hot, 16)
    ref.check_hot_values(hot, 16)  # marked: not read again
    with pytest.raises(ValueError, match="distinct"):
        ref.check_hot_values(hot, 5)  # another H: read again
    hot[2] = 4  # an in-place change bumps the version: read again
    with pytest.raises(ValueError, match="distinct"):
        ref.check_hot_values(hot, 16)
