"""TwELL and hybrid formats: exact round trips, layout, overflow handling, bad inputs."""
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from twell.formats import (
    HybridCapacityError, HybridStatus, TwELL, pack_hybrid, pack_twell, twell_nbytes, unpack_twell,
)

pytestmark = pytest.mark.usefixtures("seed")  # random inputs: a failure names its seed

TILINGS = [(256, 8), (256, 4), (256, 2), (128, 8), (128, 4), (64, 8), (64, 2)]


def sparse_activation(M, H, density, heavy_rows=0, seed=None, gen=None):
    """Post-ReLU-like bf16 [M, H] with the given density and some fully dense rows."""
    # no seed: one from torch's generator, which the seed fixture seeded
    g = gen or torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(2**31, ())))
    keep = torch.rand(M, H, generator=g) < density
    h = (torch.rand(M, H, generator=g) * 3 + 1e-3) * keep
    if heavy_rows and M:
        rows = torch.randperm(M, generator=g)[:heavy_rows]
        h[rows] = torch.rand(len(rows), H, generator=g) + 1e-3
    return h.to(torch.bfloat16)


def same(a, b):
    """Exact equality that treats NaN as equal to NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


@settings(max_examples=60, deadline=None)
@given(
    M=st.integers(0, 70),
    H=st.integers(1, 700),
    tiling=st.sampled_from(TILINGS),
    density=st.sampled_from([0.0, 0.01, 0.05, 0.2, 0.7, 1.0]),
    heavy=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_twell_round_trip_is_exact(M, H, tiling, density, heavy, seed):
    tile, compression = tiling
    h = sparse_activation(M, H, density, heavy, seed)
    t = pack_twell(h, tile, compression)
    t.validate()
    assert t.packed.dtype == torch.uint32
    assert t.packed.shape == (M, math.ceil(H / tile) * (tile // compression))
    assert same(t.unpack(), h) and same(unpack_twell(t), h)
    # Counts are the true nonzero counts per tile; overflow rows are exactly those exceeding S - 1.
    hp = torch.zeros(M, t.n_tiles * tile, dtype=h.dtype)
    hp[:, :H] = h
    counts = (hp.view(M, t.n_tiles, tile) != 0).sum(-1)
    assert torch.equal(t.counts(), counts.to(torch.int32))
    over = (counts > t.slots - 1).any(-1).nonzero().flatten()
    assert torch.equal(t.overflow_rows, over)
    assert t.n_overflow_tiles == int((counts > t.slots - 1).sum())
    assert torch.equal(t.overflow_dense, h[over])


def test_twell_word_layout_matches_documentation():
    h = torch.zeros(2, 300, dtype=torch.bfloat16)
    h[0, 5], h[0, 3], h[0, 270] = 1.5, 0.25, -2.0
    t = pack_twell(h, tile=256, compression=8)
    w = t.packed.view(torch.int32).view(2, 2, 32)
    bits = lambda v: int(torch.tensor([v], dtype=torch.bfloat16).view(torch.int16)) & 0xFFFF  # noqa: E731
    # count, then (value << 16 | global column) in ascending column order, unused slots zero
    assert w[0, 0, 0] == 2
    assert (int(w[0, 0, 1]) & 0xFFFFFFFF) == (bits(0.25) << 16 | 3)
    assert (int(w[0, 0, 2]) & 0xFFFFFFFF) == (bits(1.5) << 16 | 5)
    assert w[0, 0, 3:].eq(0).all()
    assert w[0, 1, 0] == 1 and (int(w[0, 1, 1]) & 0xFFFFFFFF) == (bits(-2.0) << 16 | 270)
    assert w[1].eq(0).all()
    assert twell_nbytes(2, 300) == t.packed.numel() * 4


def test_overflow_rows_are_kept_not_dropped():
    h = sparse_activation(64, 512, 0.02, seed=1)
    h[[3, 40]] = 1.0  # fully dense rows: 256 nonzeros per tile, far past 31 slots
    h[7] = 0
    h[7, 256:256 + 40] = 2.0  # one tile with 40 > 31 nonzeros
    t = pack_twell(h)
    assert t.overflow_rows.tolist() == [3, 7, 40]
    assert t.n_overflow_rows == 3 and t.n_overflow_tiles == 2 + 2 + 1
    assert torch.equal(t.unpack(), h)
    # The packed counts of an overflow row still carry the true count, so kernels can detect it.
    assert t.counts()[7, 1] == 40 and t.counts()[3].tolist() == [256, 256]


def test_nan_and_inf_are_nonzeros():
    h = torch.zeros(3, 70, dtype=torch.bfloat16)
    h[0, 2], h[1, 69], h[2, 0] = float("nan"), float("inf"), -0.0
    t = pack_twell(h, tile=64, compression=8)
    u = t.unpack()
    assert u[0, 2].isnan() and u[1, 69].isinf() and t.nnz_per_row().tolist() == [1, 1, 0]


@pytest.mark.parametrize("bad, err, match", [
    (lambda: pack_twell(torch.zeros(4, 8)), TypeError, "expected bfloat16"),
    (lambda: pack_twell(torch.zeros(4, 8, 2, dtype=torch.bfloat16)), ValueError, r"\[M, H\]"),
    (lambda: pack_twell(torch.zeros(4, 8, dtype=torch.bfloat16), tile=100, compression=8), ValueError, "multiple"),
    (lambda: pack_twell(torch.zeros(4, 8, dtype=torch.bfloat16), tile=8, compression=8), ValueError, "slot"),
    (lambda: pack_twell(torch.zeros(4, 70000, dtype=torch.bfloat16)), ValueError, "16-bit"),
    (lambda: pack_twell([[1.0]]), TypeError, "torch.Tensor"),
    (lambda: pack_hybrid(torch.zeros(4, 8, dtype=torch.float16)), TypeError, "expected bfloat16"),
    (lambda: pack_hybrid(torch.zeros(4, 8, dtype=torch.bfloat16), width=0), ValueError, "width"),
    (lambda: pack_hybrid(torch.zeros(4, 8, dtype=torch.bfloat16), capacity=-1), ValueError, "capacity"),
])
def test_bad_inputs_raise_clear_errors(bad, err, match):
    with pytest.raises(err, match=match):
        bad()


def test_validate_catches_corrupted_packing():
    h = sparse_activation(8, 256, 0.05, seed=3)
    h[0, 10] = 1.0
    t = pack_twell(h)
    words = t.packed.view(torch.int32).clone()
    words[0, 1] = words[0, 1] | 0x0400  # column moved past H
    with pytest.raises(ValueError):
        TwELL(words.view(torch.uint32), t.overflow_rows, t.overflow_dense, t.n_cols).validate()
    words = t.packed.view(torch.int32).clone()
    words[0, 0] = 40  # count says overflow but the row is not listed
    with pytest.raises(ValueError, match="overflow_rows"):
        TwELL(words.view(torch.uint32), t.overflow_rows, t.overflow_dense, t.n_cols).validate()


@settings(max_examples=40, deadline=None)
@given(
    M=st.integers(0, 60),
    H=st.integers(1, 400),
    width=st.sampled_from([1, 8, 32, 128]),
    density=st.sampled_from([0.0, 0.02, 0.1, 0.5]),
    heavy=st.integers(0, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_hybrid_round_trip_and_capacity(M, H, width, density, heavy, seed):
    h = sparse_activation(M, H, density, heavy, seed)
    n_heavy = int(((h != 0).sum(-1) > width).sum())
    hy = pack_hybrid(h, width=width, capacity=n_heavy)
    assert hy.status is HybridStatus.OK and hy.n_heavy == n_heavy
    assert torch.equal(hy.unpack(), h)
    assert hy.values.shape == (M, width) and hy.cols.dtype == torch.int32
    if n_heavy:
        full = pack_hybrid(h, width=width, capacity=n_heavy - 1)
        assert full.status is HybridStatus.BACKUP_FULL and full.n_heavy == n_heavy
        with pytest.raises(HybridCapacityError, match=f"capacity={n_heavy}"):
            full.unpack()


def test_hybrid_default_capacity_is_an_eighth_of_the_rows():
    h = sparse_activation(100, 300, 0.01, seed=5)
    assert pack_hybrid(h).capacity == 13
    h[:20] = 1.0
    hy = pack_hybrid(h, width=128)
    assert hy.status is HybridStatus.BACKUP_FULL and hy.n_heavy == 20


def _bf16_bits(v):
    return int(torch.tensor([v], dtype=torch.bfloat16).view(torch.int16)) & 0xFFFF


def test_spilled_tiles_are_decoded_exactly():
    """A kernel-written TwELL may move an overflowing tile row to the spill area (count word
    0x80000000 | offset); such rows are exact without a dense backup."""
    h = torch.zeros(3, 300, dtype=torch.bfloat16)
    h[0, :40] = torch.arange(1, 41).to(torch.bfloat16)
    h[1, 260], h[2, :5] = 3, 1
    words = pack_twell(h).packed.view(torch.int32).clone().view(3, 2, 32)
    spill = torch.zeros(100, dtype=torch.int64)
    spill[7] = 40
    spill[8:48] = torch.tensor([(_bf16_bits(c + 1.0) << 16) | c for c in reversed(range(40))])  # any order
    words[0, 0, 0] = torch.tensor(0x80000000 | 7).to(torch.int32)
    spill = torch.where(spill >= 2**31, spill - 2**32, spill).to(torch.int32).view(torch.uint32)
    t = TwELL(words.view(3, 64).view(torch.uint32), None, None, 300, spill=spill)
    t.validate()
    assert t.overflow_rows.tolist() == [] and t.n_spilled_tiles == 1 and t.n_overflow_tiles == 1
    assert t.counts().tolist() == [[40, 0], [0, 1], [5, 0]]
    assert torch.equal(t.unpack(), h)
    bad = words.clone()
    bad[0, 0, 0] = torch.tensor(0x80000000 | 99).to(torch.int32)
    with pytest.raises(ValueError, match="spill"):
        TwELL(bad.view(3, 64).view(torch.uint32), None, None, 300, spill=spill).validate()
    # An offset inside the area whose entries run past its end: ValueError too, not an IndexError.
    short = spill[:20].clone()
    with pytest.raises(ValueError, match="past the end of the spill area"):
        TwELL(words.view(3, 64).view(torch.uint32), None, None, 300, spill=short).validate()
    # nbytes of such a TwELL (overflow fields derived, no source): the words, no backup, the spill area.
    assert t.nbytes() == 3 * 64 * 4 + 100 * 4
    x, w = torch.randn(3, 16).to(torch.bfloat16), torch.randn(300, 16).to(torch.bfloat16)
    assert TwELL(words.view(3, 64).view(torch.uint32), None, None, 300, spill=spill, source=(x, w)).nbytes() == t.nbytes()


def test_nbytes_counts_the_dense_backup_without_building_it():
    """A kernel TwELL recomputes its backup from ``source`` on demand; nbytes counts it at [R, H] bf16
    without running that GEMM, the same number as the eagerly packed TwELL."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 32, generator=g), torch.randn(300, 32, generator=g)
    x[:, 0], w[:, 0] = 1.0, -14.0  # a bias: ~2.5 sd, a few active neurons per row
    x[2, 1:] *= 10  # row 2 overflows its tiles
    x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
    packed = pack_twell(torch.relu(torch.nn.functional.linear(x, w)), compression=8)
    assert packed.n_overflow_rows == 1
    lazy = TwELL(packed.packed, None, None, 300, source=(x, w))
    assert lazy.nbytes() == packed.nbytes() == 6 * 64 * 4 + 8 + 300 * 2
    assert lazy.overflow_dense_ is None  # not built by nbytes


def test_twell_refuses_packed_words_of_the_wrong_geometry():
    """A hand-built TwELL whose words do not match its tiling fails at construction, by name."""
    good = pack_twell(torch.relu(torch.randn(8, 300)).to(torch.bfloat16))
    assert good.packed.shape == (8, 64)  # 2 tiles of 256 at C = 8: 32 slots each
    with pytest.raises(ValueError, match=r"packed: expected uint32 \[M, 64\]"):
        TwELL(good.packed[:, :10].contiguous(), None, None, 300)
    with pytest.raises(TypeError, match="packed: expected uint32"):
        TwELL(good.packed.view(torch.int32), None, None, 300)
    with pytest.raises(ValueError, match="n_cols"):
        TwELL(good.packed, None, None, 0)
    with pytest.raises(ValueError, match="multiple of the compression"):
        TwELL(good.packed, None, None, 300, tile=256, compression=7)


def test_twell_built_while_tracing_with_a_symbolic_width():
    """Export / dynamic shapes give H as a SymInt: the geometry check must not reject it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def build(w, packed):
        return TwELL(packed, None, None, w.shape[0]).packed.view(torch.int32) * 1

    w = torch.zeros(300, 64)
    packed = pack_twell(torch.relu(torch.randn(8, 300)).to(torch.bfloat16)).packed
    graph = make_fx(build, tracing_mode="symbolic")(w, packed)
    assert torch.equal(graph(w, packed), packed.view(torch.int32))


def test_input_checks_trace_under_torch_compile_with_dynamic_shapes():
    """The kernels' ops run these checks inside torch.compile; with dynamic shapes a dimension is a
    SymInt, which the checks must compare but never format unless they fail (formatting it broke
    fullgraph tracing of sparse_gated_ffn once a second shape had been seen)."""
    from twell.reference.ffn import check_gate_args

    def checked(x, w):
        check_gate_args(x, w, 256, 8)
        return x @ w.t()

    compiled = torch.compile(checked, fullgraph=True, dynamic=True, backend="eager")
    try:
        for M, D in ((64, 128), (100, 192)):
            x, w = torch.randn(M, D).bfloat16(), torch.randn(300, D).bfloat16()
            assert torch.equal(compiled(x, w), x @ w.t())
        # a bad input still raises, with its message (fullgraph wraps it in dynamo's exception)
        with pytest.raises(Exception, match="x has D=192 columns but w_gate is"):
            compiled(torch.randn(100, 192).bfloat16(), torch.randn(300, 128).bfloat16())
        x = torch.randn(100, 192).bfloat16()
        for w, want in ((torch.randn(300, 192), "w_gate: expected bfloat16 [H, 192] on cpu contiguous, got"),
                        (torch.randn(192, 300).bfloat16().t(), "non-contiguous'; call .contiguous() first")):
            with pytest.raises(Exception, match=re.escape(want)):
                compiled(x, w)
    finally:
        torch._dynamo.reset()
