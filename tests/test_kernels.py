"""CUDA kernels against the pure-PyTorch references (GPU only; skipped and counted without CUDA).

Tolerance rule (STYLE.md): a kernel's relative error against an fp64 reference must stay within a
small multiple of the error dense bf16 PyTorch makes on the same inputs. Fresh random inputs every
call; outputs poisoned with NaN beforehand so an unwritten element fails.
"""
import dataclasses
import math
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import put_nonfinite
from twell import kernels, reference
from twell.formats import pack_twell
from twell.kernels.ops import SPARSE_FFN_COMPRESSION
from twell.reference.ffn import GATE_CLUSTER, UNION_OFF, UNION_RULE

# The seed fixture: random inputs, and a failure names its seed.
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_ready", "seed")]


def poison_allocator(shape, dtype):
    """Fill a block of the output's size with 0xFF bytes (NaN in bf16, an impossible TwELL count)
    and free it: the caching allocator hands it to the op's output. Returns its address so the test
    can assert the output really landed there (otherwise the poisoning would prove nothing)."""
    t = torch.empty(shape, dtype=dtype, device="cuda")
    t.view(torch.uint8).fill_(0xFF)
    ptr = t.data_ptr()
    del t
    return ptr


def inputs(M, D, H, nnz=None, tail=0.1, offset=None, seed=None, dense_rows=(), zero_rows=(), dead=0.0):
    """BENCHMARK.md-style inputs: per-row scale exp(tail * N(0,1)), column 0 = 1 carries the offset.
    ``dead``: fraction of neurons that never fire (as in trained models), the others share ``nnz``."""
    # no seed: one from torch's generator, which the seed fixture seeded
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(2**31, ())))
    x = torch.randn(M, D, generator=g) * torch.exp(tail * torch.randn(M, 1, generator=g))
    x[:, 0] = 1
    w_gate = torch.randn(H, D, generator=g) / math.sqrt(D)
    o = 0.3 * torch.randn(H, generator=g)
    if offset is None:  # target nnz: threshold of a standard normal score
        from statistics import NormalDist
        offset = -NormalDist().inv_cdf(min(0.999, nnz / (H * (1 - dead)))) if nnz else 0.0
    w_gate[:, 0] = -(offset + o)
    if dead:
        w_gate[torch.randperm(H, generator=g)[:int(dead * H)], 0] = -1e4
    for r in dense_rows:
        x[r, 1:] *= 50.0  # every neuron crosses the threshold on a good share of these rows
        x[r, 0] = 1.0
    for r in zero_rows:
        x[r] = 0.0
        x[r, 0] = 1.0  # only the (negative) offsets remain: no neuron active
    w_up = torch.randn(H, D, generator=g) / math.sqrt(D)
    w_down = torch.randn(D, H, generator=g) / math.sqrt(H)
    return [t.to(torch.bfloat16).cuda() for t in (x, w_gate, w_up, w_down)]


@pytest.fixture(params=[UNION_OFF, (1.0, 0.0), (1e9, 0.0)], ids=["per-row", "union-auto", "union-always"])
def fused_path(request):
    """Run a test on each path of the fused kernel: per-row only, and the block-union path at a plain
    ratio rule and wherever it applies (csrc/twell_union.cu: gated, D a multiple of 512). The test
    passes it as ``union=`` to every gated op it calls, and as a module's ``union``."""
    return request.param


def module_with(wg, wu, wd):
    """A bf16 SparseFFN on the GPU holding the given gate/up/down weights (path "auto", with no row range
    sent to dense and no activity ceiling by rows: these tests are about the kernels;
    tests/test_decode_kernels.py and tests/test_routing_gpu.py test the row rules)."""
    from twell.nn import SparseFFN

    ffn = SparseFFN(wg.shape[1], wg.shape[0]).to(device="cuda", dtype=torch.bfloat16)
    ffn.dense_rows = None
    ffn.auto_ceilings = ()  # the activity threshold alone, at any row count
    with torch.no_grad():
        ffn.gate_proj.weight.copy_(wg)
        ffn.up_proj.weight.copy_(wu)
        ffn.down_proj.weight.copy_(wd)
    return ffn


def rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def fp64_ffn(x, wg, wu, wd, gated=True):
    x, wu, wd = x.double(), wu.double(), wd.double()
    h = F.relu(x @ wg.double().t()) * (x @ wu.t()) if gated else F.relu(x @ wu.t())
    return h @ wd.t()


def check_ffn(out, x, wg, wu, wd, gated=True, factor=3.0):
    ref = fp64_ffn(x, wg, wu, wd, gated)
    dense = reference.dense_gated_ffn(x, wg, wu, wd) if gated else F.linear(F.relu(F.linear(x, wu)), wd)
    assert not out.isnan().any(), "NaN in the output: an element was not written"
    err, base = rel(out, ref), rel(dense, ref)
    assert err <= factor * base + 1e-4, f"kernel rel. error {err:.3e} vs dense bf16 {base:.3e}"
    return err, base


SHAPES = [(1, 64, 256), (7, 128, 300), (129, 2048, 5632), (1000, 320, 1000), (4097, 2048, 5632), (300, 1024, 64)]


@pytest.mark.parametrize("M,D,H", SHAPES)
@pytest.mark.parametrize("tile,compression", [(256, 8), (128, 4), (64, 2), (256, 2)])
def test_gate_kernel_matches_reference(M, D, H, tile, compression):
    x, wg, _, _ = inputs(M, D, H, nnz=min(H // 4, 29), tail=0.35)
    n_tiles, S = -(-H // tile), tile // compression
    ptr = poison_allocator((M, n_tiles * S), torch.uint32)
    t = kernels.twell_gate(x, wg, tile, compression)
    assert t.packed.data_ptr() == ptr
    t.validate()  # counts in range, columns inside their tile, no zeros, overflow consistent
    ref = F.relu(F.linear(x, wg))
    # Activity may differ only where the pre-activation is ~0 (different summation order).
    g = (x.double() @ wg.double().t())
    kc, rc = t.counts(), pack_twell(ref, tile, compression).counts()
    unpacked = t.unpack()
    differs = (unpacked != 0) != (ref != 0)
    assert (g.abs()[differs] < 1e-2).all(), "activity differs away from the threshold"
    assert (kc - rc).abs().max() <= 2
    torch.testing.assert_close(unpacked.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tile,compression", [(256, 8), (64, 2)])
def test_gate_kernel_keeps_tiny_nan_and_signed_zero_values_exactly(tile, compression):
    """One-hot rows of x make the GEMM exact (h[r, n] = w_gate[n, r % D]), so the packed TwELL must
    equal the reference packing entry for entry: subnormal bf16 values and NaN are entries, -0 and
    negatives are not. Guards the packer's nonzero test (a bf16x2 compare) against flushing or
    dropping special values."""
    M, D, H = 700, 64, 600
    g = torch.Generator().manual_seed(3)
    x = torch.zeros(M, D)
    x[torch.arange(M), torch.arange(M) % D] = 1.0
    wg = -torch.randn(H, D, generator=g).abs()
    wg[torch.rand(H, D, generator=g) < 0.05] *= -1.0  # ~40 active per row: no tile overflows
    flat = wg.view(-1)
    idx = torch.randperm(H * D, generator=g)
    flat[idx[:300]] = 3e-39   # subnormal in bf16 (smallest normal ~1.2e-38)
    flat[idx[300:303]] = float("nan")  # 0 * NaN = NaN: these 3 neurons are NaN on every row
    flat[idx[340:600]] = -0.0
    flat[idx[600:700]] = -3e-39
    x, wg = x.to(torch.bfloat16).cuda(), wg.to(torch.bfloat16).cuda()
    assert (wg.float().abs() < 1.2e-38).logical_and(wg != 0).sum() >= 300  # the subnormals survived bf16
    t = kernels.twell_gate(x, wg, tile, compression)
    ref = torch.relu(F.linear(x, wg))
    expect = pack_twell(ref, tile, compression)
    assert t.n_overflow_rows == 0 and torch.equal(t.counts(), expect.counts())
    torch.testing.assert_close(t.unpack(), ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("M,D,H", SHAPES)
@pytest.mark.parametrize("nnz,tail", [(8, 0.1), (29, 0.1), (64, 0.1), (29, 0.35)])
def test_sparse_gated_ffn_matches_reference(M, D, H, nnz, tail, fused_path):
    x, wg, wu, wd = inputs(M, D, H, nnz=min(nnz, H // 2), tail=tail)
    wdt = wd.t().contiguous()
    gate = kernels.twell_gate(x, wg)
    ptr = poison_allocator((M, D), torch.bfloat16)
    out = kernels.twell_gated_ffn(x, gate, wu, wdt, union=fused_path)
    assert out.data_ptr() == ptr
    check_ffn(out, x, wg, wu, wd)


def test_empty_batches(fused_path):
    """M = 0 through every op and the module: empty outputs of the right shape, no launch error, and
    "auto" keeps its activity decision for a call that has tokens."""
    x, wg, wu, wd = inputs(64, 512, 1024, nnz=12)
    wdt = wd.t().contiguous()
    empty = x[:0]
    assert kernels.sparse_gated_ffn(empty, wg, wu, wdt, union=fused_path).shape == (0, 512)
    gate = kernels.twell_gate(empty, wg)
    assert gate.n_rows == 0 and gate.n_overflow_rows == 0
    assert kernels.twell_gated_ffn(empty, gate, wu, wdt, union=fused_path).shape == (0, 512)
    assert kernels.twell_ffn(kernels.twell_gate(empty, wu), wdt).shape == (0, 512)
    ffn = module_with(wg, wu, wd)
    ffn.union = fused_path
    with torch.no_grad():
        assert ffn(x[:0].view(2, 0, 512)).shape == (2, 0, 512) and ffn.last_path == "twell-kernel"
        assert ffn._auto_dense is None  # not measured on no tokens
        check_ffn(ffn(x), x, wg, wu, wd)
        assert ffn._auto_dense is not None  # decided on this call
    torch.cuda.synchronize()


def test_rows_past_2_to_the_31_elements(fused_path):
    """x and out with more than 2**31 elements (1.1M tokens at D = 2048, 4.5 GB each): every row
    offset must be 64-bit. Rows on both sides of element 2**31 and the last rows are checked against
    fp64, heavy rows among them (dense backup / heavy kernels), through the one op, the two ops and
    the non-gated FFN."""
    M, D, H = 1_100_000, 2048, 1024
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(M, D, device="cuda", generator=g, dtype=torch.bfloat16)
    x[:, 0] = 1
    wg, wu, wd = (torch.randn(a, b, device="cuda", generator=g) / math.sqrt(b) for a, b in ((H, D), (H, D), (D, H)))
    wg[:, 0] = -2.27  # ~12 of 1024 active per row
    wg, wu, wd = wg.bfloat16(), wu.bfloat16(), wd.bfloat16()
    edge = 2**31 // D  # first row whose elements start at or past 2**31
    heavy = [edge + 1, M - 3]
    x[heavy, 1:] *= 50.0
    rows = torch.cat([torch.arange(0, 4), torch.arange(edge - 6, edge + 6), torch.arange(M - 6, M)]).cuda()
    wdt = wd.t().contiguous()
    for op in (kernels.sparse_gated_ffn, two_ops):
        check_ffn(op(x, wg, wu, wdt, union=fused_path)[rows], x[rows], wg, wu, wd)
    out = kernels.twell_ffn(kernels.twell_gate(x, wu), wdt)
    check_ffn(out[rows], x[rows], None, wu, wd, gated=False)


def two_ops(x, wg, wu, wdt, tile=256, compression=8, union=None):
    """The gated FFN as two ops (gate, then fused), which the one-op call must equal bit for bit; at the
    published compression 8 by default, where the one op's default is 16 (same bits while the spill
    area holds the fuller tiles)."""
    return kernels.twell_gated_ffn(x, kernels.twell_gate(x, wg, tile, compression), wu, wdt, union=union)


def poison_twell_blocks(M, H, tile=256, compression=SPARSE_FFN_COMPRESSION):
    """Poison blocks of the sizes of the one-op call's internal TwELL words and spill area (count words
    0xFFFFFFFF): otherwise the allocator hands back the previous call's TwELL, and a row read before the
    gate kernel released it would find the right words anyway."""
    n_tiles = -(-H // tile)
    poison_allocator((M, n_tiles * (tile // compression)), torch.int32)
    poison_allocator((kernels.sparse_ffn_spill_words(M),), torch.int32)


@pytest.mark.parametrize("M,D,H", SHAPES)
@pytest.mark.parametrize("tile,compression", [(256, 8), (256, 16), (128, 4), (64, 2)])
@pytest.mark.parametrize("nnz,tail", [(8, 0.1), (29, 0.35)])
def test_one_op_ffn_equals_gate_then_fused(M, D, H, tile, compression, nnz, tail, fused_path):
    """sparse_gated_ffn is one op whose fused kernel may start before the gate kernel ends (it
    waits on per-row ready counters; docs/kernels.md §6). Without an optional path it takes that
    route, with one it runs the two kernels in turn; either way the result equals gate-then-fused bit
    for bit."""
    x, wg, wu, wd = inputs(M, D, H, nnz=min(nnz, H // 2), tail=tail, dense_rows=[0] if M > 1 else [],
                           zero_rows=[M - 1] if M > 2 else [])
    wdt = wd.t().contiguous()
    ref = two_ops(x, wg, wu, wdt, tile, compression, union=fused_path)
    poison_twell_blocks(M, H, tile, compression)
    out = kernels.sparse_gated_ffn(x, wg, wu, wdt, tile, compression, union=fused_path)
    check_ffn(out, x, wg, wu, wd)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("M,nnz,tail,dense_rows", [(65536, 8, 0.1, ()), (65536, 29, 0.35, ()),
                                                    (65536, 29, 0.1, range(1000, 1500)), (256, 29, 0.35, ()),
                                                    (700, 8, 0.1, ())],
                         ids=["nnz8", "heavy-tail", "dense-path", "M256", "M700"])
def test_one_op_ffn_overlap_is_race_free(M, nnz, tail, dense_rows):
    """Twenty calls, each on poisoned TwELL blocks, must all equal the two-op result bit for bit: a row
    read before the gate kernel released it would show as a difference (or a fault).
    - At the benchmark's shape the fused kernel overlaps the gate kernel's last wave (rows of earlier
      waves are ready by then); the third case sends 500 heavy rows to the dense path.
    - At M <= 768 (H = 5632) the gate kernel has a single partial wave, so the fused kernel starts on the
      idle SMs at once and every row must wait for its counter: a build without the wait fails here."""
    D, H = 2048, 5632
    x, wg, wu, wd = inputs(M, D, H, nnz=nnz, tail=tail, dense_rows=dense_rows)
    wdt = wd.t().contiguous()
    ref = two_ops(x, wg, wu, wdt)  # the published compression 8; the one op's TwELL uses 16: same bits
    rows = torch.randperm(M, device="cuda")[:4096]
    check_rows(ref, rows.tolist(), x, wg, wu, wd)
    for i in range(20):
        poison_twell_blocks(M, H)
        out = kernels.sparse_gated_ffn(x, wg, wu, wdt)
        torch.cuda.synchronize()
        assert torch.equal(out, ref), f"call {i}: {int((out != ref).any(1).sum())} rows differ"


def test_one_op_ffn_with_a_full_spill_area(fused_path):
    """Every tile row overflows and the spill area fills up: the fused kernel recomputes the rest from
    x and w_gate, in the one-op call as in the two-op one. Which tiles find spill space depends on the
    order of the gate kernel's atomics, and a recomputed tile rounds its gate values from another sum
    order than the GEMM, so here calls agree to rounding, not bit for bit."""
    x, wg, wu, wd = inputs(20000, 256, 1000, offset=-3.0)
    gate = kernels.twell_gate(x, wg)
    assert gate.n_spilled_tiles > 0 and gate.n_overflow_rows > 1000  # spilled, then the area was full
    wdt = wd.t().contiguous()
    check_ffn(kernels.sparse_gated_ffn(x, wg, wu, wdt, union=fused_path), x, wg, wu, wd)
    check_ffn(two_ops(x, wg, wu, wdt, union=fused_path), x, wg, wu, wd)


# Row word sizes (n_tiles * S words) that earlier light kernels staged through their weight ring and
# so had to route by size: a few tiles, words filling much of the ring, words larger than the ring,
# and rows of 40 bytes (S = 2, 5 tiles; one slot per tile, so most tiles spill). The light kernel now
# decodes every row from global memory; these keep its decode covered for unusual S.
@pytest.mark.parametrize("M,D,H,tile,compression", [(2048, 512, 1000, 128, 4), (513, 256, 5632, 256, 2),
                                                     (300, 128, 12800, 256, 2), (2100, 256, 300, 64, 32)])
def test_fused_kernel_paths_for_row_word_sizes(M, D, H, tile, compression, fused_path):
    x, wg, wu, wd = inputs(M, D, H, nnz=29, tail=0.35, dense_rows=[1])
    gate = kernels.twell_gate(x, wg, tile, compression)
    ptr = poison_allocator((M, D), torch.bfloat16)
    out = kernels.twell_gated_ffn(x, gate, wu, wd.t().contiguous(), union=fused_path)
    assert out.data_ptr() == ptr
    check_ffn(out, x, wg, wu, wd)


def test_overflow_dense_and_zero_rows_are_exact(fused_path):
    M, D, H = 777, 2048, 5632
    x, wg, wu, wd = inputs(M, D, H, nnz=29, tail=0.35, dense_rows=[0, 5, 400], zero_rows=[1, 2, 776])
    gate = kernels.twell_gate(x, wg)
    gate.validate()
    # Overflowing tile rows are spilled (stored exactly), so no row needs a dense backup.
    assert gate.n_spilled_tiles >= 3 * 22 and gate.n_overflow_rows == 0
    # The gate kernel sums in another order than cuBLAS: values agree to bf16 rounding, and no entry
    # above rounding size is dropped or invented.
    torch.testing.assert_close(gate.unpack().float(), F.relu(F.linear(x, wg)).float(), rtol=1 / 128, atol=1e-2)
    assert gate.nnz_per_row()[[1, 2, 776]].eq(0).all()
    wdt = wd.t().contiguous()
    ptr = poison_allocator((M, D), torch.bfloat16)
    out = kernels.twell_gated_ffn(x, gate, wu, wdt, union=fused_path)
    assert out.data_ptr() == ptr
    check_ffn(out, x, wg, wu, wd)
    # Heavy rows go to CTAs through a device counter; each row's sums still have a fixed order.
    assert torch.equal(out, kernels.twell_gated_ffn(x, gate, wu, wdt, union=fused_path))
    for r in (0, 5, 400, 1):  # the overflowing rows and a row without active neurons, one by one
        ref_r = fp64_ffn(x[r:r + 1], wg, wu, wd)
        dense_r = reference.dense_gated_ffn(x[r:r + 1], wg, wu, wd)
        assert rel(out[r:r + 1], ref_r) <= 3 * rel(dense_r, ref_r) + 1e-4
    # A fully dense activation (every row overflows) is still exact.
    xd, wgd, wud, wdd = inputs(64, 256, 512, offset=-3.0)
    assert kernels.twell_gate(xd, wgd).n_spilled_tiles == 64 * 2
    check_ffn(kernels.sparse_gated_ffn(xd, wgd, wud, wdd.t().contiguous(), union=fused_path), xd, wgd, wud, wdd)


def test_overflow_without_spill_is_recomputed_in_kernel(fused_path):
    """A TwELL whose overflowing tiles are neither spilled nor backed up densely, but which knows
    (x, w_gate): the fused kernel recomputes those tiles neuron by neuron."""
    from twell.formats import TwELL

    x, wg, wu, wd = inputs(300, 512, 1000, nnz=29, tail=0.35, dense_rows=[3, 9, 100])
    packed = pack_twell(F.relu(F.linear(x, wg))).packed
    gate = TwELL(packed, None, None, wg.shape[0], source=(x, wg))
    assert gate.n_overflow_rows >= 3
    wdt = wd.t().contiguous()
    ptr = poison_allocator((300, 512), torch.bfloat16)
    out = kernels.twell_gated_ffn(x, gate, wu, wdt, union=fused_path)
    assert out.data_ptr() == ptr
    check_ffn(out, x, wg, wu, wd)


def test_reference_packed_twell_uses_its_dense_backup(fused_path):
    x, wg, wu, wd = inputs(500, 512, 1000, nnz=29, tail=0.35, dense_rows=[3, 9])
    gate = pack_twell(F.relu(F.linear(x, wg)))  # no source: overflow rows come from the backup
    assert gate.source is None and gate.n_overflow_rows >= 2
    out = kernels.twell_gated_ffn(x, gate, wu, wd.t().contiguous(), union=fused_path)
    check_ffn(out, x, wg, wu, wd)


@pytest.mark.parametrize("tile,compression", [(256, 8), (512, 8), (96, 3)])
def test_non_gated_kernel_on_a_packed_twell(tile, compression):
    """twell_ffn on a TwELL packed elsewhere (no source: the kernel gets a placeholder x, and rows that
    overflow come from the dense backup), at tilings the gate kernel does not make."""
    x, wg, wu, wd = inputs(500, 512, 1000, nnz=29, tail=0.35, dense_rows=[3, 9], zero_rows=[4])
    act = pack_twell(F.relu(F.linear(x, wg)), tile, compression)
    assert act.source is None and act.n_overflow_rows >= 2
    wdt = wd.t().contiguous()
    # Two poisoned blocks: the placeholder x may take one of them.
    blocks = [torch.full((500, 512), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    ptrs = {b.data_ptr() for b in blocks}
    del blocks
    out = kernels.twell_ffn(act, wdt)
    assert out.data_ptr() in ptrs
    ref = reference.twell_ffn(act, wdt)  # fp32 sums of the same bf16 activations
    assert torch.isfinite(out).all() and rel(out, ref.double()) < 2e-3, rel(out, ref.double())
    assert out[4].eq(0).all()


@pytest.mark.parametrize("M,D,H,tile,compression", [(4097, 2048, 5632, 256, 8), (1000, 512, 1000, 128, 4),
                                                     (63, 1024, 5632, 256, 8)])
def test_union_path_runs_and_is_exact(M, D, H, tile, compression):
    """Inputs with 80% dead neurons (as trained models have): blocks of 64 rows share active neurons,
    so most take the block-union path at union=(1, 0); heavy, dense and all-zero rows mixed in go to
    the per-row kernels. Output poisoned, compared with fp64 like every kernel."""
    x, wg, wu, wd = inputs(M, D, H, nnz=29, tail=0.35, dead=0.8, dense_rows=[0, M // 2], zero_rows=[1, M - 1])
    wdt = wd.t().contiguous()
    gate = kernels.twell_gate(x, wg, tile, compression)
    plan = kernels.union_plan(x, gate, wu, wdt, ratio=1.0, base=0.0)
    n_blocks = -(-M // 64)
    assert plan["union_blocks"] >= 0.8 * n_blocks, plan
    # (a block whose only row is all-zero has an empty union: M - 1 is a zero row)
    assert plan["union_sizes"].ge(0).all() and plan["union_sizes"].le(H).all()
    assert plan["union_sizes"].float().mean() > 29
    # rows with more than 128 entries (the union path's row capacity) go to the per-row kernels
    assert plan["per_row_rows"] >= int(gate.nnz_per_row().gt(128).sum())
    assert kernels.union_plan(x, gate, wu, wdt, ratio=0.0)["union_blocks"] == 0
    assert kernels.union_plan(x, gate, wu, wdt, ratio=0.0)["per_row_rows"] == M
    ptr = poison_allocator((M, D), torch.bfloat16)
    out = kernels.twell_gated_ffn(x, gate, wu, wdt, union=(1.0, 0.0))
    assert out.data_ptr() == ptr
    check_ffn(out, x, wg, wu, wd)
    per_row = kernels.twell_gated_ffn(x, gate, wu, wdt)  # the default: the union path off
    # Both paths round h to bf16 at different points (union: u to bf16 first, like dense bf16).
    assert rel(out, per_row.double()) < 1e-2


def test_sm_cap_and_output_buffer_change_nothing_but_placement():
    """The launchers' SM cap (scripts/probes/overlap.py runs the two kernels side by side with it)
    only changes where the work runs; ffn_forward's out= writes into a slice of a larger buffer and
    nowhere else. Heavy-tailed rows and a dense row take the spill and heavy-row paths too."""
    from twell.formats import TwELL
    from twell.kernels.build import load
    ext = load()
    M, D, H = 3000, 512, 1000
    x, wg, wu, wd = inputs(M, D, H, nnz=29, tail=0.35, dense_rows=[5])
    wdt = wd.t().contiguous()
    gate_settings = dict(spill_cap=kernels.spill_capacity(M), cluster=GATE_CLUSTER)
    ffn_settings = dict(union_ratio=0.0, union_base=0.0, dense_cap=None)
    packed, spill = ext.gate_twell(x, wg, 256, 8, **gate_settings)
    packed_c, spill_c = ext.gate_twell(x, wg, 256, 8, 6, **gate_settings)
    dense = TwELL(packed, None, None, H, 256, 8, source=(x, wg), spill=spill).unpack()
    assert torch.equal(TwELL(packed_c, None, None, H, 256, 8, source=(x, wg), spill=spill_c).unpack(), dense)
    ref = ext.ffn_forward(x, packed, spill, wg, wu, wdt, 256, 8, **ffn_settings)
    big = torch.full((M + 7, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = ext.ffn_forward(x, packed_c, spill_c, wg, wu, wdt, 256, 8, 5, big[3:3 + M], **ffn_settings)
    assert got.data_ptr() == big[3].data_ptr()
    assert torch.equal(big[3:3 + M], ref)
    assert big[:3].isnan().all() and big[3 + M:].isnan().all()
    with pytest.raises(RuntimeError, match="out must be"):
        ext.ffn_forward(x, packed, spill, wg, wu, wdt, 256, 8, 0, big[:M - 1], **ffn_settings)


def test_union_path_sorts_entries_that_are_not_in_column_order():
    """TwELL words need not list a tile's entries in column order; the union path walks them by rank."""
    from twell.formats import TwELL

    M, D, H = 500, 512, 1000
    x, wg, wu, wd = inputs(M, D, H, nnz=29, tail=0.1, dead=0.8)
    ref_gate = pack_twell(F.relu(F.linear(x, wg)))
    assert ref_gate.n_overflow_rows == 0
    S = ref_gate.tile // ref_gate.compression
    words = ref_gate.packed.view(torch.int32).view(M, -1, S)  # same bits; few uint32 kernels exist
    c = words[..., :1].long()
    j = torch.arange(S, device=words.device)
    src = torch.where((j >= 1) & (j <= c), c + 1 - j, j)  # each tile's entries reversed
    packed = torch.gather(words, 2, src).reshape(M, -1)
    assert not torch.equal(packed, ref_gate.packed.view(torch.int32))
    gate = TwELL(packed.view(torch.uint32), None, None, H, source=(x, wg))
    assert kernels.union_plan(x, gate, wu, wd.t().contiguous(), ratio=1e9, base=0.0)["union_blocks"] == -(-M // 64)
    check_ffn(kernels.twell_gated_ffn(x, gate, wu, wd.t().contiguous(), union=(1e9, 0.0)), x, wg, wu, wd)


def union_block_counts(gate, block=64, row_cap=128):
    """Per block of 64 rows, over the rows the union path can take (at most row_cap entries, every
    tile stored): (entries, |U|, whether any row counts), from the TwELL's stored entries."""
    rows, cols, _ = gate.entries()
    active = torch.zeros(gate.n_rows, gate.n_cols, dtype=torch.bool, device=gate.device)
    active[rows, cols] = True
    take = (active.sum(1) <= row_cap) & ~gate.overflow_mask()
    out = []
    for b in range(-(-gate.n_rows // block)):
        a, t = active[b * block:(b + 1) * block], take[b * block:(b + 1) * block]
        out.append((int(a[t].sum()), int(a[t].any(0).sum()), bool(t.any())))
    return out


def expected_union_blocks(counts, ratio, base):
    """The block-union rule in PyTorch, in fp32 like the plan kernel: the blocks (ascending) with
    |U| <= ratio * (entries - base), and their |U|."""
    r, c = torch.tensor(ratio, dtype=torch.float32), torch.tensor(base, dtype=torch.float32)
    ids, sizes = [], []
    for b, (entries, union, any_row) in enumerate(counts):
        e, u = torch.tensor(float(entries)), torch.tensor(float(union))
        if any_row and ratio > 0 and e >= c and u <= r * (e - c):
            ids.append(b)
            sizes.append(union)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(sizes, dtype=torch.long)


def test_union_rule_with_a_base_term():
    """The plan's rule |U| <= ratio * (entries - base) picks exactly the blocks a PyTorch count of the
    TwELL picks: the plain ratio rule (base 0), the fitted rule, a base at the median block's entries,
    and the two sides of one block's edge (with ratio 1e9 a block qualifies at base = entries - 1 and
    not at base = entries, where the right side is 0). Heavy and all-zero rows are mixed in. The FFN
    at each setting is exact; the plan's default is the fitted rule."""
    from twell.reference.ffn import UNION_RULE

    M, D, H = 4096, 1024, 2048
    x, wg, wu, wd = inputs(M, D, H, nnz=29, tail=0.35, dead=0.7, dense_rows=[5, 2000], zero_rows=[64, 65, 4095])
    wdt = wd.t().contiguous()
    gate = kernels.twell_gate(x, wg)
    counts = union_block_counts(gate)
    entries = sorted(e for e, _, _ in counts)
    median = float(entries[len(entries) // 2])
    k = next(b for b, (e, _, _) in enumerate(counts) if e == median)
    settings = [(1.0, 0.0), UNION_RULE, (1e9, median), (1e9, median - 1)]
    chosen = {}  # setting -> the kernel's block ids
    for ratio, base in settings:
        plan = kernels.union_plan(x, gate, wu, wdt, ratio=ratio, base=base)
        chosen[ratio, base] = plan["union_block_ids"].tolist()
        ids, sizes = expected_union_blocks(counts, ratio, base)
        assert torch.equal(plan["union_block_ids"], ids), (ratio, base)
        assert torch.equal(plan["union_sizes"], sizes), (ratio, base)
        check_ffn(kernels.twell_gated_ffn(x, gate, wu, wdt, union=(ratio, base)), x, wg, wu, wd)
    assert kernels.union_plan(x, gate, wu, wdt)["union_block_ids"].tolist() == chosen[UNION_RULE]
    at_edge, below = chosen[1e9, median], chosen[1e9, median - 1]
    assert k in below and k not in at_edge
    assert 0.3 * (M // 64) <= len(at_edge) <= 0.7 * (M // 64), len(at_edge)  # the base term splits the blocks
    with pytest.raises(ValueError, match="base"):
        kernels.union_plan(x, gate, wu, wdt, ratio=1.0, base=-1.0)


def test_union_argument_is_the_only_setting(monkeypatch):
    """``union=(ratio, base)`` of one call decides the route, and nothing else does: the default
    (``None``) equals ``UNION_OFF`` and the per-row kernel whatever the environment holds (the
    extension reads none of it), forcing the union path differs from it (so each really ran), and
    the one op with every default equals the two ops with every default bit for bit. A SparseFFN
    layer passes its ``union`` to the kernel the same way."""
    x, wg, wu, wd = inputs(1024, 1024, 2048, nnz=29, dead=0.8)
    wdt = wd.t().contiguous()
    gate = kernels.twell_gate(x, wg)
    per_row = kernels.twell_gated_ffn(x, gate, wu, wdt)
    # variables that earlier builds read: set to values that would change every path
    for name, value in (("TWELL_UNION_RATIO", "1e9"), ("TWELL_DENSE_CAP", "0"), ("TWELL_GATE_CLUSTER", "1")):
        monkeypatch.setenv(name, value)
    assert torch.equal(kernels.twell_gated_ffn(x, gate, wu, wdt), per_row)
    assert torch.equal(kernels.twell_gated_ffn(x, gate, wu, wdt, union=UNION_OFF), per_row)
    by_arg = kernels.twell_gated_ffn(x, gate, wu, wdt, union=(1e9, 0))
    assert not torch.equal(by_arg, per_row)
    check_ffn(by_arg, x, wg, wu, wd)
    # The one op takes the rule per call the same way; with every default it is the two ops' defaults.
    assert torch.equal(kernels.sparse_gated_ffn(x, wg, wu, wdt, union=(1e9, 0)), by_arg)
    assert torch.equal(kernels.sparse_gated_ffn(x, wg, wu, wdt, union=(0, 0)), per_row)
    assert torch.equal(kernels.sparse_gated_ffn(x, wg, wu, wdt), per_row)
    assert torch.equal(kernels.twell_gated_ffn(x, kernels.twell_gate(x, wg), wu, wdt), per_row)
    ext = kernels.load()  # the raw op checks the rule too
    for ratio, base in ((1.0, -1.0), (-1.0, 600.0), (float("nan"), 0.0)):
        with pytest.raises(RuntimeError, match="union_ratio and union_base"):
            ext.ffn_forward(x, gate.packed, gate.spill, None, wu, wdt, 256, gate.compression, union_ratio=ratio,
                            union_base=base, dense_cap=None)
    ffn = module_with(wg, wu, wd)
    ffn.path = "kernel"
    with torch.no_grad():
        assert torch.equal(ffn(x), per_row)
        ffn.union = (1e9, 0)
        assert torch.equal(ffn(x), by_arg) and ffn.last_path == "twell-kernel"


def test_choose_union_paths_per_layer():
    """choose_union_paths gives the fitted rule to a layer whose 64-token blocks mostly qualify (40
    active of ~100 live neurons: strong reuse) and (0, 0) to a layer with 4 active per token, from the
    plan on the inputs each layer saw; the model then runs each layer on its chosen path."""
    from twell.model import choose_union_paths
    from twell.reference.ffn import UNION_RULE

    # At M = 4096 (~0.15-0.25 ms per call) the timed ratio moved between 0.63 and 0.96 from call to call, once
    # past the 2% margin; at 16384 (~0.35 ms per-row) it stayed at 0.55-0.56 (scripts/probes/chooser_margin.py).
    M, D, H = 16384, 1024, 2048
    x, wg1, wu1, wd1 = inputs(M, D, H, nnz=40, dead=0.95, seed=1)
    _, wg2, wu2, wd2 = inputs(M, D, H, nnz=4, seed=2)

    class TwoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = module_with(wg1, wu1, wd1), module_with(wg2, wu2, wd2)

        def forward(self, t):
            return self.a(t) + self.b(t)

    model = TwoLayers()
    model.a.path = model.b.path = "kernel"  # "auto" would pick dense for layer a (2% active)
    report = choose_union_paths(model, x)
    assert [r["layer"] for r in report] == [0, 1] and all(r["tokens"] == M for r in report)
    assert model.a.union == UNION_RULE and report[0]["share"] >= 0.5, report
    assert report[0]["union_ms"] < report[0]["per_row_ms"], report  # timed, and the rule won
    assert model.b.union == (0.0, 0.0) and report[1]["share"] < 0.5 and report[1]["union_ms"] is None, report
    for f, r, w in ((model.a, report[0], wg1), (model.b, report[1], wg2)):
        gate = kernels.twell_gate(x, w)
        plan = kernels.union_plan(x, gate, f.up_proj.weight, f.w_down_t(), *UNION_RULE)
        assert r["union_blocks"] == plan["union_blocks"] and r["blocks"] == M // 64
    with torch.no_grad():
        out = model(x)
    ref = (kernels.twell_gated_ffn(x, kernels.twell_gate(x, wg1), wu1, wd1.t().contiguous(), union=UNION_RULE)
           + kernels.twell_gated_ffn(x, kernels.twell_gate(x, wg2), wu2, wd2.t().contiguous(), union=(0, 0)))
    assert torch.equal(out, ref)


def test_choose_union_paths_keeps_per_row_where_the_rule_times_slower(monkeypatch):
    """A layer whose blocks qualify keeps the per-row kernel when its sparse FFN is not at least min_gain
    faster with the rule (timings replaced here, so the decision is what is tested); timed=False goes by
    the share alone."""
    from twell.model import choose_union_paths, union_paths
    from twell.reference.ffn import UNION_RULE

    x, wg, wu, wd = inputs(2048, 1024, 2048, nnz=40, dead=0.95, seed=4)
    f = module_with(wg, wu, wd)
    f.path = "kernel"
    calls = []
    monkeypatch.setattr(union_paths, "ffn_times", lambda *a: calls.append(a) or (1.0, 1.5))
    with pytest.warns(UserWarning, match="2048 calibration tokens; below ~16384"):
        report = choose_union_paths(f, x)
    assert len(calls) == 1 and report[0]["share"] >= 0.5 and f.union == (0.0, 0.0), report
    assert (report[0]["per_row_ms"], report[0]["union_ms"]) == (1.0, 1.5) and "1.500 ms with the rule" in report[0]["why"]
    monkeypatch.setattr(union_paths, "ffn_times", lambda *a: (1.5, 1.0))
    assert choose_union_paths(f, x)[0]["union"] == UNION_RULE and f.union == UNION_RULE
    monkeypatch.setattr(union_paths, "ffn_times", lambda *a: (1.0, 0.99))  # a near tie stays per-row
    assert "needs 2% less" in choose_union_paths(f, x)[0]["why"] and f.union == (0.0, 0.0)
    assert choose_union_paths(f, x, min_gain=0.0)[0]["union"] == UNION_RULE
    report = choose_union_paths(f, x, timed=False)
    assert f.union == UNION_RULE and report[0]["per_row_ms"] is None


def test_choose_union_paths_times_dense_against_sparse_for_auto_layers(monkeypatch):
    """An "auto" layer's dense-or-sparse choice comes from the chooser's timing (replaced here, so the
    decision is what is tested), not from its activity threshold (auto_max_active): a layer with 2%
    active (dense by the threshold) runs sparse when that times faster, dense when dense is at least
    min_gain faster; layers with another path and timed=False keep their own rule; reset_auto goes back
    to the threshold."""
    from twell.model import choose_union_paths, union_paths

    x, wg, wu, wd = inputs(2048, 1024, 2048, nnz=40, dead=0.95, seed=4)
    f = module_with(wg, wu, wd)
    with torch.no_grad():
        f(x), f(x)
    assert f.last_path == "dense" and "dense from the next call on" in f.auto_note  # the threshold's choice
    calls = []
    monkeypatch.setattr(union_paths, "ffn_times", lambda *a: (1.0, 0.5))  # the rule wins
    times = {"t": (1.0, 0.5)}
    monkeypatch.setattr(union_paths, "path_times", lambda ff, xx, union, reps: calls.append(union) or times["t"])
    with pytest.warns(UserWarning, match="calibration tokens"):
        report = choose_union_paths(f, x)
    assert report[0]["runs"] == "sparse" and (report[0]["dense_ms"], report[0]["sparse_ms"]) == (1.0, 0.5), report
    assert calls == [f.union] and f.union != (0.0, 0.0)  # timed with the union setting it chose
    with torch.no_grad():
        out = f(x)
    assert f.last_path == "twell-kernel" and "timed by choose_union_paths" in f.auto_note, f.auto_note
    assert torch.equal(out, kernels.sparse_gated_ffn(x, wg, wu, f.w_down_t(), f.tile, f.compression, union=f.union))
    for t, runs in (((0.5, 1.0), "dense"), ((0.99, 1.0), "sparse"), ((0.97, 1.0), "dense")):  # 2% margin
        times["t"] = t
        with pytest.warns(UserWarning):
            assert choose_union_paths(f, x)[0]["runs"] == runs, t
        with torch.no_grad():
            f(x)
        assert f.last_path == ("dense" if runs == "dense" else "twell-kernel"), (t, f.last_path)
    f.reset_auto()
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing timed: no warning either
        report = choose_union_paths(f, x, timed=False)
    # Its calibration forward was the layer's first "auto" call since the reset: the threshold decided.
    assert report[0]["runs"] is None and not calls and "dense from the next call on" in f.auto_note, f.auto_note
    with torch.no_grad():
        f(x)
    assert f.last_path == "dense"
    f.path = "kernel"
    with pytest.warns(UserWarning):
        report = choose_union_paths(f, x)
    assert report[0]["runs"] is None and not calls
    # A layer "auto" would not run on the kernels: tracking (dense for its statistics). Nothing is
    # planned or timed for it (so no warning about few tokens either), and it keeps no rule.
    f.path = "auto"
    f.track = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = choose_union_paths(f, x)
    assert report[0]["runs"] is None and not calls and f.last_path == "dense"
    assert "runs dense" in report[0]["why"] and report[0]["per_row_ms"] is None and f.union == (0.0, 0.0)



def test_choose_union_paths_measures_what_each_layer_runs_and_changes_nothing_on_an_error(monkeypatch):
    """Layers called with keywords (a custom model); an fp32 input under autocast, which "auto" runs dense,
    gets no rule and no timing; an error on the second layer leaves the first one as it was."""
    from twell.model import choose_union_paths, union_paths

    x, wg, wu, wd = inputs(4096, 512, 1024, nnz=40, seed=7)

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = module_with(wg, wu, wd), module_with(wg, wu, wd)

        def forward(self, h):
            return self.b(x=self.a(x=h))

    model = Two()
    monkeypatch.setattr(union_paths, "ffn_times", lambda *a: (1.0, 0.5))
    monkeypatch.setattr(union_paths, "path_times", lambda *a: (2.0, 1.0))
    with pytest.warns(UserWarning, match="calibration tokens") as warned:
        report = choose_union_paths(model, x, min_share=0.0)
    assert all(w.filename == __file__ for w in warned)  # points at the caller, not at the library
    assert [r["union"] for r in report] == [UNION_RULE] * 2 and [r["runs"] for r in report] == ["sparse"] * 2
    assert model.a.union == model.b.union == UNION_RULE
    model.a.union = model.b.union = (0.0, 0.0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (r,) = choose_union_paths(model.a, x.float(), min_share=0.0)
    assert r["union"] == (0.0, 0.0) and r["per_row_ms"] is None and r["runs"] is None and model.a.union == (0.0, 0.0)
    assert "path 'auto' runs dense" in r["why"] and "float32" in r["why"], r
    calls = []

    def second_fails(*a):
        calls.append(1)
        if len(calls) == 2:
            raise torch.cuda.OutOfMemoryError("simulated")
        return 1.0, 0.5

    monkeypatch.setattr(union_paths, "ffn_times", second_fails)
    with pytest.raises(torch.cuda.OutOfMemoryError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        choose_union_paths(model, x, min_share=0.0)
    assert "layer 1 (no layer's union or timed choice was changed)" in "".join(getattr(err.value, "__notes__", []))
    assert model.a.union == model.b.union == (0.0, 0.0)


def test_choose_union_paths_auto_layer_runs_what_it_timed():
    """Real timings at the benchmark's width: the report's verdict follows its own times, and the layer
    then runs that path (dense: the dense expression; sparse: the one op with the chosen rule)."""
    from twell.model import choose_union_paths

    M = 16384
    x, wg, wu, wd = inputs(M, 2048, 5632, nnz=80, dead=0.9, seed=5)
    f = module_with(wg, wu, wd)
    (r,) = choose_union_paths(f, x)
    assert r["runs"] in ("dense", "sparse") and r["dense_ms"] > 0 and r["sparse_ms"] > 0, r
    assert (r["runs"] == "dense") == (r["dense_ms"] <= r["sparse_ms"] * 0.98), r
    with torch.no_grad():
        out = f(x)
        if r["runs"] == "dense":
            assert f.last_path == "dense" and torch.equal(out, f.down_proj(f.hidden(x)[1]))
        else:
            ref = kernels.sparse_gated_ffn(x, wg, wu, f.w_down_t(), f.tile, f.compression, union=r["union"])
            assert f.last_path == "twell-kernel" and torch.equal(out, ref)
    check_ffn(out, x, wg, wu, wd)


def test_union_path_shape_limits():
    """The union path's shape limits come from the extension, one message per limit: union_plan
    refuses such a layer with it, choose_union_paths reports it and keeps the layer per-row, and the
    fused op asked for the union path on it still computes the reference (per-row kernel)."""
    from twell.model import choose_union_paths

    assert kernels.union_unsupported(2048, 5632) == ""
    assert "multiple of 512" in kernels.union_unsupported(640, 1024)
    assert "at most 2048" in kernels.union_unsupported(2560, 1024)
    assert kernels.union_unsupported(512, 8192) == "" and "H <= 8192" in kernels.union_unsupported(512, 8193)
    assert "multiple of 512" in kernels.union_unsupported(0, 1024)
    assert "H <= 8192" in kernels.union_unsupported(512, 2**32)  # not wrapped into a small int
    for D, H, why in ((512, 8256, "H <= 8192"), (640, 1024, "multiple of 512")):
        x, wg, wu, wd = inputs(256, D, H, nnz=8, seed=3)
        gate = kernels.twell_gate(x, wg)
        with pytest.raises(RuntimeError, match=why):
            kernels.union_plan(x, gate, wu, wd.t().contiguous(), ratio=1e9, base=0)
        check_ffn(kernels.twell_gated_ffn(x, gate, wu, wd.t().contiguous(), union=(1e9, 0)), x, wg, wu, wd)
        f = module_with(wg, wu, wd)
        f.path = "kernel"
        report = choose_union_paths(f, x)
        assert f.union == (0.0, 0.0) and why in report[0]["why"], report


def test_path_settings_are_checked():
    """Bad settings fail in Python with a message that names the fix, and in the extension for its
    direct callers."""
    x, wg, wu, wd = inputs(64, 512, 256, nnz=8)
    wdt = wd.t().contiguous()
    gate = kernels.twell_gate(x, wg)
    for kwargs, match in ((dict(union=(1.0, -5.0)), "union"), (dict(dense_cap=-1), "dense_cap"),
                          (dict(dense_cap=2.5), "dense_cap")):
        with pytest.raises(ValueError, match=match):
            kernels.twell_gated_ffn(x, gate, wu, wdt, **kwargs)
        with pytest.raises(ValueError, match=match):
            kernels.sparse_gated_ffn(x, wg, wu, wdt, **kwargs)
    for bad in (0, 3, True):
        with pytest.raises(ValueError, match="gate_cluster"):
            kernels.twell_gate(x, wg, gate_cluster=bad)
        with pytest.raises(ValueError, match="gate_cluster"):
            kernels.sparse_gated_ffn(x, wg, wu, wdt, gate_cluster=bad)
    ext = kernels.load()
    with pytest.raises(RuntimeError, match="cluster must be 2"):
        ext.gate_twell(x, wg, 256, 16, spill_cap=kernels.spill_capacity(64), cluster=3)
    with pytest.raises(RuntimeError, match="spill_cap must be in"):
        ext.gate_twell(x, wg, 256, 16, spill_cap=-1, cluster=GATE_CLUSTER)
    with pytest.raises(RuntimeError, match="dense_cap must be None"):
        ext.ffn_forward(x, gate.packed, gate.spill, wg, wu, wdt, 256, gate.compression, union_ratio=0.0,
                        union_base=0.0, dense_cap=-1)
    with pytest.raises(TypeError):  # the settings have no defaults in the extension
        ext.gate_twell(x, wg, 256, 16)


def test_single_cta_gate_kernel_gives_the_same_twell():
    """gate_cluster=1 (the single-CTA variant, kept for comparison) writes the TwELL the 2-CTA clusters
    write, in the gate op and inside the one op."""
    x, wg, wu, wd = inputs(3000, 512, 1000, nnz=29, tail=0.35, dense_rows=[5])
    wdt = wd.t().contiguous()
    pair, single = kernels.twell_gate(x, wg), kernels.twell_gate(x, wg, gate_cluster=1)
    assert torch.equal(single.counts(), pair.counts()) and torch.equal(single.unpack(), pair.unpack())
    out = kernels.sparse_gated_ffn(x, wg, wu, wdt)
    assert torch.equal(kernels.sparse_gated_ffn(x, wg, wu, wdt, gate_cluster=1), out)
    check_ffn(out, x, wg, wu, wd)


def test_spill_area_is_sized_by_the_one_formula():
    """The gate op's spill area (and so the fake op's shape) is spill_capacity(M) words plus the
    words-used counter; the one op's internal block adds the ready counters."""
    for M in (64, 20000):
        x, wg, _, _ = inputs(M, 256, 300, nnz=8)
        gate = kernels.twell_gate(x, wg)
        assert gate.spill.numel() == kernels.spill_capacity(M) + 1
        assert kernels.sparse_ffn_spill_words(M) == kernels.spill_capacity(M) + 1 + 4 * -(-M // 128)


@pytest.mark.parametrize("M,D,H", [(100, 256, 300), (4096, 2048, 5632)])
def test_non_gated_ffn_matches_reference(M, D, H):
    x, _, wu, wd = inputs(M, D, H, nnz=29, tail=0.35, dense_rows=[0])
    # non-gated: the activation is relu(x @ w_up.T); give w_up the offsets of a sparse gate
    g = torch.Generator().manual_seed(1)
    wu = wu.float().cpu()
    wu[:, 0] = -(2.5 + 0.3 * torch.randn(H, generator=g))
    wu = wu.to(torch.bfloat16).cuda()
    out = kernels.twell_ffn(kernels.twell_gate(x, wu), wd.t().contiguous())
    check_ffn(out, x, None, wu, wd, gated=False)


def check_rows(out, rows, x, wg, wu, wd, gated=True):
    """check_ffn on a subset of rows (heavy rows have large outputs and would hide the others)."""
    wg = wg if gated else None
    return check_ffn(out[rows], x[rows], wg, wu, wd, gated)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "non-gated"])
@pytest.mark.parametrize("M,D,H,tile,compression", [(2000, 2048, 5632, 256, 8), (777, 320, 1000, 128, 4),
                                                     (700, 192, 700, 64, 2)])
@pytest.mark.parametrize("cap", [None, 4096, 0], ids=["default-cap", "cap-4096", "off"])
def test_dense_path_for_heavy_rows_is_exact(M, D, H, tile, compression, gated, cap):
    """Rows with more than 128 entries go to the heavy queue. When at least 384 (kDenseMinRows) rows are
    queued, the tensor-core dense path (csrc/twell_dense.cu) computes all of them, else the per-row
    heavy kernel does: here over 400 heavy rows, so the path runs at the default cap of these small M
    (at least 4096 rows, clamped to M rounded up to 128) and at dense_cap=4096, not when off."""
    heavy_rows = list(range(3, 403))  # rows scaled by 50: hundreds of active neurons each
    x, wg, wu, wd = inputs(M, D, H, nnz=29, tail=0.35, dense_rows=heavy_rows, zero_rows=[0, M - 1])
    if not gated:  # non-gated: the activation is relu(x @ w_up.T); give w_up the gate's offsets
        wu = wu.clone()
        wu[:, 0] = wg[:, 0]
    gate = kernels.twell_gate(x, wg if gated else wu, tile, compression)
    is_heavy = gate.nnz_per_row().gt(128).cpu()
    heavy, light = is_heavy.nonzero().flatten().tolist(), (~is_heavy).nonzero().flatten().tolist()
    assert len(heavy) >= 384, len(heavy)
    dense_cap = kernels.dense_capacity(M, cap)
    assert dense_cap == {None: -(-M // 128) * 128, 4096: -(-M // 128) * 128, 0: 0}[cap]
    dense_runs = dense_cap > 0
    wdt = wd.t().contiguous()

    def run(cap=cap):
        if gated:
            return kernels.twell_gated_ffn(x, gate, wu, wdt, dense_cap=cap)
        return kernels.twell_ffn(gate, wdt, dense_cap=cap)
    ptr = poison_allocator((M, D), torch.bfloat16)
    out = run()
    assert out.data_ptr() == ptr
    check_rows(out, heavy, x, wg, wu, wd, gated)
    check_rows(out, light, x, wg, wu, wd, gated)
    assert out[[0, M - 1]].eq(0).all()
    # The dense path takes all heavy rows or none, and every row's sums have a fixed order: two calls
    # agree bit for bit whichever path ran.
    assert torch.equal(out, run())
    # Light rows never see the dense path; heavy rows do exactly when it runs (it rounds the up
    # projection to bf16 first, as dense PyTorch does, so their values change by rounding).
    off = run(0)
    assert torch.equal(out[light], off[light])
    if dense_runs:
        assert not torch.equal(out[heavy], off[heavy]), "the dense path did not run"
    if not dense_runs:
        assert torch.equal(out, off)


@pytest.mark.parametrize("n_heavy,cap,runs", [(383, 512, False), (384, 384, True), (385, 384, True),
                                             (1000, 384, True)])
def test_dense_path_takes_the_queue_at_its_bounds(n_heavy, cap, runs, fused_path):
    """Exactly n_heavy rows above 128 entries: the dense path takes the whole queue from 384 rows up,
    in rounds of cap rows (385 rows: a second round of one row; 1000: three rounds, the last partial),
    and none of it below; on every fused path (the union path's scratch sits before the dense path's
    buffers in the workspace)."""
    M, D, H = 1024, 512, 1000
    x, wg, wu, wd = inputs(M, D, H, nnz=8, tail=0.0, dense_rows=range(2, 2 + n_heavy), zero_rows=[0])
    gate = kernels.twell_gate(x, wg)
    assert int(gate.nnz_per_row().gt(128).sum()) == n_heavy
    wdt = wd.t().contiguous()
    ptr = poison_allocator((M, D), torch.bfloat16)
    out = kernels.twell_gated_ffn(x, gate, wu, wdt, union=fused_path, dense_cap=cap)
    assert out.data_ptr() == ptr
    heavy = list(range(2, 2 + n_heavy))
    check_rows(out, heavy, x, wg, wu, wd)
    check_rows(out, [0, 1] + list(range(2 + n_heavy, M)), x, wg, wu, wd)
    assert torch.equal(out, kernels.twell_gated_ffn(x, gate, wu, wdt, union=fused_path, dense_cap=cap))
    off = kernels.twell_gated_ffn(x, gate, wu, wdt, union=fused_path, dense_cap=0)
    assert torch.equal(out[heavy], off[heavy]) != runs


def test_dense_path_with_more_tiles_than_sms():
    """Every row heavy at M = 4096: 32 row blocks, so both dense kernels loop over more tiles than there
    are SMs (1408 and 256 tiles)."""
    M, D, H = 4096, 2048, 5632
    x, wg, wu, wd = inputs(M, D, H, nnz=29, tail=0.1, dense_rows=range(M))
    gate = kernels.twell_gate(x, wg)
    assert int(gate.nnz_per_row().gt(128).sum()) == M
    wdt = wd.t().contiguous()
    out = kernels.twell_gated_ffn(x, gate, wu, wdt, dense_cap=4096)
    check_ffn(out, x, wg, wu, wd)
    assert torch.equal(out, kernels.twell_gated_ffn(x, gate, wu, wdt, dense_cap=4096))
    assert not torch.equal(out, kernels.twell_gated_ffn(x, gate, wu, wdt, dense_cap=0))


# Near-dense inputs cost the dense path's GEMMs plus the gate GEMM that found the rows heavy: 4/3 of
# dense's GEMM work, measured 1.35-1.41x dense on an H200 with the whole queue in one round. The bound
# leaves room for the rounds and for timing noise on a shared GPU; before the rounds, rows past the
# first cap rows took the per-row heavy kernel: 39-74x dense.
NEAR_DENSE_BOUND = 1.6


@pytest.mark.parametrize("M,nnz", [(4096, 1500), (8192, 1500), (8192, 5000), (12345, 2816)])
def test_near_dense_input_stays_near_dense_cost(M, nnz):
    """Most rows heavy (1500 to 5000 of 5632 neurons active per row): the dense path takes every
    heavy row, in rounds of dense_cap rows past the first, so the op stays within a small factor of
    dense PyTorch, and exact."""
    from twell.bench.generator import calibrated_ffn_inputs
    from twell.bench.timing import time_alternating

    inp = calibrated_ffn_inputs(M, 2048, 5632, nnz, 0.1, seed=M + nnz, device="cuda")
    x, wg, wu, wd = inp.x, inp.w_gate, inp.w_up, inp.w_down
    wdt = wd.t().contiguous()
    assert kernels.dense_capacity(M) < M or M == 4096  # several rounds, except at M = 4096
    from twell.bench.ffn import Poison

    poison = Poison(torch.device("cuda"), M * 2048 * 2)
    out = kernels.sparse_gated_ffn(x, wg, wu, wdt)
    assert poison.hit(out)
    check_ffn(out, x, wg, wu, wd)
    assert torch.equal(out, kernels.sparse_gated_ffn(x, wg, wu, wdt))
    t = time_alternating({"dense": lambda: reference.dense_gated_ffn(x, wg, wu, wd),
                          "sparse": lambda: kernels.sparse_gated_ffn(x, wg, wu, wdt)}, "cuda", reps=15)
    ratio = t["sparse"].median_ms / t["dense"].median_ms
    assert ratio <= NEAR_DENSE_BOUND, f"sparse {t['sparse'].median_ms:.3f} ms vs dense {t['dense'].median_ms:.3f} ms"


@pytest.mark.parametrize("where", ["x", "w_gate", "w_up", "w_down"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_values_propagate_on_the_kernels(where, value, fused_path):
    """A non-finite value in x or a weight: the ops reach exactly the rows the value enters (the x row;
    for a gate, up or down weight of neuron n, the rows where the kernel's gate has n active, NaN and
    +Inf counting as active) and, for down, only its column; the module adds dense's 0 * NaN
    pattern; nothing raises or hangs."""
    M, D, H = 3000, 512, 1000
    x, wg, wu, wd = inputs(M, D, H, nnz=20)
    h = F.relu(F.linear(x, wg))
    n = int(h[5].nonzero()[0])
    put_nonfinite(where, value, n, x, wg, wu, wd)
    wdt = wd.t().contiguous()
    bad = lambda t: ~torch.isfinite(t)  # noqa: E731
    gate = kernels.twell_gate(x, wg)
    active = gate.unpack()[:, n] != 0  # the kernel's own activity (CPU roundings may differ at 0)
    rows = {"x": torch.arange(M, device="cuda") == 5, "w_gate": active, "w_up": active, "w_down": active}[where]
    expect = rows[:, None] & (torch.arange(D, device="cuda") == 7) if where == "w_down" else rows[:, None]
    dense = reference.dense_gated_ffn(x, wg, wu, wd)
    for out in (kernels.sparse_gated_ffn(x, wg, wu, wdt, union=fused_path),
                kernels.twell_gated_ffn(x, gate, wu, wdt, union=fused_path)):
        if fused_path == UNION_OFF:  # per-row kernels: exactly the rows (and for down, the column) it enters
            assert torch.equal(bad(out).any(1), rows)
            assert torch.equal(bad(out), expect.expand_as(out)) or where != "w_down"
        else:  # the union path's products span a block's union of neurons: 0 * NaN reaches the block's
            # other rows too, as in dense
            assert (bad(out) >= expect).all() and (bad(out) <= bad(dense)).all()
    ffn = module_with(wg, wu, wd)
    ffn.union = fused_path
    with torch.no_grad():
        ffn.path = "kernel"
        got = ffn(x)
    assert ffn.last_path == "twell-kernel" and torch.equal(bad(got), bad(dense))


def test_all_nan_input_takes_the_dense_path_and_returns_nan():
    """Every gate value NaN counts as active: every row is heavy and goes through the dense path's
    rounds; the output is NaN everywhere, as dense PyTorch's. H is not a multiple of the tile: the
    padding columns (x . 0 = NaN there) are never entries nor hidden values."""
    M, D, H = 9000, 2048, 5600
    x, wg, wu, wd = inputs(M, D, H, nnz=29)
    x.fill_(float("nan"))
    out = kernels.sparse_gated_ffn(x, wg, wu, wd.t().contiguous())
    assert out.isnan().all()


def test_ffn_with_another_x_than_the_gate_was_made_from():
    """The kernel may recompute gate values from x only when x is the TwELL's own source: with another
    x (allowed: h comes from the TwELL, x only feeds the up projection) the dense path stays off and
    the result is sum over active n of h[m, n] (x2[m] . w_up[n]) w_down[:, n]."""
    M, D, H = 1024, 512, 1000
    x, wg, wu, wd = inputs(M, D, H, nnz=8, tail=0.0, dense_rows=range(2, 500))
    x2 = torch.randn_like(x)
    gate = kernels.twell_gate(x, wg)
    out = kernels.twell_gated_ffn(x2, gate, wu, wd.t().contiguous(), dense_cap=4096)
    h = F.relu(x.double() @ wg.double().t()).to(torch.bfloat16).double()
    ref = (h * (x2.double() @ wu.double().t())) @ wd.double().t()
    for rows in (list(range(2, 500)), [0, 1] + list(range(500, M))):
        dense = (F.relu(F.linear(x[rows], wg)) * F.linear(x2[rows], wu)) @ wd.t()
        assert rel(out[rows], ref[rows]) <= 3 * rel(dense, ref[rows]) + 1e-4


def test_dense_cap_rule_and_setting():
    cap = kernels.dense_capacity
    # M / 8 rounded up to 128, at least 4096, at most M rounded up, 0 where it could never reach 384 rows
    assert ([cap(1), cap(300), cap(383), cap(384), cap(2000), cap(3000), cap(4096), cap(8192), cap(65536),
             cap(131072)] == [0, 0, 0, 384, 2048, 3072, 4096, 4096, 8192, 16384])
    assert cap(65536, 100) == 0
    assert cap(65536, 400) == 512 and cap(300, 400) == 384 and cap(200, 400) == 0
    assert cap(65536, 2**62) == 65536  # bounded by M, without overflow
    with pytest.raises(ValueError, match="dense_cap"):
        cap(65536, "lots")
    with pytest.raises(RuntimeError, match="dense_cap must be None"):
        kernels.load().dense_cap(65536, -5)


def test_bad_inputs_raise_clearly():
    x, wg, wu, wd = inputs(64, 256, 300, nnz=10)
    wdt = wd.t().contiguous()
    with pytest.raises(TypeError, match="bfloat16"):
        kernels.twell_gate(x.float(), wg)
    with pytest.raises(ValueError, match="multiple of 64"):
        kernels.twell_gate(x[:, :100].contiguous(), wg[:, :100].contiguous())
    with pytest.raises(ValueError, match="positive multiple of 64, got D=0"):
        kernels.sparse_gated_ffn(x[:, :0].contiguous(), wg[:, :0].contiguous(), wu[:, :0].contiguous(),
                                 wdt[:, :0].contiguous())
    with pytest.raises(ValueError, match="CUDA"):
        kernels.twell_gate(x.cpu(), wg.cpu())
    with pytest.raises(ValueError, match="contiguous"):
        kernels.twell_gate(x.t().contiguous().t(), wg)
    with pytest.raises(ValueError, match="device|on cuda"):
        kernels.twell_gate(x, wg.cpu())
    gate = kernels.twell_gate(x, wg)
    with pytest.raises(ValueError, match="w_down_t"):
        kernels.twell_gated_ffn(x, gate, wu, wd)  # W_down not transposed: [D, H]
    with pytest.raises(ValueError, match="multiple"):
        kernels.twell_gate(x, wg, tile=256, compression=3)
    with pytest.raises(ValueError, match="multiple"):
        kernels.sparse_gated_ffn(x, wg, wu, wdt, tile=256, compression=3)
    with pytest.raises(ValueError, match="w_down_t"):
        kernels.sparse_gated_ffn(x, wg, wu, wd)  # W_down not transposed: [D, H]


def _offset_copy(t, k):
    """A contiguous copy of t that starts k elements into its buffer (misaligned unless k elements
    make a multiple of 16 bytes)."""
    buf = torch.empty(t.numel() + k, dtype=t.dtype, device=t.device)
    view = buf[k:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 == (k * t.element_size()) % 16
    return view


@pytest.mark.parametrize("k", [1, 4])
def test_misaligned_inputs_raise_clearly_and_leave_the_context_usable(k):
    """Every op refuses a tensor that does not start on 16 bytes (the kernels' vector and TMA loads
    fault on it, which lost the CUDA context before the check), then runs the aligned inputs exactly."""
    x, wg, wu, wd = inputs(256, 512, 1024, nnz=12)
    wdt = wd.t().contiguous()
    gate = kernels.twell_gate(x, wg)
    calls = [
        ("x", lambda: kernels.twell_gate(_offset_copy(x, k), wg)),
        ("w_gate", lambda: kernels.twell_gate(x, _offset_copy(wg, k))),
        ("w_up", lambda: kernels.twell_gated_ffn(x, gate, _offset_copy(wu, k), wdt)),
        ("w_down_t", lambda: kernels.twell_gated_ffn(x, gate, wu, _offset_copy(wdt, k))),
        ("w_down_t", lambda: kernels.twell_ffn(gate, _offset_copy(wdt, k))),
        ("w_up", lambda: kernels.sparse_gated_ffn(x, wg, _offset_copy(wu, k), wdt)),
        ("w_down_t", lambda: kernels.sparse_gated_ffn(x, wg, wu, _offset_copy(wdt, k))),
        ("x", lambda: kernels.sparse_gated_ffn(_offset_copy(x, k), wg, wu, wdt)),
    ]
    for name, call in calls:
        with pytest.raises(ValueError, match=f"{name} must start at a 16-byte aligned address"):
            call()
    words = 1 if k == 1 else 2  # the TwELL's uint32 words: 4 or 8 bytes in
    with pytest.raises(ValueError, match="packed must start at a 16-byte aligned address"):
        kernels.twell_gated_ffn(x, dataclasses.replace(gate, packed=_offset_copy(gate.packed, words)), wu, wdt)
    with pytest.raises(ValueError, match="spill must start at a 16-byte aligned address"):
        kernels.twell_gated_ffn(x, dataclasses.replace(gate, spill=_offset_copy(gate.spill, words)), wu, wdt)
    ffn = module_with(wg, wu, wd)
    ffn.path = "kernel"
    with torch.no_grad():  # the module copies such an x instead: same bits as the aligned one
        assert torch.equal(ffn(_offset_copy(x, k)), ffn(x)) and ffn.last_path == "twell-kernel"
        ffn.path = "auto"  # a misaligned weight (a view into a flat buffer): "auto" takes the reference
        ffn.up_proj.weight = torch.nn.Parameter(_offset_copy(wu, k))
        assert ffn.auto_route(x) == ("reference", "up_proj.weight does not start on 16 bytes (a view into a flat buffer?)")
        check_ffn(ffn(x), x, wg, wu, wd)
        assert ffn.last_path == "twell-reference"
    ext = kernels.load()  # the C++ checks refuse it too, for callers of the extension itself
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        ext.sparse_ffn(x, wg, wu, _offset_copy(wdt, k), 256, 8, union_ratio=0.0, union_base=0.0, dense_cap=None,
                       spill_cap=kernels.spill_capacity(256), cluster=GATE_CLUSTER)
    with pytest.raises(RuntimeError, match="the spill area must start at a 16-byte aligned address"):
        ext.ffn_plan(x, gate.packed, _offset_copy(gate.spill, words), wu, wdt, 256, gate.compression, 1.0, 0.0)
    # Under torch.compile the Python check is skipped (no addresses while tracing): the extension's
    # check must raise, unless the compiled graph hands the op an aligned copy, which is right too.
    compiled = torch.compile(kernels.sparse_gated_ffn, fullgraph=True)
    try:
        out = compiled(x, wg, wu, _offset_copy(wdt, k))
    except RuntimeError as exc:
        assert "16-byte aligned" in str(exc), str(exc)[-2000:]
    else:
        check_ffn(out, x, wg, wu, wd)
    finally:
        torch._dynamo.reset()  # later tests compile the op afresh
    check_ffn(kernels.sparse_gated_ffn(x, wg, wu, wdt), x, wg, wu, wd)


def test_bound_functions_raise_on_bad_arguments_in_a_fresh_process():
    """The C++ checks behind the Python ones must raise, never crash: their messages format numbers,
    which segfaulted while the H100 image's compiler linked a static libstdc++ into the extension
    (docs/kernels.md §11). A fresh process, so a crash fails this test and not the whole run."""
    code = """
import torch
from twell import kernels
ext = kernels.load()
x = torch.randn(64, 256, device="cuda").bfloat16(); w = torch.randn(300, 256, device="cuda").bfloat16()
g = kernels.twell_gate(x, w)
gs = dict(spill_cap=kernels.spill_capacity(64), cluster=2)
fs = dict(union_ratio=0.0, union_base=0.0, dense_cap=None)
cases = {
    "compression 0": lambda: ext.gate_twell(x, w, 256, 0, **gs),
    "compression 3": lambda: ext.gate_twell(x, w, 256, 3, **gs),
    "D must be a positive multiple of 64, got 200": lambda: ext.gate_twell(x[:, :200].contiguous(), w[:, :200].contiguous(), 256, 8, **gs),
    "D must be a positive multiple of 64, got 0": lambda: ext.gate_twell(x[:, :0].contiguous(), w[:, :0].contiguous(), 256, 8, **gs),
    "sparse_ffn: unsupported tile 256 / compression 0": lambda: ext.sparse_ffn(x, w, w, w, 256, 0, **fs, **gs),
    "twell.ffn: unsupported tile 256 / compression 0": lambda: ext.ffn_forward(x, g.packed, g.spill, None, w, w, 256, 0, **fs),
}
for want, call in cases.items():
    try:
        call()
    except RuntimeError as e:
        assert want in str(e), (want, str(e))
        print("raised:", want)
    else:
        raise AssertionError("no error: " + want)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0 and p.stdout.count("raised:") == 6, (p.returncode, p.stdout, p.stderr[-3000:])


def test_torch_compile_with_dynamic_shapes():
    """One compiled graph for every M (a served model's batch varies): the ops' input checks compare
    SymInts and format nothing unless they fail, so fullgraph tracing holds."""
    torch._dynamo.reset()
    compiled = torch.compile(kernels.sparse_gated_ffn, fullgraph=True, dynamic=True)
    try:
        for M in (200, 1000, 4096):
            x, wg, wu, wd = inputs(M, 512, 1024, nnz=12)
            wdt = wd.t().contiguous()
            assert torch.equal(compiled(x, wg, wu, wdt), kernels.sparse_gated_ffn(x, wg, wu, wdt))
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("path", ["kernel", "auto"])
def test_compiled_module_matches_eager(path):
    """A model compiled whole (torch.compile on the module, graph breaks allowed, dynamic batch) runs
    the same kernels: bit-equal to eager, the path reported, "auto" still measuring once ("auto"'s
    one read of its activity breaks the graph; path "kernel" compiles as one graph, tested below)."""
    x, wg, wu, wd = inputs(1024, 512, 1024, nnz=6)
    eager, ffn = module_with(wg, wu, wd), module_with(wg, wu, wd)
    eager.path = ffn.path = path
    torch._dynamo.reset()
    compiled = torch.compile(ffn, dynamic=True)
    try:
        with torch.no_grad():
            for m in (1024, 300, 77):
                assert torch.equal(compiled(x[:m]), eager(x[:m])), m
                assert ffn.last_path == eager.last_path == "twell-kernel"
        assert ffn._auto_dense is eager._auto_dense
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_module_is_one_graph_and_sees_weight_updates(mode):
    """Path "kernel" compiles with fullgraph=True, before any eager call too: ops inside the graph make
    and check the W_down transpose cache at run time. An in-place write to W_down after compiling
    reaches the next call, as it would for a dense model, also with CUDA-graph trees
    ("reduce-overhead": the ops are cudagraph-unsafe, so they run at each call rather than once at
    capture, and the cache's memory is not the graph's, which a later replay would overwrite)."""
    x, wg, wu, wd = inputs(1024, 512, 1024, nnz=6)
    eager, ffn = module_with(wg, wu, wd), module_with(wg, wu, wd)
    eager.path = ffn.path = "kernel"
    torch._dynamo.reset()
    compiled = torch.compile(ffn, fullgraph=True, dynamic=True, mode=mode)
    try:
        with torch.no_grad():
            for m in (1024, 300, 1024, 1024, 1024):  # repeats: CUDA-graph trees warm up, record, replay
                assert torch.equal(compiled(x[:m]), eager(x[:m])), m
            before = eager(x)
            t = ffn._w_down_t
            for f in (eager, ffn):
                f.down_proj.weight.mul_(-2.0)  # exact in bf16
            for _ in range(3):
                out = compiled(x)
                assert torch.equal(out, eager(x)) and torch.equal(out, before * -2.0)
            assert ffn._w_down_t is t  # refreshed in place, not reallocated
            t.fill_(float("nan"))  # the weight did not change: a call that copies anyway would undo this
            assert compiled(x).isnan().any()  # so the op checked this very tensor (no clone) and kept it
            ffn.down_proj.weight.mul_(1.0)  # a version bump: the next call copies again
            assert torch.equal(compiled(x), eager(x))
            for f in (eager, ffn):
                f.down_proj.weight.data.mul_(-1.0)  # through .data: seen after invalidate_cache
                f.invalidate_cache()  # marks the copy stale, keeps it: no recompile
            for _ in range(3):
                assert torch.equal(compiled(x), eager(x)) and torch.equal(eager(x), before * 2.0)
            assert ffn._w_down_t is t
    finally:
        torch._dynamo.reset()


def test_torch_compile_and_cuda_graphs():
    # Heavy rows in both inputs, enough at replay (not at capture) for the dense path to run: it and
    # the heavy kernel size their work from device counts, never from host values frozen into the graph.
    x, wg, wu, wd = inputs(1024, 2048, 5632, nnz=29, tail=0.35, dense_rows=[7])
    wdt = wd.t().contiguous()
    eager = kernels.sparse_gated_ffn(x, wg, wu, wdt, dense_cap=1024)
    compiled = torch.compile(kernels.sparse_gated_ffn, fullgraph=True)  # no eager fallback
    torch.testing.assert_close(compiled(x, wg, wu, wdt, dense_cap=1024), eager)
    static_x = x.clone()
    kernels.sparse_gated_ffn(static_x, wg, wu, wdt, dense_cap=1024)  # warm-up outside capture (build, attributes)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = kernels.sparse_gated_ffn(static_x, wg, wu, wdt, dense_cap=1024)
    x2 = x.clone()
    # 400 more heavy rows: the dense path runs. Scaled 3x, not 50x: 400 nearly all-active rows would
    # overfill the spill area (1.1M words against 1M, counted on the CPU), and then which tiles find
    # space is a race, so the one op (compression 16) and two_ops (8) could round some rows differently.
    x2[100:500, 1:] *= 3.0
    assert kernels.twell_gate(x2, wg).nnz_per_row().gt(128).sum() >= 384
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, kernels.sparse_gated_ffn(x2, wg, wu, wdt, dense_cap=1024))
    assert torch.equal(static_out, kernels.twell_gated_ffn(x2, kernels.twell_gate(x2, wg, compression=8), wu, wdt,
                                                           dense_cap=1024))
    is_heavy = kernels.twell_gate(x2, wg).nnz_per_row().gt(128).cpu()
    for rows in (is_heavy.nonzero().flatten().tolist(), (~is_heavy).nonzero().flatten().tolist()):
        check_rows(static_out, rows, x2, wg, wu, wd)


def test_ops_pass_torch_library_opcheck():
    """Schema, fake (meta) implementations and AOT dispatch of the three custom ops."""
    from twell.kernels import ops

    x, wg, wu, wd = inputs(300, 512, 1024, nnz=29, tail=0.35, dense_rows=[3])
    wdt = wd.t().contiguous()
    torch.library.opcheck(ops._sparse_ffn_op, (x, wg, wu, wdt, 256, SPARSE_FFN_COMPRESSION, *UNION_OFF, None,
                                               GATE_CLUSTER))
    torch.library.opcheck(ops._sparse_ffn_op, (x, wg, wu, wdt, 256, SPARSE_FFN_COMPRESSION,
                                               *reference.ffn.UNION_RULE, 384, 1))
    packed, spill = ops._gate_op(x, wg, 256, 8, GATE_CLUSTER)
    torch.library.opcheck(ops._ffn_op, (x, packed, spill, wg, wu, wdt, 256, 8, *UNION_OFF, None))
    torch.library.opcheck(ops._ffn_op, (x, packed, spill, wg, wu, wdt, 256, 8, *reference.ffn.UNION_RULE, 0))
    # The gate op leaves unused slots and the spill area's tail unwritten (zeroing them would cost a
    # pass over memory), so two calls need not agree word for word: the AOT-dispatch check, which
    # compares eager and compiled outputs, does not apply to it.
    torch.library.opcheck(ops._gate_op, (x, wg, 256, 8, GATE_CLUSTER),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_module_auto_takes_dense_or_the_reference_where_the_kernels_cannot_and_says_why():
    from twell.nn import SparseFFN

    # D 8256: wider than the fused kernels, but the decoding op takes it: dense, measuring (the decoding op
    # on few rows later); D 96: no kernel takes it: the reference
    for D, why, path in ((8256, "D <= 8192", "dense"), (96, "multiple of 64", "twell-reference")):
        ffn = SparseFFN(D, 512).to(device="cuda", dtype=torch.bfloat16)
        x = torch.randn(70, D, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            out = ffn(x)
            assert ffn.last_path == path and why in ffn.auto_note, ffn.auto_note
            ffn.path = "dense"
            dense = ffn(x)
        assert rel(out, dense.double()) < 1e-2
        ffn.path = "kernel"
        with torch.no_grad(), pytest.raises(ValueError, match=why):
            ffn(x)


def test_kernel_twell_ffn_refuses_an_output_width_it_cannot_write():
    x, wg, wu, wd = inputs(64, 512, 1024, nnz=8)
    act = kernels.twell_gate(x, wu)
    with pytest.raises(ValueError, match="as wide as its input"):
        kernels.twell_ffn(act, torch.zeros(1024, 256, device="cuda", dtype=torch.bfloat16))


def test_module_uses_kernels_on_gpu():
    # ~0.8% active at 4096 rows: "auto" stays sparse (under auto_max_active, the ceiling at 4096 rows)
    x, wg, wu, wd = inputs(4096, 2048, 5632, nnz=29, dense_rows=[5])
    ffn = module_with(wg, wu, wd)
    with torch.no_grad():
        ffn.path = "auto"
        out = ffn(x)  # measures the activity: the gate op, then the fused op
        assert ffn.last_path == "twell-kernel" and ffn._auto_dense is False
        assert torch.equal(ffn(x), out)  # the one op from now on: same bits
        assert torch.equal(out, kernels.sparse_gated_ffn(x, wg, wu, wd.t().contiguous()))
        ffn.keep_gate = True
        assert torch.equal(ffn(x), out) and ffn.last_gate.compression == SPARSE_FFN_COMPRESSION
        ffn.path = "reference"
        ref = ffn(x)
        assert ffn.last_path == "twell-reference"
    check_ffn(out, x, wg, wu, wd)
    assert rel(out, ref.double()) < 1e-2


def test_auto_leaves_the_kernels_on_a_layer_that_is_not_sparse():
    """A 50%-active layer: the first auto call runs the kernels (exact), then auto switches to dense and
    says why; a sparse layer keeps the kernels; setting the path again measures again."""
    # nnz=40 gives ~60 active of 5632 here (1.05-1.10%: the per-neuron offsets add ~50%), just above
    # auto_max_active; nnz=29 about 0.8%, under it. 4096 rows: the ceiling there is auto_max_active.
    for nnz, expect_dense in ((2816, True), (29, False), (40, True)):
        x, wg, wu, wd = inputs(4096, 2048, 5632, nnz=nnz)
        ffn = module_with(wg, wu, wd)
        if nnz == 40:
            active = kernels.twell_gate(x, wg).nnz_per_row().float().mean().item() / 5632
            assert ffn.auto_max_active < active < 1.25 * ffn.auto_max_active, active
        with torch.no_grad():
            first = ffn(x)
            assert ffn.last_path == "twell-kernel"
            check_ffn(first, x, wg, wu, wd)
            second = ffn(x)
            assert ffn.last_path == ("dense" if expect_dense else "twell-kernel")
            assert (ffn.auto_note is not None) == expect_dense
            check_ffn(second, x, wg, wu, wd)
            ffn.path = "auto"  # forgets the measurement: the next call runs the kernels and measures again
            assert ffn.auto_note is None
            ffn(x)
            assert ffn.last_path == "twell-kernel" and (ffn.auto_note is not None) == expect_dense


def test_module_captured_with_a_stale_transpose():
    """W_down written in place after the cache was made, then a capture: the capture makes its own copy
    in the graph's pool (each replay runs it) and leaves the stale cache alone (a copy into it, recorded,
    would write into freed memory once the cache is replaced): a poisoned cache stays poisoned through
    a replay. An eager call refreshes the cache, and replays see later in-place writes too."""
    x, wg, wu, wd = inputs(512, 512, 1024, nnz=6, seed=0)
    ffn = module_with(wg, wu, wd)
    ffn.path = "kernel"
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        first = ffn(x)  # makes the cache
        ffn.down_proj.weight.mul_(-2.0)
        with torch.cuda.graph(graph):
            static_out = ffn(static_x)
        cache = ffn._w_down_t
        cache.fill_(float("nan"))  # a replay that writes into the cache would overwrite this
        graph.replay()
        torch.cuda.synchronize()
        assert cache.isnan().all() and torch.equal(static_out, first * -2.0)
        assert torch.equal(ffn(x), first * -2.0)  # eager: the cache is still stale, so it is refreshed
        assert ffn._w_down_t is cache and not cache.isnan().any()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, first * -2.0)
        ffn.down_proj.weight.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, -first)


def test_module_runs_in_a_cuda_graph():
    """A SparseFFN ("auto") captured in a CUDA graph on its very first call: the capture cannot read the
    activity back to the host, so the layer says so and measures on its first call outside. An eager
    call before any replay must not see the capture's unexecuted copy of W_down^T. Replays on new
    inputs (heavy rows included) equal eager calls bit for bit."""
    # ~0.8% of the neurons active per token at 4096 rows, so "auto" stays sparse once it measures (1% limit)
    x, wg, wu, wd = inputs(4096, 2048, 5632, nnz=29, seed=0)
    x2 = inputs(4096, 2048, 5632, nnz=29, seed=1, dense_rows=[3])[0]
    ffn = module_with(wg, wu, wd)
    kernels.load()  # build outside the capture
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        with torch.cuda.graph(graph):
            static_out = ffn(static_x)
        assert ffn.last_path == "twell-kernel" and "captured in a CUDA graph" in ffn.auto_note
        assert ffn._auto_dense is None
        eager = ffn(x2)  # before any replay; measures now
        assert ffn._auto_dense is False and ffn.auto_note is None
        static_x.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)
        assert torch.equal(static_out, ffn(x2))
    check_ffn(static_out, x2, wg, wu, wd)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_ops_and_module_on_a_second_gpu(fused_path):
    """Inputs on cuda:1 while cuda:0 is current: every op runs on its inputs' device (heavy, dense and
    empty rows included), a module moved there after a call on cuda:0 drops its cached W_down^T, and
    the current device is left as it was."""
    torch.cuda.set_device(0)
    x, wg, wu, wd = (t.to("cuda:1") for t in inputs(3000, 2048, 5632, nnz=29, tail=0.35, dense_rows=[3],
                                                      zero_rows=[4]))
    wdt = wd.t().contiguous()
    out = kernels.sparse_gated_ffn(x, wg, wu, wdt, union=fused_path)
    assert out.device == x.device
    check_ffn(out, x, wg, wu, wd)
    gate = kernels.twell_gate(x, wg)
    check_ffn(kernels.twell_gated_ffn(x, gate, wu, wdt, union=fused_path), x, wg, wu, wd)
    check_ffn(kernels.twell_ffn(kernels.twell_gate(x, wu), wdt), x, wg, wu, wd, gated=False)
    ffn = module_with(*(t.to("cuda:0") for t in (wg, wu, wd)))
    ffn.union = fused_path
    with torch.no_grad():
        ffn.path = "kernel"
        ffn(x.to("cuda:0"))  # fills the transpose cache on cuda:0
        ffn.to("cuda:1")
        moved = ffn(x)
    assert moved.device == x.device and ffn.last_path == "twell-kernel"
    check_ffn(moved, x, wg, wu, wd)
    # Tensors on two GPUs in one call are refused, by the Python ops and by the extension itself.
    gate0 = kernels.twell_gate(x.to("cuda:0"), wg.to("cuda:0"))
    with pytest.raises(ValueError, match="on cuda:1 .*all inputs must be on one device"):
        kernels.twell_gated_ffn(x, gate0, wu, wdt)
    ext = kernels.load()
    with pytest.raises(RuntimeError, match="w_down_t is on cuda:0, x on cuda:1"):
        ext.ffn_forward(x, gate.packed, gate.spill, None, wu, wdt.to("cuda:0"), 256, gate.compression,
                        union_ratio=0.0, union_base=0.0, dense_cap=None)
    with pytest.raises(RuntimeError, match="the spill area is on cuda:0, x on cuda:1"):
        ext.ffn_plan(x, gate.packed, gate0.spill, wu, wdt, 256, gate.compression, 1.0, 0.0)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
