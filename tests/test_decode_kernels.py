"""The decoding FFN kernel (csrc/twell_decode.cu) against the pure-PyTorch reference and fp32: random
and odd shapes for every row count it takes, the benchmark's sparsity cases, all-zero and fully
active gates, non-finite inputs, determinism, CUDA graph replay and a compiled caller (GPU only)."""
from __future__ import annotations

import pytest
import torch

from twell import kernels
from twell.bench.generator import calibrated_ffn_inputs
from twell.reference import DECODE_MAX_ROWS, decode_gated_ffn, dense_gated_ffn

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_ready")]


def _rel(a, b):
    a, b = a.float(), b.float()
    den = b.norm()
    return float((a - b).norm() / den) if den > 0 else float((a - b).norm())


def _weights(M, D, H, seed, scale=1.0, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(M, D, generator=g)
    ws = [torch.randn(H, D, generator=g) * (scale / D ** 0.5) for _ in range(3)]
    return [t.to(torch.bfloat16).to(device) for t in (x, *ws)]  # x, w_gate, w_up, w_down_t


def _dense_fp32(x, w_gate, w_up, w_down_t):
    """The same FFN in dense fp32 PyTorch: relu(x w_gate^T) * (x w_up^T), then w_down."""
    xf = x.float()
    return (torch.relu(xf @ w_gate.float().t()) * (xf @ w_up.float().t())) @ w_down_t.float()


def check(x, w_gate, w_up, w_down_t, factor=2.0, floor=2e-3):
    """Kernel within ``factor`` x dense bf16's error against fp32 (+ floor), and near the reference."""
    got = kernels.decode_gated_ffn(x, w_gate, w_up, w_down_t)
    ref = decode_gated_ffn(x, w_gate, w_up, w_down_t)
    dense = dense_gated_ffn(x, w_gate, w_up, w_down_t.t())
    truth = _dense_fp32(x, w_gate, w_up, w_down_t)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert torch.isfinite(got).all()
    e_k, e_d = _rel(got, truth), _rel(dense, truth)
    assert e_k <= factor * e_d + floor, f"kernel {e_k:.3e} vs dense bf16 {e_d:.3e} against fp32"
    assert _rel(got, ref) <= 2 * e_d + floor
    return got


@pytest.mark.parametrize("M", [1, 2, 3, 7, 8, 9, 15, 16, 17, 24, 31, 32])
def test_rows_random(M):
    check(*_weights(M, 256, 320, seed=M))


@pytest.mark.parametrize("D,H", [(64, 1), (64, 17), (128, 1000), (192, 5632), (2048, 5632), (4096, 2050)])
def test_odd_shapes(D, H):
    for M in (1, 5, 20):
        check(*_weights(M, D, H, seed=D + H + M))


@pytest.mark.parametrize("nnz", [8, 29, 64])
@pytest.mark.parametrize("M", [1, 4, 16, 32])
def test_benchmark_cases(nnz, M):
    inp = calibrated_ffn_inputs(M, 2048, 5632, nnz, tail=0.0, seed=nnz, device="cuda")
    check(inp.x, inp.w_gate, inp.w_up, inp.w_down.t().contiguous())


def test_no_active_neuron_gives_zeros():
    x, w_gate, w_up, w_down_t = _weights(4, 128, 96, seed=1)
    w_gate = -w_gate.abs()
    x = x.abs()
    out = kernels.decode_gated_ffn(x, w_gate, w_up, w_down_t)
    assert torch.equal(out, torch.zeros_like(out))


def test_every_neuron_active():
    x, w_gate, w_up, w_down_t = _weights(6, 256, 640, seed=2)
    x, w_gate = x.abs(), w_gate.abs()
    check(x, w_gate, w_up, w_down_t)


def test_nan_row_stays_in_its_row():
    x, w_gate, w_up, w_down_t = _weights(5, 128, 200, seed=3)
    x[2, 7] = float("nan")
    out = kernels.decode_gated_ffn(x, w_gate, w_up, w_down_t)
    assert torch.isnan(out[2]).all()
    keep = [0, 1, 3, 4]
    xk = x[keep].contiguous()
    assert torch.isfinite(out[keep]).all()
    truth, dense = _dense_fp32(xk, w_gate, w_up, w_down_t), dense_gated_ffn(xk, w_gate, w_up, w_down_t.t())
    assert _rel(out[keep], truth) <= 2 * _rel(dense, truth) + 2e-3
    assert _rel(out[keep], decode_gated_ffn(xk, w_gate, w_up, w_down_t)) < 1e-2


def test_deterministic():
    inp = calibrated_ffn_inputs(16, 2048, 5632, 29, tail=0.5, seed=7, device="cuda")
    args = (inp.x, inp.w_gate, inp.w_up, inp.w_down.t().contiguous())
    first = kernels.decode_gated_ffn(*args)
    for _ in range(5):
        assert torch.equal(kernels.decode_gated_ffn(*args), first)


def test_cuda_graph_replay():
    inp = calibrated_ffn_inputs(8, 2048, 5632, 29, tail=0.0, seed=8, device="cuda")
    w = (inp.w_gate, inp.w_up, inp.w_down.t().contiguous())
    x = inp.x.clone()
    eager = kernels.decode_gated_ffn(x, *w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kernels.decode_gated_ffn(x, *w)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.decode_gated_ffn(x, *w)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x.copy_(calibrated_ffn_inputs(8, 2048, 5632, 29, tail=0.0, seed=9, device="cuda").x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, kernels.decode_gated_ffn(x, *w))


def test_compiled_caller_has_no_graph_break():
    x, w_gate, w_up, w_down_t = _weights(3, 256, 512, seed=4)

    def f(x):
        return kernels.decode_gated_ffn(x * 2, w_gate, w_up, w_down_t) + 1

    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(x), f(x))


def test_rejects_bad_inputs():
    x, w_gate, w_up, w_down_t = _weights(DECODE_MAX_ROWS + 1, 128, 64, seed=5)
    with pytest.raises(ValueError, match="rows"):
        kernels.decode_gated_ffn(x, w_gate, w_up, w_down_t)
    with pytest.raises(ValueError, match="CUDA"):
        kernels.decode_gated_ffn(x[:2].cpu(), w_gate.cpu(), w_up.cpu(), w_down_t.cpu())
    with pytest.raises(ValueError, match="aligned"):
        buf = torch.empty(2 * 128 + 1, dtype=torch.bfloat16, device="cuda")
        kernels.decode_gated_ffn(buf[1:].view(2, 128), w_gate, w_up, w_down_t)


def test_trusted_entry_gives_the_same_bits_and_the_extension_still_checks():
    """decode_gated_ffn_trusted (SparseFFN's eager entry: no Python checks, no custom-op dispatch) returns the
    checked op's bits, and the extension itself refuses what it cannot run."""
    x, w_gate, w_up, w_down_t = _weights(5, 256, 300, 31)
    assert torch.equal(kernels.decode_gated_ffn_trusted(x, w_gate, w_up, w_down_t),
                       kernels.decode_gated_ffn(x, w_gate, w_up, w_down_t))
    buf = torch.empty(5 * 256 + 1, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="aligned"):
        kernels.decode_gated_ffn_trusted(buf[1:].view(5, 256), w_gate, w_up, w_down_t)  # misaligned
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.decode_gated_ffn_trusted(x.float(), w_gate, w_up, w_down_t)
    with pytest.raises(RuntimeError, match="rows"):
        kernels.decode_gated_ffn_trusted(torch.zeros(33, 256, dtype=torch.bfloat16, device="cuda"), w_gate, w_up,
                                         w_down_t)


def _layer(w_gate, w_up, w_down_t):
    from twell.nn import SparseFFN

    H, D = w_gate.shape
    f = SparseFFN(D, H).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        f.gate_proj.weight.copy_(w_gate)
        f.up_proj.weight.copy_(w_up)
        f.down_proj.weight.copy_(w_down_t.t())
    return f


def test_module_picks_its_path_by_rows():
    """"auto" (defaults): the decoding op up to decode_rows rows, dense inside dense_rows, the large-batch op
    past it; "kernel": the decoding op at few rows too; decode_rows = 0 turns the decoding op off."""
    # 2 of 1024 active (0.2%): under "auto"'s activity ceiling at every row count, so rows alone decide
    inp = calibrated_ffn_inputs(3000, 512, 1024, 2, tail=0.0, seed=11, device="cuda")
    w_down_t = inp.w_down.t().contiguous()
    f = _layer(inp.w_gate, inp.w_up, w_down_t)
    with torch.no_grad():
        f(inp.x)  # the first kernel call measures the layer's activity (sparse enough: stays on the kernels)
        assert f.last_path == "twell-kernel"
        for m in (1, 7, f.decode_rows):
            x = inp.x[:m].contiguous()
            out = f(x)
            assert f.last_path == "twell-kernel"
            assert torch.equal(out, kernels.decode_gated_ffn(x, inp.w_gate, inp.w_up, w_down_t)), m
        for m in (f.decode_rows + 1, 500, 2047):
            out = f(inp.x[:m])
            assert f.last_path == "dense" and "dense_rows" in f.auto_note, m
        f.decode_rows, f.dense_rows = 32, (33, 2048)
        x = inp.x[:32].contiguous()
        assert torch.equal(f(x), kernels.decode_gated_ffn(x, inp.w_gate, inp.w_up, w_down_t))
        x = inp.x[:2049].contiguous()
        assert torch.equal(f(x), kernels.sparse_gated_ffn(x, inp.w_gate, inp.w_up, w_down_t))
        assert f.last_path == "twell-kernel"
        f.path = "kernel"
        assert torch.equal(f(inp.x[:100]), kernels.sparse_gated_ffn(inp.x[:100].contiguous(), inp.w_gate, inp.w_up,
                                                                    w_down_t))
        x = inp.x[:5].contiguous()
        assert torch.equal(f(x), kernels.decode_gated_ffn(x, inp.w_gate, inp.w_up, w_down_t))
        f.decode_rows = 0
        assert torch.equal(f(x), kernels.sparse_gated_ffn(x, inp.w_gate, inp.w_up, w_down_t))


def test_dense_by_activity_layer_still_decodes_few_rows():
    """A layer "auto" runs dense by its activity (3% active, past auto_max_active) takes the decoding op on as
    many rows as keep the expected union within DECODE_MAX_UNION (9 rows at 3%), dense past them."""
    inp = calibrated_ffn_inputs(2100, 2048, 5632, 170, tail=0.0, seed=13, device="cuda")
    w_down_t = inp.w_down.t().contiguous()
    f = _layer(inp.w_gate, inp.w_up, w_down_t)
    with torch.no_grad():
        f(inp.x[:2000])  # a prefill (dense by row count) measures the activity: ~3%
        assert f._auto_dense and f.decode_max_rows() == 9, (f._activity, f.decode_max_rows())
        assert "but for the decoding op" in f.auto_note
        for m in (1, 9):
            x = inp.x[:m].contiguous()
            out = f(x)
            assert f.last_path == "twell-kernel"
            assert torch.equal(out, kernels.decode_gated_ffn(x, inp.w_gate, inp.w_up, w_down_t)), m
        for m in (10, 16, 2100):
            f(inp.x[:m])
            assert f.last_path == "dense", m


def test_module_decodes_in_a_cuda_graph():
    inp = calibrated_ffn_inputs(4, 2048, 5632, 29, tail=0.0, seed=12, device="cuda")
    f = _layer(inp.w_gate, inp.w_up, inp.w_down.t().contiguous())
    x = inp.x.clone()
    with torch.no_grad():
        f(inp.x[:1])  # activity measured outside the capture
        eager = f(x)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            f(x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = f(x)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_choose_row_paths_times_each_layer_on_the_gpu():
    """twell.model.choose_row_paths with its real timing (CUDA graph replays): every row count that fits is
    timed for both paths and the layer gets the settings the report gives."""
    from twell.model import ModelConfig, build_model, choose_row_paths, sparse_ffns

    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=2,
                     num_kv_heads=2, max_position_embeddings=128)
    model = build_model(mc).to(device="cuda", dtype=torch.bfloat16).eval()
    for f in sparse_ffns(model):
        f.auto_max_active = 1.0  # a random model is ~50% active: keep its layers on the kernels' route
    ids = torch.randint(0, 97, (1, 128), device="cuda")
    report = choose_row_paths(model, input_ids=ids, rows=(1, 16, 64, 4096), reps=5)
    for r, f in zip(report, sparse_ffns(model)):
        assert r["why"] is None, r["why"]
        assert sorted(r["times"]) == [1, 16, 64]
        assert all(t["dense"] > 0 and t["sparse"] > 0 for t in r["times"].values())
        assert (f.decode_rows, f.dense_rows) == (r["decode_rows"], r["dense_rows"])


def _variant_dense_fp32(x, w_gate, w_up, w_down_t, threshold, up_relu):
    """The gate variant in fp32 on the bf16-rounded gate and up values (twell.reference.gates)."""
    from twell.reference.gates import hidden

    xf = x.float()
    g = (xf @ w_gate.float().t()).to(torch.bfloat16).float()
    u = (xf @ w_up.float().t()).to(torch.bfloat16).float()
    return hidden(g, u, float(torch.tensor(threshold).to(torch.bfloat16)), up_relu) @ w_down_t.float()


@pytest.mark.parametrize("threshold,up_relu", [(0.01, False), (0.8, False), (0.0, True), (0.5, True)])
@pytest.mark.parametrize("M,D,H", [(1, 4096, 11008), (3, 1536, 3840), (8, 256, 320), (20, 64, 17)])
def test_gate_variants(threshold, up_relu, M, D, H):
    """FATReLU and dReLU: the kernel near the reference and the variant's fp32 truth, and the variant changes
    the answer (a kernel that ignored it would fail)."""
    x, wg, wu, wdt = _weights(M, D, H, seed=M + D + H)
    got = kernels.decode_gated_ffn(x, wg, wu, wdt, threshold=threshold, up_relu=up_relu)
    ref = decode_gated_ffn(x, wg, wu, wdt, threshold=threshold, up_relu=up_relu)
    truth = _variant_dense_fp32(x, wg, wu, wdt, threshold, up_relu)
    relu = _dense_fp32(x, wg, wu, wdt)
    assert torch.isfinite(got).all()
    assert _rel(got, ref) < 1e-2 and _rel(got, truth) < 1e-2
    if threshold > 0.1 or up_relu:
        assert _rel(relu, truth) > 0.05  # the variant is not ReLU on these inputs
    # deterministic, and the same as the op's trusted entry (SparseFFN's)
    assert torch.equal(kernels.decode_gated_ffn_trusted(x, wg, wu, wdt, threshold, up_relu), got)


def test_drelu_skips_down_rows_where_the_up_product_is_not_positive():
    """A neuron whose gate is positive but whose up product is not, on every row: its down row is not read
    (a NaN there would otherwise reach the output, as 0 x NaN); under ReLU the same row is read."""
    x, wg, wu, wdt = _weights(2, 256, 64, seed=3)
    wg[5] = x[0] + x[1]  # gate positive on both rows
    wu[5] = -(x[0] + x[1])  # up negative on both
    wdt[5] = float("nan")
    out = kernels.decode_gated_ffn(x, wg, wu, wdt, up_relu=True)
    assert torch.isfinite(out).all()
    assert _rel(out, decode_gated_ffn(x, wg, wu, wdt, up_relu=True)) < 1e-2
    assert torch.isnan(kernels.decode_gated_ffn(x, wg, wu, wdt)).all()


def test_bad_thresholds():
    x, wg, wu, wdt = _weights(1, 64, 32, seed=1)
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="threshold"):
            kernels.decode_gated_ffn(x, wg, wu, wdt, threshold=bad)
