"""The sparse training kernels against the pure-PyTorch reference: outputs, L1, activity and every
gradient, on random and odd shapes, the benchmark's sparsity cases, all-zero and fully dense rows,
and layers whose heavy rows exceed any fixed capacity (GPU only; skipped and counted without CUDA)."""
from __future__ import annotations

import functools
import math
import time

import pytest
import torch

from twell.bench.generator import calibrated_ffn_inputs
from twell.kernels import training as ktrain
from twell.reference import training as ref

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_ready")]


def _run(fn, x, w_gate, w_up, w_down, dy, coef, slots):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w_gate, w_up, w_down)]
    out, l1, nnz, act = fn(*leaves, slots=slots)
    grads = torch.autograd.grad((out, l1), leaves, (dy.to(out.dtype), torch.tensor(coef, device=x.device)))
    return [out.detach(), l1.detach(), *grads], nnz, act


def _fp32_truth(x, w_gate, w_up, w_down, dy, coef):
    leaves = [t.detach().float().clone().requires_grad_(True) for t in (x, w_gate, w_up, w_down)]
    xs, wg, wu, wd = leaves
    h = torch.relu(xs @ wg.t()) * (xs @ wu.t())
    out = h @ wd.t()
    l1 = h.abs().sum(-1).mean()
    grads = torch.autograd.grad((out, l1), leaves, (dy.float(), torch.tensor(coef, device=x.device)))
    return [out.detach(), l1.detach(), *grads]


def _rel(a, b):
    a, b = a.float(), b.float()
    den = b.norm()
    return float((a - b).norm() / den) if den > 0 else float((a - b).norm())


NAMES = ("out", "l1", "grad_x", "grad_w_gate", "grad_w_up", "grad_w_down")


def check_case(x, w_gate, w_up, w_down, slots=ref.TRAIN_SLOTS, coef=0.3, seed=0, factor=2.0, floor=2e-3, hot=None):
    """Kernel and dense bf16 against fp32: every output within ``factor`` x dense's error (+ floor);
    activity equal to the reference's exactly. ``hot``: the kernel call's hot neurons."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dy = torch.randn(x.shape, generator=g).to(torch.bfloat16).to(x.device)
    got, nnz, act = _run(functools.partial(ktrain.train_gated_ffn, hot=hot), x, w_gate, w_up, w_down, dy, coef, slots)
    dense, nnz_r, act_r = _run(ref.train_gated_ffn, x, w_gate, w_up, w_down, dy, coef, slots)
    truth = _fp32_truth(x, w_gate, w_up, w_down, dy, coef)
    assert torch.equal(nnz, nnz_r)
    assert torch.equal(act, act_r)
    report = {}
    for name, a, d, t in zip(NAMES, got, dense, truth):
        assert a.shape == d.shape and a.dtype == d.dtype, name
        assert torch.isfinite(a).all(), name
        e_k, e_d = _rel(a, t), _rel(d, t)
        report[name] = (e_k, e_d)
        assert e_k <= factor * e_d + floor, f"{name}: kernel {e_k:.3e} vs dense bf16 {e_d:.3e} (against fp32)"
    return nnz, report


def _random(M, D, H, seed=0, bias=0.0, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(M, D, generator=g)
    wg = torch.randn(H, D, generator=g) / math.sqrt(D)
    wg[:, 0] = bias  # with x[:, 0] = 1 a bias on every gate: negative -> sparse
    x[:, 0] = 1.0
    wu = torch.randn(H, D, generator=g) / math.sqrt(D)
    wd = torch.randn(D, H, generator=g) / math.sqrt(H)
    return [t.to(torch.bfloat16).to(device) for t in (x, wg, wu, wd)]


@pytest.mark.parametrize("M,D,H,bias,slots", [
    (1, 8, 1, -1.0, 128),
    (37, 136, 200, -1.5, 16),
    (300, 264, 777, -2.0, 8),
    (1000, 512, 1408, -2.5, 128),
    (513, 2048, 5632, -2.5, 128),
    (64, 1032, 96, 0.0, 4),  # half of the gate open: most rows heavy
    (700, 256, 777, -1.0, 8),  # heavy rows on the dense tensor-core path, over several of its rounds
    # wider than 2048: each thread of a row block owns ceil(D / 2048) vectors of 8 columns
    (300, 2056, 700, -2.0, 16),
    (513, 4096, 5632, -2.5, 128),
    (200, 5128, 640, -1.5, 32),
    (257, 8192, 1024, -2.0, 128),
    (64, 6144, 96, 0.0, 4),
])
def test_random_shapes(M, D, H, bias, slots):
    check_case(*_random(M, D, H, seed=M + D, bias=bias), slots=slots)


@pytest.mark.parametrize("parts", [1, 2, 3, 8, 64])
def test_weight_gradients_in_slices_of_d(parts, monkeypatch):
    """The weight-gradient kernel walks D in slices (so the gathered rows of x and dy stay in L2); forced
    counts, uneven ones and more slices than D has columns of 8 give the same gradients bit for bit, long
    neurons' chunked partials included."""
    x, wg, wu, wd = _random(1500, 200, 300, seed=parts, bias=-2.0)
    wg[1] = 0
    wg[1, 0] = 1.0  # neuron 1 active on every row: chunked
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).cuda()
    monkeypatch.setattr(ktrain, "COLUMN_PARTS", 1)
    one, _, _ = _run(ktrain.train_gated_ffn, x, wg, wu, wd, dy, 0.3, 16)
    monkeypatch.setattr(ktrain, "COLUMN_PARTS", parts)
    sliced, _, _ = _run(ktrain.train_gated_ffn, x, wg, wu, wd, dy, 0.3, 16)
    for name, a, b in zip(NAMES, sliced, one):
        assert torch.equal(a, b), name
    check_case(x, wg, wu, wd, slots=16)


def test_wide_weight_gradients_take_at_least_one_slice_per_2048_columns(monkeypatch):
    """A slice of the weight-gradient kernel spans at most 2048 columns (one thread per 8): a forced count
    below ceil(D / 2048) is raised to it, with the same gradients as the default's slices."""
    x, wg, wu, wd = _random(600, 6144, 640, seed=5, bias=-2.0)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).cuda()
    results = []
    for parts in (1, 3, 0):  # 0: the default rule
        monkeypatch.setattr(ktrain, "COLUMN_PARTS", parts)
        results.append(_run(ktrain.train_gated_ffn, x, wg, wu, wd, dy, 0.3, 32)[0])
    for name, *abc in zip(NAMES, *results):
        assert torch.equal(abc[0], abc[1]), name
    check_case(x, wg, wu, wd, slots=32)


@pytest.mark.parametrize("case", [(8, 0.1), (29, 0.1), (64, 0.1), (29, 0.35)], ids=["nnz8", "nnz29", "nnz64", "heavy"])
def test_benchmark_cases(case):
    inp = calibrated_ffn_inputs(2048, 2048, 5632, case[0], case[1], seed=3, device="cuda")
    nnz, _ = check_case(inp.x, inp.w_gate, inp.w_up, inp.w_down, coef=2e-5 * 2048)
    assert abs(nnz.float().mean().item() - case[0]) < 0.1 * case[0]


def test_zero_and_dense_rows():
    x, wg, wu, wd = _random(257, 256, 640, bias=-2.0)
    x[5] = 0  # no neuron active
    x[7, 0] = -100.0  # every neuron active: -100 times the gate bias -2
    x[9:20] = 0
    nnz, _ = check_case(x, wg, wu, wd, slots=32)
    assert nnz[5] == 0 and nnz[9:20].eq(0).all()
    assert nnz[7] == 640


def test_all_rows_heavy_past_any_capacity():
    """Every row over its slots (no fixed capacity could hold them): all through the dense part."""
    x, wg, wu, wd = _random(4096, 256, 512, bias=0.5)
    nnz, _ = check_case(x, wg, wu, wd, slots=8)
    assert bool((nnz > 8).all())


def _heavy_grads_torch(g, u, ds, l1_grad):
    """The heavy rows' elementwise backward as PyTorch's bf16 operations compute it."""
    gr = torch.relu(g)
    h = gr * u
    if l1_grad is not None:
        ds = ds + torch.sign(h) * l1_grad.to(torch.bfloat16).reshape(())
    return h, ds * gr, torch.where(g > 0, ds * u, torch.zeros((), dtype=g.dtype, device=g.device))


@pytest.mark.parametrize("rows,H", [(1, 8), (3, 5), (64, 5632), (1031, 1408), (2049, 640)])
@pytest.mark.parametrize("with_l1", [True, False])
def test_heavy_rows_elementwise_backward_is_pytorchs_bit_for_bit(rows, H, with_l1):
    """The fused elementwise pass of the heavy rows' backward gives PyTorch's bf16 sequence bit for bit,
    vectorised (rows x H a multiple of 8) or not, with zeros, -0, NaN and infinities among the inputs."""
    from twell.kernels.build import load

    gen = torch.Generator(device="cpu").manual_seed(rows * H)
    g, u, ds = (torch.randn(rows, H, generator=gen).mul_(3).to(torch.bfloat16).cuda() for _ in range(3))
    g.view(-1)[::7] = 0.0
    g.view(-1)[1::11] = -0.0
    u.view(-1)[2::13] = 0.0
    if g.numel() > 40:
        g.view(-1)[17] = float("nan")
        u.view(-1)[23] = float("inf")
        ds.view(-1)[31] = float("-inf")
    l1 = torch.tensor([0.0123], device="cuda") if with_l1 else None
    got = load().train_heavy_grads(g, u, ds, l1)
    want = _heavy_grads_torch(g, u, ds, l1)
    for a, b in zip(got, want):  # NaN where PyTorch's is NaN (their payloads differ), every other bit equal
        assert torch.equal(a.isnan(), b.isnan())
        ok = ~b.isnan()
        assert torch.equal(a[ok].view(torch.int16), b[ok].view(torch.int16))
    with pytest.raises(RuntimeError, match="one shape"):
        load().train_heavy_grads(g, u[:, :1].contiguous(), ds, l1)


def test_no_host_sync_where_d_is_a_multiple_of_64():
    """The forward queues its work without waiting for the GPU (heavy rows included), and so does the
    backward but for its wait on the forward's end event (which the debug mode does not flag); D not a
    multiple of 64 still reads the heavy-row count back, so the check can fail."""
    leaves = [t.requires_grad_(True) for t in _random(2048, 512, 1408, bias=-2.0, seed=7)]
    dy, coef = torch.randn_like(leaves[0]), torch.tensor(0.1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, l1, nnz, _ = ktrain.train_gated_ffn(*leaves, slots=16)
        grads = torch.autograd.grad((out, l1), leaves, (dy, coef))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert int((nnz > 16).sum()) > 0 and all(torch.isfinite(g).all() for g in grads)  # the dense path ran
    odd = _random(256, 200, 640, bias=-1.0, seed=7)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            ktrain.train_gated_ffn(*[t.requires_grad_(True) for t in odd], slots=8)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_near_dense_layer_stays_under_dense_memory_and_off_the_cliff():
    """1500 of 5632 neurons active per row (every row heavy): exact, peak memory above the inputs at most
    dense PyTorch's, and time within 2x dense's (a guard against the per-row cliff: the time bar itself is
    the benchmark's, docs/training_kernels.md)."""
    from twell.bench.ffn import dense_train_ffn
    from twell.bench.memory import peak_memory_above_baseline
    from twell.timing import time_alternating

    inp = calibrated_ffn_inputs(8192, 2048, 5632, 1500, 0.1, seed=5, device="cuda")
    nnz, _ = check_case(inp.x, inp.w_gate, inp.w_up, inp.w_down, coef=2e-5 * 2048)
    assert bool((nnz > ref.TRAIN_SLOTS).float().mean() > 0.99)
    leaves = [t.detach().clone().requires_grad_(True) for t in (inp.x, inp.w_gate, inp.w_up, inp.w_down)]
    dy = torch.randn(inp.x.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).cuda()
    coef = torch.tensor(2e-5, device="cuda")

    def step(fn):
        def call():
            out, l1 = fn(*leaves)[:2]
            return torch.autograd.grad((out, l1), leaves, (dy, coef))
        return call

    peaks = {name: peak_memory_above_baseline(step(fn), "cuda")
             for name, fn in (("dense", dense_train_ffn), ("kernel", ktrain.train_gated_ffn))}
    t = time_alternating({"dense": step(dense_train_ffn), "kernel": step(ktrain.train_gated_ffn)}, "cuda", reps=10)
    ratio = t["dense"].median_ms / t["kernel"].median_ms
    print(f"near-dense: peak {peaks['kernel'] / 2**20:.0f} MB against dense {peaks['dense'] / 2**20:.0f} MB; "
          f"{ratio:.2f}x dense time")
    assert peaks["kernel"] <= peaks["dense"], peaks
    assert ratio > 0.5, ratio


def test_forward_queues_behind_a_busy_gpu():
    """The debug mode above sees only PyTorch's own syncs; a library call that waits for the stream
    (a segmented sort that reads its segment groups back, say) would not show there. Here the forward is
    queued behind ~1 s of GPU sleep: if anything in it waits for the GPU, the calls take that second."""
    leaves = [t.requires_grad_(True) for t in _random(4096, 512, 1408, bias=-2.0, seed=11)]
    keep = [ktrain.train_gated_ffn(*leaves, slots=16) for _ in range(4)]  # pinned blocks for the sizes, as in a loop
    assert int((keep[0][2] > 16).sum()) > 0  # heavy rows: the dense path is in the check
    torch.cuda.synchronize()
    del keep
    torch.cuda._sleep(int(2e9))
    t0 = time.perf_counter()
    outs = [ktrain.train_gated_ffn(*leaves, slots=16) for _ in range(3)]
    queued = time.perf_counter() - t0
    torch.cuda.synchronize()
    slept = time.perf_counter() - t0
    assert slept > 0.3, f"the GPU sleep was too short to tell ({slept:.3f} s)"
    assert queued < 0.25 * slept, f"the forward waited for the GPU: {queued:.3f} s of a {slept:.3f} s sleep"
    assert all(torch.isfinite(o[0]).all() for o in outs)


def test_double_backward_raises():
    leaves = [t.requires_grad_(True) for t in _random(64, 128, 256, bias=-1.0)]
    out, l1, _, _ = ktrain.train_gated_ffn(*leaves)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.float().square().sum() + l1, leaves, create_graph=True)


def test_long_neurons_are_chunked():
    """A neuron active on every row: its weight gradients sum several chunks of the entry list."""
    x, wg, wu, wd = _random(3000, 512, 300, bias=-3.0)
    wg[0] = 0
    wg[0, 0] = 1.0  # neuron 0: gate = 1 on every row
    nnz, _ = check_case(x, wg, wu, wd)
    assert nnz.min() >= 1


@pytest.mark.parametrize("H, slots", [(5632, 16), (700, 1024), (52000, 16), (52000, 24)])
def test_work_list_holds_each_neurons_entries_in_row_order(H, slots):
    """The weight-gradient work list: every light row's entries, grouped by neuron, rows ascending within
    each (the fixed summation order). Banded placement where shared memory allows (the first two shapes),
    the sort for very wide layers (the last two: on the row bits alone where slots is a power of two, on
    the whole entry index where it is not)."""
    from twell.kernels.build import load

    g = torch.Generator().manual_seed(H + slots)
    M = 300
    nnz = torch.randint(0, slots + 6, (M,), generator=g, dtype=torch.int32)  # some rows heavy (> slots)
    nnz[:3] = torch.tensor([0, slots, slots + 1], dtype=torch.int32)
    nnz.clamp_(max=H)
    idx = torch.zeros(M, slots, dtype=torch.int32)
    hot = torch.randperm(H, generator=g)[:8]  # a few neurons active on many rows: long segments
    for r in range(M):
        n = min(int(nnz[r]), slots)
        cols = list(dict.fromkeys(torch.cat([hot[torch.randperm(8, generator=g)[:4]],
                                             torch.randperm(H, generator=g)[: n + 4]]).tolist()))[:n]
        idx[r, :n] = torch.tensor(cols, dtype=torch.int32)[torch.randperm(n, generator=g)]  # any order in a row
    ent, items, longs, totals = load().train_worklist(idx.cuda(), nnz.cuda(), H, slots, ktrain.COLUMN_CHUNK)
    light = [(int(idx[r, k]), r, r * slots + k) for r in range(M) if nnz[r] <= slots for k in range(int(nnz[r]))]
    want = torch.tensor([e for _, _, e in sorted(light)], dtype=torch.int32)
    assert torch.equal(ent[: want.numel()].cpu(), want)


def test_zero_rows_input():
    x, wg, wu, wd = _random(0, 64, 128)
    out, l1, nnz, act = ktrain.train_gated_ffn(x, wg, wu, wd)
    assert out.shape == (0, 64) and nnz.shape == (0,) and not act.any()


def test_deterministic():
    x, wg, wu, wd = _random(2048, 512, 1408, bias=-2.0, seed=5)
    dy = torch.randn_like(x)
    a, _, _ = _run(ktrain.train_gated_ffn, x, wg, wu, wd, dy, 0.1, 128)
    b, _, _ = _run(ktrain.train_gated_ffn, x, wg, wu, wd, dy, 0.1, 128)
    for name, s, t in zip(NAMES, a, b):
        assert torch.equal(s, t), name


def test_bad_inputs():
    x, wg, wu, wd = _random(16, 64, 128)
    with pytest.raises(ValueError, match="w_down"):
        ktrain.train_gated_ffn(x, wg, wu, wd.t().contiguous())
    with pytest.raises(TypeError, match="bfloat16"):
        ktrain.train_gated_ffn(x.float(), wg, wu, wd)
    with pytest.raises(ValueError, match="multiple of 8"):
        ktrain.train_gated_ffn(*_random(16, 60, 128))
    with pytest.raises(ValueError, match="at most 8192"):
        ktrain.train_gated_ffn(*_random(4, 8200, 16))
    with pytest.raises(ValueError, match="slots"):
        ktrain.train_gated_ffn(x, wg, wu, wd, slots=0)


def test_compiles_without_graph_break():
    x, wg, wu, wd = _random(512, 256, 640, bias=-2.0)
    leaves = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]

    def f(x, wg, wu, wd):
        out, l1, _, _ = ktrain.train_gated_ffn(x, wg, wu, wd)
        return (out.float().square().sum() + l1)

    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(*leaves)
    loss.backward()
    eager = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    f(*eager).backward()
    for a, b in zip(leaves, eager):
        assert torch.equal(a.grad, b.grad)


def _gate_counts(x, wg):
    return (torch.nn.functional.linear(x, wg) > 0).sum(0)


@pytest.mark.parametrize("M,D,H,bias,slots,min_freq", [
    (37, 136, 200, -1.5, 16, 0.05),
    (300, 264, 777, -2.0, 8, 0.02),
    (1000, 512, 1408, -2.5, 128, 0.01),
    (2048, 2048, 5632, -2.4, 128, 0.02),
])
def test_hot_neurons_random_shapes(M, D, H, bias, slots, min_freq):
    """Hot neurons as dense columns, the rest on the pair kernels: the same results as without."""
    x, wg, wu, wd = _random(M, D, H, seed=M, bias=bias)
    wg[3] = 0
    wg[3, 0] = 1.0  # a neuron active on every row: hot
    hot = ref.choose_hot(_gate_counts(x, wg), M, min_freq, multiple=8)
    assert 3 in hot.tolist()
    check_case(x, wg, wu, wd, slots=slots, hot=hot)


def test_hot_neurons_any_set():
    """Any increasing set is exact: never-active neurons, a single one, every neuron (the cold pass then
    sees an all-zero gate), and rows heavy only through their hot neurons (light in the cold pass)."""
    x, wg, wu, wd = _random(700, 256, 640, bias=-2.0, seed=2)
    wg[:40] = 0
    wg[:40, 0] = 1.0  # 40 neurons on every row: every row heavy at 16 slots, light once they are hot
    nnz, _ = check_case(x, wg, wu, wd, slots=16)
    assert bool((nnz > 16).all())
    for hot in (torch.arange(40), torch.tensor([5]), torch.arange(640), torch.arange(600, 640),
                torch.arange(0, 640, 7)):
        check_case(x, wg, wu, wd, slots=16, hot=hot.cuda())
    x[9:20] = 0
    check_case(x, wg, wu, wd, slots=16, hot=torch.arange(64).cuda())


def test_hot_neurons_deterministic_and_compiled():
    x, wg, wu, wd = _random(1024, 256, 640, bias=-2.0, seed=7)
    hot = ref.choose_hot(_gate_counts(x, wg), 1024, 0.02, multiple=16)
    assert hot.numel() > 0
    dy = torch.randn_like(x)
    run = functools.partial(ktrain.train_gated_ffn, hot=hot)
    a, _, _ = _run(run, x, wg, wu, wd, dy, 0.1, 128)
    b, _, _ = _run(run, x, wg, wu, wd, dy, 0.1, 128)
    for name, s, t in zip(NAMES, a, b):
        assert torch.equal(s, t), name

    def f(x, wg, wu, wd, hot):
        out, l1, _, _ = ktrain.train_gated_ffn(x, wg, wu, wd, hot=hot)
        return out.float().square().sum() + l1

    leaves = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    torch.compile(f, fullgraph=True)(*leaves, hot).backward()
    eager = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    f(*eager, hot).backward()
    for a, b in zip(leaves, eager):  # inductor fuses the hot part's elementwise steps: bf16 roundings differ
        assert _rel(a.grad, b.grad) < 1e-2


def test_hot_neurons_bad_sets():
    x, wg, wu, wd = _random(16, 64, 128)
    with pytest.raises(ValueError, match="int64"):
        ktrain.train_gated_ffn(x, wg, wu, wd, hot=torch.arange(4, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="device"):
        ktrain.train_gated_ffn(x, wg, wu, wd, hot=torch.arange(4))


def test_bench_hot_impl_chooses_each_cases_own_set():
    """The benchmark's hot implementation keeps one case's set for its timed calls and never hands it to the next
    case, even when the next case's tensors take the freed memory of the previous one's."""
    from twell.bench.registry import default_registry

    fn = default_registry().resolve("twell-train-kernel-hot", "training")
    sets = []
    for first in (0, 100):
        x, wg, wu, wd = _random(1024, 256, 640, bias=-2.0, seed=first)
        wg[first:first + 64] = 0
        wg[first:first + 64, 0] = 1.0  # 64 neurons on every row, a different 64 per case
        sets.append(fn.describe(x, wg, wu, wd))
        got = fn(*(t.clone().requires_grad_(True) for t in (x, wg, wu, wd)))
        assert got[0].shape == x.shape
        del x, wg, wu, wd, got
    # each case's set takes most of its own pairs (a set left from the other case would take few: its 64 neurons
    # are different ones)
    assert all(s["hot_neurons"] >= 64 and s["hot_pair_share"] > 0.5 for s in sets)
    hot = fn.describe(*_random(1024, 256, 640, bias=-3.5, seed=100))
    assert hot["hot_neurons"] == 0  # the same shapes, gates almost always shut: none of the earlier cases' sets


def test_a_layer_hands_its_hot_set_to_the_op(monkeypatch):
    """SparseFFN on the kernels' route passes the backend's hot set to the op, and trains as without it."""
    from twell.nn import SparseFFN
    from twell.nn.sparse_training import SparseTraining

    torch.manual_seed(0)
    f = SparseFFN(256, 640).to(torch.bfloat16).cuda()
    with torch.no_grad():
        f.gate_proj.weight[:, 0] = -2.0
        f.gate_proj.weight[:32, 0] = 1.0
    f.track = True
    f.train_backend = SparseTraining(min_rows=0, start="sparse")
    x = torch.randn(2, 512, 256, device="cuda")
    x[..., 0] = 1.0
    x = x.to(torch.bfloat16).requires_grad_(True)
    seen = []
    real = ktrain.train_gated_ffn

    def spy(*a, **kw):
        seen.append(kw.get("hot"))
        return real(*a, **kw)

    monkeypatch.setattr(ktrain, "train_gated_ffn", spy)
    outs = []
    for hot in (None, torch.arange(64, device="cuda")):
        f.train_backend.set_hot(f, hot)
        out = f(x)
        (out.float().square().sum() + f.stats.l1).backward()
        outs.append([out.detach(), x.grad.clone(), f.gate_proj.weight.grad.clone()])
        x.grad = None
        f.zero_grad()
    assert seen[0] is None and seen[1].tolist() == list(range(64))
    for a, b in zip(*outs):
        assert _rel(a, b) < 1e-2


def test_time_layer_picks_the_fastest_route_it_timed():
    """Per-layer timing on the layer's own rows: every route timed on the kernels, the choice the fastest of
    its own timings, and a sparse choice only where it beat dense (by the margin)."""
    from twell.train.calibration import time_layer

    x, wg, wu, wd = _random(8192, 512, 1408, bias=-2.5, seed=11)
    wg[:64] = 0
    wg[:64, 0] = 1.0  # 64 neurons on every row
    rec, hot = time_layer(x, wg, wu, wd, hot_min_freq=0.02, reps=5, warmup=2)
    assert hot is not None and rec["hot_pair_share"] > 0.5
    ms = {"dense": rec["dense_ms"], "sparse": rec["sparse_ms"], "hot": rec["hot_ms"]}
    fastest_sparse = min(("sparse", "hot"), key=ms.get)
    if rec["route"] == "dense":
        assert ms[fastest_sparse] * rec["margin"] >= ms["dense"]
    else:
        assert rec["route"] == fastest_sparse and ms[fastest_sparse] * rec["margin"] < ms["dense"]
