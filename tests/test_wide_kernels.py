"""The inference kernels at D > 2048 (the wide, panelled kernels of csrc/twell_ffn.cu) against fp64, on
random shapes with partial panels (D not a multiple of 2048), heavy rows on both heavy paths, overflowing
tiles recomputed in the kernel, and the one op's overlap with the gate kernel (GPU only)."""
import pytest
import torch
import torch.nn.functional as F

from test_kernels import check_ffn, check_rows, inputs, poison_allocator, poison_twell_blocks, rel, two_ops
from twell import kernels
from twell.formats import TwELL, pack_twell

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_ready", "seed")]

# Panels of 2048 columns: 2112 = 2048 + 64, 2560 = 2048 + 512, 5120 = two full panels + 1024, 8192 = four.
WIDE = [(1, 2112, 300), (77, 2560, 640), (129, 4096, 11008), (1000, 5120, 2000), (300, 8192, 1024)]


@pytest.mark.parametrize("M,D,H", WIDE)
@pytest.mark.parametrize("nnz,tail", [(8, 0.1), (55, 0.1), (29, 0.35)])
def test_wide_gated_ffn_matches_fp64_and_the_one_op(M, D, H, nnz, tail):
    x, wg, wu, wd = inputs(M, D, H, nnz=min(nnz, H // 2), tail=tail)
    wdt = wd.t().contiguous()
    gate = kernels.twell_gate(x, wg)
    ptr = poison_allocator((M, D), torch.bfloat16)
    out = kernels.twell_gated_ffn(x, gate, wu, wdt)
    assert out.data_ptr() == ptr
    check_ffn(out, x, wg, wu, wd)
    assert torch.equal(kernels.sparse_gated_ffn(x, wg, wu, wdt), out)


@pytest.mark.parametrize("M,D,H", [(300, 2560, 640), (1000, 5120, 2000)])
def test_wide_non_gated_ffn_matches_fp64(M, D, H):
    x, wg, wu, wd = inputs(M, D, H, nnz=29, tail=0.35, dense_rows=[0])
    out = kernels.twell_ffn(kernels.twell_gate(x, wg), wd.t().contiguous())
    check_ffn(out, x, None, wg, wd, gated=False)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "non-gated"])
@pytest.mark.parametrize("cap", [None, 0], ids=["dense-path", "heavy-kernel"])
@pytest.mark.parametrize("D,H", [(4096, 5632), (2624, 9000)])
def test_wide_heavy_rows_on_both_heavy_paths(D, H, gated, cap):
    """400 rows with thousands of active neurons: with the dense path on they all take it (at least 384
    are queued), with it off the wide heavy kernel (one CTA per row, each warp a column slice) does them.
    H 5632 gives rows of 22 tiles, more than one group of the heavy kernel's list (16 tiles of 256)."""
    M = 1000
    heavy_rows = list(range(3, 403))
    x, wg, wu, wd = inputs(M, D, H, nnz=29, tail=0.35, dense_rows=heavy_rows, zero_rows=[0, M - 1])
    if not gated:
        wu = wu.clone()
        wu[:, 0] = wg[:, 0]
    gate = kernels.twell_gate(x, wg if gated else wu)
    # the wide light kernel's list holds 256 entries; a row with a tile the full spill area could not take
    # is heavy too (recomputed)
    is_heavy = gate.nnz_per_row().gt(256).cpu()
    is_heavy[gate.overflow_rows.cpu()] = True
    heavy, light = is_heavy.nonzero().flatten().tolist(), (~is_heavy).nonzero().flatten().tolist()
    assert len(heavy) >= 384
    wdt = wd.t().contiguous()

    def run(c=cap):
        return kernels.twell_gated_ffn(x, gate, wu, wdt, dense_cap=c) if gated else kernels.twell_ffn(gate, wdt, dense_cap=c)
    ptr = poison_allocator((M, D), torch.bfloat16)
    out = run()
    assert out.data_ptr() == ptr
    check_rows(out, heavy, x, wg, wu, wd, gated)
    check_rows(out, light, x, wg, wu, wd, gated)
    assert out[[0, M - 1]].eq(0).all()
    assert torch.equal(out, run())  # fixed sum order on every path
    if cap is None:
        off = run(0)
        assert torch.equal(out[light], off[light]) and not torch.equal(out[heavy], off[heavy])


def test_wide_overflow_without_spill_is_recomputed_in_kernel():
    """A TwELL whose overflowing tiles are neither spilled nor backed up densely, but which knows (x, w_gate):
    the wide heavy kernel recomputes those tiles, neuron by neuron, across its warps' column slices."""
    M, D, H = 300, 4096, 1000
    x, wg, wu, wd = inputs(M, D, H, nnz=29, tail=0.35, dense_rows=[3, 9, 100])
    packed = pack_twell(F.relu(F.linear(x, wg))).packed
    gate = TwELL(packed, None, None, H, source=(x, wg))
    assert gate.n_overflow_rows >= 3
    out = kernels.twell_gated_ffn(x, gate, wu, wd.t().contiguous())
    check_ffn(out, x, wg, wu, wd)
    for r in (3, 9, 100):  # each recomputed row on its own (an unwritten row would hold stale memory)
        check_ffn(out[r:r + 1], x[r:r + 1], wg, wu, wd)


@pytest.mark.parametrize("M,nnz,tail", [(65536, 55, 0.1), (256, 29, 0.35)], ids=["M65536", "M256"])
def test_wide_one_op_overlap_is_race_free(M, nnz, tail):
    """The one op at the prefill bar's shape (D 4096, H 11008): repeated calls on poisoned TwELL blocks equal
    the two-op result bit for bit (a row read before the gate kernel released it would differ)."""
    D, H = 4096, 11008
    x, wg, wu, wd = inputs(M, D, H, nnz=nnz, tail=tail)
    wdt = wd.t().contiguous()
    ref = two_ops(x, wg, wu, wdt)
    rows = torch.randperm(M, device="cuda")[:2048].tolist()
    check_rows(ref, rows, x, wg, wu, wd)
    for i in range(5):
        poison_twell_blocks(M, H)
        out = kernels.sparse_gated_ffn(x, wg, wu, wdt)
        torch.cuda.synchronize()
        assert torch.equal(out, ref), f"call {i}: {int((out != ref).any(1).sum())} rows differ"


def test_wider_than_8192_raises_and_the_limit_is_reported():
    x, wg, wu, wd = inputs(4, 8256, 128, nnz=8)
    with pytest.raises(ValueError, match="D <= 8192"):
        kernels.sparse_gated_ffn(x, wg, wu, wd.t().contiguous())
    assert "D <= 8192" in kernels.layer_unsupported(8256, 128)
    assert kernels.layer_unsupported(8192, 28672) == "" and kernels.layer_unsupported(5120, 13824) == ""


def test_module_runs_a_wide_relu_layer_on_the_kernels():
    from twell.nn import SparseFFN

    D, H = 4096, 2048
    x, wg, wu, wd = inputs(512, D, H, nnz=10)
    f = SparseFFN(D, H).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        f.gate_proj.weight.copy_(wg)
        f.up_proj.weight.copy_(wu)
        f.down_proj.weight.copy_(wd)
        f.path = "kernel"
        out = f(x)
    assert f.last_path == "twell-kernel", f.last_route
    check_ffn(out, x, wg, wu, wd)
    assert rel(out, F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd).double()) < 1e-2
