"""Gate variants (FATReLU, dReLU): the reference ops, the training op's gradients, SparseFFN's dense and
reference paths and the planner's routes, each against an fp64 computation written here."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from twell import reference
from twell.nn import SparseFFN
from twell.reference.training import train_gated_ffn

BF = torch.bfloat16


def _inputs(M, D, H, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, D, generator=g) * scale).to(BF)
    wg = (torch.randn(H, D, generator=g) / D ** 0.5).to(BF)
    wu = (torch.randn(H, D, generator=g) / D ** 0.5).to(BF)
    wd = (torch.randn(D, H, generator=g) / H ** 0.5).to(BF)
    return x, wg, wu, wd


def _expected(x, wg, wu, wd, threshold=0.0, up_relu=False):
    """fp64 FFN of the variant. The gate's activity is decided on the bf16 gate (what every path compares),
    the products in fp64."""
    g_bf = F.linear(x, wg)
    keep = g_bf > threshold
    g = x.double() @ wg.double().t()
    u = x.double() @ wu.double().t()
    if up_relu:
        u = u.clamp_min(0)
    return ((g * keep) * u) @ wd.double().t()


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


VARIANTS = [(0.0, False), (0.25, False), (0.6, False), (0.0, True), (0.3, True)]


@pytest.mark.parametrize("threshold,up_relu", VARIANTS)
@pytest.mark.parametrize("M,D,H", [(37, 64, 300), (5, 128, 1024)])
def test_reference_ops_compute_the_variant(threshold, up_relu, M, D, H, seed):
    x, wg, wu, wd = _inputs(M, D, H, seed)
    wdt = wd.t().contiguous()
    want = _expected(x, wg, wu, wd, threshold, up_relu)
    out = reference.sparse_gated_ffn(x, wg, wu, wdt, threshold=threshold, up_relu=up_relu)
    err = _rel(out, want)
    assert err < 1e-2
    two = reference.twell_gated_ffn(x, reference.twell_gate(x, wg, threshold=threshold), wu, wdt, up_relu=up_relu)
    assert torch.equal(two, out)
    if M <= reference.DECODE_MAX_ROWS:
        dec = reference.decode_gated_ffn(x, wg, wu, wdt, threshold=threshold, up_relu=up_relu)
        assert _rel(dec, want) < 1e-2
    if threshold or up_relu:  # the variant changes the answer: a test that ignored it would fail
        assert _rel(reference.sparse_gated_ffn(x, wg, wu, wdt), want) > 3 * max(err, 1e-3)


def test_fatrelu_gate_keeps_only_values_above_the_threshold(seed):
    x, wg, _, _ = _inputs(40, 64, 256, seed)
    t = 0.2
    gate = reference.twell_gate(x, wg, threshold=t).unpack()
    g = F.linear(x, wg)
    assert torch.equal(gate, torch.where(g > t, g, torch.zeros_like(g)))
    assert bool((gate[gate != 0] > t).all()) and bool(((g > 0) & (g <= t)).any())


def test_nan_gate_stays_active_and_bad_settings_raise():
    x = torch.zeros(2, 64, dtype=BF)
    x[0, 0] = float("nan")
    _, wg, wu, wd = _inputs(2, 64, 128, 0)
    out = reference.sparse_gated_ffn(x, wg, wu, wd.t().contiguous(), threshold=0.5)
    assert bool(out[0].isnan().all()) and bool((out[1] == 0).all())
    for bad in (-0.1, float("nan"), float("inf"), "0.1", True):
        with pytest.raises(ValueError, match="threshold"):
            reference.twell_gate(x, wg, threshold=bad)
    with pytest.raises(ValueError, match="up_relu"):
        reference.sparse_gated_ffn(x, wg, wu, wd.t().contiguous(), up_relu=1)


def test_kernel_ops_refuse_the_variants_before_any_work():
    """No GPU needed: the refusal comes before the kernels' own checks, and names the variant."""
    from twell import kernels
    from twell.kernels.training import train_gated_ffn as kernel_train

    x, wg, wu, wd = _inputs(4, 64, 128, 1)
    wdt = wd.t().contiguous()
    cases = [
        (lambda: kernels.twell_gate(x, wg, threshold=0.01), "FATReLU"),
        (lambda: kernels.sparse_gated_ffn(x, wg, wu, wdt, threshold=0.01), "FATReLU"),
        (lambda: kernels.sparse_gated_ffn(x, wg, wu, wdt, up_relu=True), "dReLU"),
        (lambda: kernels.twell_gated_ffn(x, reference.twell_gate(x, wg), wu, wdt, up_relu=True), "dReLU"),
        (lambda: kernel_train(x, wg, wu, wd, threshold=0.03), "FATReLU"),
    ]
    for call, word in cases:
        with pytest.raises(ValueError, match=word):
            call()


@pytest.mark.parametrize("threshold,up_relu", [(0.1, False), (0.0, True), (0.05, True)])
def test_training_reference_gradients(threshold, up_relu, seed):
    """FATReLU's gradient is zero where g <= t; dReLU's up gradient is zero where u <= 0 too."""
    x, wg, wu, wd = _inputs(48, 64, 256, seed)
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    out, l1, nnz, active = train_gated_ffn(*leaves, threshold=threshold, up_relu=up_relu)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(BF)
    (out.float() * dout.float()).sum().backward()

    xd, wgd, wud, wdd = (t.double() for t in (x, wg, wu, wd))
    g_bf, u_bf = F.linear(x, wg), F.linear(x, wu)
    gm = (g_bf > threshold).double()
    um = (u_bf > 0).double() if up_relu else torch.ones_like(gm)
    g, u = xd @ wgd.t(), xd @ wud.t()
    uu = u * um
    dh = dout.double() @ wdd
    dg = dh * uu * gm
    du = dh * g * gm * um
    want = {"w_gate": dg.t() @ xd, "w_up": du.t() @ xd, "w_down": dout.double().t() @ ((g * gm) * uu),
            "x": dg @ wgd + du @ wud}
    got = {"x": leaves[0].grad, "w_gate": leaves[1].grad, "w_up": leaves[2].grad, "w_down": leaves[3].grad}
    for name in want:
        assert _rel(got[name], want[name]) < 2e-2, name
    both = (g_bf > threshold) & ((u_bf > 0) if up_relu else True)
    assert torch.equal(nnz, both.sum(-1, dtype=torch.int32)) and torch.equal(active, both.any(0))
    assert torch.allclose(l1, ((g * gm) * uu).abs().sum(-1).mean().float(), rtol=2e-2)


def _layer(activation, threshold, seed, D=64, H=256):
    torch.manual_seed(seed)
    f = SparseFFN(D, H, activation=activation, threshold=threshold, path="dense").to(BF)
    return f


@pytest.mark.parametrize("activation,threshold", [("fatrelu", 0.05), ("drelu", 0.0), ("relu", 0.0)])
def test_sparse_ffn_dense_and_reference_paths(activation, threshold, seed):
    f = _layer(activation, threshold, seed)
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(seed)).to(BF)
    want = _expected(x, f.gate_proj.weight, f.up_proj.weight, f.down_proj.weight, threshold, activation == "drelu")
    with torch.no_grad():
        dense = f(x)
        assert f.last_path == "dense" and _rel(dense, want) < 1e-2
        f.path = "reference"
        ref = f(x)
        assert f.last_path == "twell-reference" and _rel(ref, want) < 1e-2
        f.path = "auto"
        auto = f(x)
        assert f.last_path == "twell-reference" and "input on cpu" in f.last_route.reason
        assert torch.equal(auto, ref)
        f.decode_rows = 16
        few = f(x[:3])
        assert _rel(few, want[:3]) < 1e-2


def test_sparse_ffn_tracking_counts_the_variant_active_neurons(seed):
    f = _layer("drelu", 0.0, seed)
    f.track = True
    x = torch.randn(20, 64).to(BF)
    with torch.no_grad():
        f(x)
    g, u = f.gate_proj(x), f.up_proj(x)
    assert torch.equal(f.stats.active_per_token, ((g > 0) & (u > 0)).sum(-1, dtype=torch.int32))


def test_explicit_kernel_path_on_a_variant_raises_with_the_reason():
    """Of the kernels only the decoding op computes the variants: an explicit kernel path on more rows than
    it takes raises, naming the variant (on a machine without the kernels, that they are unavailable)."""
    f = _layer("fatrelu", 0.03, 0)
    f.path = "kernel"
    with torch.no_grad(), pytest.raises((ValueError, RuntimeError), match="FATReLU.*threshold 0.03|unavailable"):
        f(torch.randn(64, 64).to(BF))
    d = _layer("drelu", 0.0, 0)
    d.path = "kernel"
    with torch.no_grad(), pytest.raises((ValueError, RuntimeError), match="dReLU|unavailable"):
        d(torch.randn(64, 64).to(BF))


def test_planner_routes_variants_exactly_and_says_why():
    from twell.nn import routing
    from tests.test_routing import FakeX, _state

    why = "FATReLU (gate threshold 0.01): the kernels' gate epilogue compares against 0 only"
    st = _state(activation="fatrelu", gate_why=why, auto_dense=None, activity=None, decode_max_rows=0)
    r = routing.plan(st, FakeX(65536), grad_enabled=False)  # a CUDA input: dense, exact, with the reason
    assert r.op == "dense" and r.measure and why in r.reason and why in r.note
    r = routing.plan(st, FakeX(64, cuda=False), grad_enabled=False)
    assert r.op == "sparse" and r.impl == "reference"
    r = routing.plan(_state(activation="fatrelu", gate_why=why, path="reference"), FakeX(4096), grad_enabled=False)
    assert r.impl == "reference"
    # the decoding op computes the variants: an explicit kernel path takes it on few rows, raises on more
    r = routing.plan(_state(activation="fatrelu", gate_why=why, path="kernel"), FakeX(8), grad_enabled=False)
    assert r.op == "decode" and r.impl == "kernel" and why in r.reason
    with pytest.raises(ValueError, match="decoding op only.*FATReLU.*4096 rows"):
        routing.plan(_state(activation="fatrelu", gate_why=why, path="kernel"), FakeX(4096), grad_enabled=False)
    with pytest.raises(ValueError, match="FATReLU"):  # where the decoding op cannot run it either
        routing.plan(_state(activation="fatrelu", gate_why=why, path="kernel", no_decode_why="misaligned"),
                     FakeX(8), grad_enabled=False)
    # training: the kernel op cannot, the reference op can
    r = routing.plan_training(st, FakeX(8192), sparse=True, impl="kernel")
    assert r.op == "dense" and why in r.reason
    with pytest.raises(ValueError, match="FATReLU"):
        routing.plan_training(st, FakeX(8192), sparse=True, impl="kernel", strict="train.sparse_kernels=always")
    assert routing.plan_training(st, FakeX(8192), sparse=True, impl="reference").op == "train"
    # ReLU: no gate reason, the kernels' route as before
    assert routing.plan(_state(), FakeX(65536), grad_enabled=False).impl == "kernel"


def test_training_through_the_module_uses_the_variant(seed):
    f = _layer("fatrelu", 1.0, seed)
    f.path = "reference"
    x = torch.randn(8, 64).to(BF).requires_grad_()
    out = f(x)
    assert f.last_path == "train-reference"
    out.float().sum().backward()
    g = f.gate_proj(x.detach())
    dead = (g <= 1.0).all(0)  # neurons inactive on every row get no gate gradient, the others do
    assert bool(dead.any()) and bool((f.gate_proj.weight.grad[dead] == 0).all())
    assert bool((f.gate_proj.weight.grad[~dead] != 0).any(1).all())


def test_layer_settings_are_checked():
    with pytest.raises(ValueError, match="needs activation='fatrelu'"):
        SparseFFN(64, 128, activation="relu", threshold=0.1)
    with pytest.raises(ValueError, match="gated=True"):
        SparseFFN(64, 128, activation="drelu", gated=False)
    with pytest.raises(ValueError, match="threshold"):
        SparseFFN(64, 128, activation="fatrelu", threshold=-1.0)
    f = SparseFFN(64, 128, activation="fatrelu", threshold=0.02)
    assert "threshold=0.02" in repr(f) and f.gate_settings() == (0.02, False)
    assert SparseFFN(64, 128, activation="drelu").gate_settings() == (0.0, True)


def _decode_only_layer(activation, threshold, D, H):
    """A CUDA layer on "auto" with a few percent of neurons active on :func:`_positive_rows`: FATReLU through
    its threshold, dReLU (and ReLU) through gate weights shifted down by about one gate std."""
    f = _layer(activation, threshold, 0, D=D, H=H).cuda()
    if activation != "fatrelu":
        with torch.no_grad():
            f.gate_proj.weight -= 0.7 / D
    f.path = "auto"
    return f


def _positive_rows(M, D, seed):
    return torch.randn(M, D, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).abs().to(BF)


@pytest.mark.gpu
@pytest.mark.parametrize("activation,threshold,D,H", [
    ("fatrelu", 1.0, 2048, 5632), ("drelu", 0.0, 2048, 5632),
    ("relu", 0.0, 8256, 2048),  # wider than the other kernels take: only the decoding op runs it
    ("fatrelu", 1.0, 1536, 3840),
])
def test_on_cuda_auto_runs_a_decode_only_layer_dense_then_on_the_decoding_op(activation, threshold, D, H):
    """A layer of the kernels only the decoding op runs: "auto" runs it dense (exactly PyTorch's), measures
    its activity on that call, then takes the decoding op on up to decode_max_rows rows (the same values as
    calling the op) and dense on more."""
    from twell import kernels

    f = _decode_only_layer(activation, threshold, D, H)
    x = _positive_rows(256, D, 1)
    with torch.no_grad():
        out = f(x)
        assert f.last_path == "dense" and f.last_route.measure, f.last_route
        pre, h = f.hidden(x)
        assert torch.equal(out, f.down_proj(h))
        activity = f.layer_state().activity
        assert 0.01 < activity < 0.2, activity
        n = f.decode_max_rows()
        assert 1 <= n <= f.decode_rows
        for rows in sorted({1, n}):
            y = _positive_rows(rows, D, 2 + rows)
            out = f(y)
            assert f.last_route.op == "decode" and f.last_path == "twell-kernel", f.last_route
            want = kernels.decode_gated_ffn(y, f.gate_proj.weight, f.up_proj.weight,
                                            f.down_proj.weight.t().contiguous(), **f._gate_kwargs())
            assert torch.equal(out, want)
            assert _rel(out, f.down_proj(f.hidden(y)[1]).double()) < 1e-2
        y = _positive_rows(n + 1, D, 99)
        assert torch.equal(f(y), f.down_proj(f.hidden(y)[1])) and f.last_path == "dense"
        assert f"up to {n} rows" in f.auto_note


@pytest.mark.gpu
def test_on_cuda_auto_runs_a_variant_dense_and_exact():
    """On many rows "auto" takes dense for FATReLU and dReLU layers (of the kernels only the decoding op
    computes them), with the reason in the Route, and the output is dense PyTorch's."""
    for activation, threshold in (("fatrelu", 0.05), ("drelu", 0.0)):
        f = _layer(activation, threshold, 0, D=2048, H=5632).cuda()
        f.path = "auto"
        x = torch.randn(4096, 2048, device="cuda").to(BF)
        with torch.no_grad():
            out = f(x)
            assert f.last_path == "dense" and "the kernels'" in f.last_route.reason
            g, u = f.gate_proj(x), f.up_proj(x)
            h = torch.where(g > threshold, g, 0) * (torch.relu(u) if activation == "drelu" else u)
            assert torch.equal(out, f.down_proj(h))


@pytest.mark.gpu
@pytest.mark.parametrize("threshold,up_relu", [(0.0, False), (0.01, False), (0.3, False), (0.0, True)])
@pytest.mark.parametrize("shape", [(1, 11008), (7, 333), (64, 5632), (3, 5, 24)])
def test_gate_product_kernel_is_the_references_bits(threshold, up_relu, shape):
    """twell.kernels.gate_product gives twell.reference.gates.hidden's bits, signed zeros, NaN, inf and values at
    the threshold (in bf16) included, on contiguous and odd shapes."""
    from twell import kernels
    from twell.reference.gates import hidden

    gen = torch.Generator("cuda").manual_seed(hash((threshold, up_relu, shape)) % 2**31)
    g = torch.randn(shape, device="cuda", generator=gen).to(BF)
    u = torch.randn(shape, device="cuda", generator=gen).to(BF)
    flat_g, flat_u = g.view(-1), u.view(-1)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, threshold, -threshold],
                           device="cuda").to(BF)
    n = min(special.numel(), flat_g.numel())
    flat_g[:n] = special[:n]
    flat_u[-n:] = special[:n]
    got = kernels.gate_product(g, u, threshold, up_relu)
    want = hidden(g, u, threshold, up_relu)
    assert got.shape == want.shape and got.dtype == BF
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and bool(nan.any())
    # bit for bit (signed zeros too) where not NaN; NaN payloads may differ
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_gate_product_refuses_what_it_cannot_run():
    from twell import kernels

    with pytest.raises(ValueError, match="bf16 CUDA"):
        kernels.gate_product(torch.zeros(4, 8).to(BF), torch.zeros(4, 8).to(BF), 0.01)
    with pytest.raises(ValueError, match="threshold"):
        kernels.gate_product(torch.zeros(4, 8).to(BF), torch.zeros(4, 8).to(BF), -1.0)
