"""The decoding FFN's pure-PyTorch reference (CPU): dense bf16 PyTorch's values (same roundings, sums in
another order) on random shapes; NaN handling; readable errors."""
from __future__ import annotations

import pytest
import torch

from twell.nn import routing
from twell.reference import DECODE_MAX_ROWS, decode_gated_ffn, dense_gated_ffn


def _inputs(M, D, H, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g).bfloat16()
    w = [(torch.randn(H, D, generator=g) / D ** 0.5).bfloat16() for _ in range(3)]
    return x, *w


@pytest.mark.parametrize("M,D,H", [(1, 64, 1), (3, 128, 200), (16, 256, 1000), (32, 64, 77)])
def test_equals_dense(M, D, H):
    x, w_gate, w_up, w_down_t = _inputs(M, D, H, seed=M + H)
    got = decode_gated_ffn(x, w_gate, w_up, w_down_t)
    want = dense_gated_ffn(x, w_gate, w_up, w_down_t.t())
    # one bf16 rounding of the output apart at most (8 bits of mantissa)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


def test_skips_inactive_neurons_even_non_finite():
    x, w_gate, w_up, w_down_t = _inputs(2, 64, 10, seed=0)
    w_gate[3] = -1  # never active for x >= 0 rows
    x = x.abs()
    assert (x.float() @ w_gate[3].float() < 0).all()
    # The same FFN without neuron 3, in dense PyTorch: what skipping it must give.
    others = [n for n in range(10) if n != 3]
    want = dense_gated_ffn(x, w_gate[others], w_up[others], w_down_t[others].t())
    w_up[3] = float("inf")  # read, it would make 0 * inf = NaN
    out = decode_gated_ffn(x, w_gate, w_up, w_down_t)
    # one bf16 rounding apart at most, as in test_equals_dense (dropping any active neuron breaks it)
    torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -7, atol=1e-6)


def test_nan_gate_is_active():
    x, w_gate, w_up, w_down_t = _inputs(3, 64, 12, seed=1)
    x[1, 0] = float("nan")
    out = decode_gated_ffn(x, w_gate, w_up, w_down_t)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()


def test_errors():
    x, w_gate, w_up, w_down_t = _inputs(DECODE_MAX_ROWS + 1, 64, 8, seed=2)
    with pytest.raises(ValueError, match="rows"):
        decode_gated_ffn(x, w_gate, w_up, w_down_t)
    with pytest.raises(ValueError, match="multiple of 64"):
        decode_gated_ffn(torch.zeros(1, 96, dtype=torch.bfloat16), *(torch.zeros(8, 96, dtype=torch.bfloat16),) * 3)
    with pytest.raises(ValueError):
        decode_gated_ffn(x[:2], w_gate, w_up[:4], w_down_t)
    with pytest.raises(TypeError, match="bfloat16"):
        decode_gated_ffn(x[:2].float(), w_gate, w_up, w_down_t)
    from twell.reference.decode import DECODE_MAX_H

    wide = torch.zeros(DECODE_MAX_H + 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="hidden units"):
        decode_gated_ffn(x[:1], wide, wide, wide)


def test_layer_row_settings_are_checked():
    from twell.nn import SparseFFN
    from twell.nn.ffn import DEFAULT_DECODE_ROWS, DEFAULT_DENSE_ROWS

    f = SparseFFN(64, 32)
    assert f.decode_rows == DEFAULT_DECODE_ROWS <= DECODE_MAX_ROWS and f.dense_rows == DEFAULT_DENSE_ROWS
    assert DEFAULT_DENSE_ROWS[0] == DEFAULT_DECODE_ROWS + 1  # no row count between the two rules
    f.decode_rows, f.dense_rows = DECODE_MAX_ROWS, None
    f.decode_rows, f.dense_rows = 0, None
    f.dense_rows = [40, 40]
    assert f.dense_rows == (40, 40)
    for bad in (DECODE_MAX_ROWS + 1, -1, True, 2.0):
        with pytest.raises(ValueError, match="decode_rows"):
            f.decode_rows = bad
    for bad in ((0, 5), (9, 3), (1,), (1.0, 2), "33-2048"):
        with pytest.raises(ValueError, match="dense_rows"):
            f.dense_rows = bad


def test_cpu_layer_keeps_the_reference_at_few_rows():
    """The decoding op is a kernel path: on CPU "auto" runs the TwELL reference at any row count."""
    from twell.nn import SparseFFN
    from twell.reference import sparse_gated_ffn

    f = SparseFFN(64, 96).to(torch.bfloat16)
    x = torch.randn(3, 64).bfloat16()
    with torch.no_grad():
        out = f(x)
        assert f.last_path == "twell-reference"
        assert torch.equal(out, sparse_gated_ffn(x, f.gate_proj.weight, f.up_proj.weight, f.w_down_t()))


def test_auto_measures_activity_on_a_dense_rows_call(monkeypatch):
    """A first call that "auto" runs dense by row count (a prefill) still measures the layer's activity, on all
    its tokens; a denser layer than auto_max_active then runs dense at every row count. (The kernels' route is
    forced on CPU: only the dense path runs here.)"""
    from twell.nn import SparseFFN

    f = SparseFFN(64, 96).to(torch.bfloat16)
    monkeypatch.setattr(routing, "auto_route", lambda state, x: ("kernel", ""))  # the kernels' route, forced
    x = torch.randn(100, 64).bfloat16()  # inside dense_rows (17-1023)
    with torch.no_grad():
        out = f(x)
        want = f.down_proj(torch.relu(f.gate_proj(x)) * f.up_proj(x))
    assert torch.equal(out, want) and f.last_path == "dense" and "dense_rows" in f.auto_note
    assert f._auto_dense is True  # a random layer: about half its neurons active, far above 1.25%
    f.reset_auto()
    f.auto_max_active = 0.99
    with torch.no_grad():
        f(x)
    assert f._auto_dense is False


def test_dense_by_activity_layer_takes_the_decoding_op_on_few_rows(monkeypatch):
    """"auto" on a layer past auto_max_active: the decoding op while the rows' expected union of active neurons
    stays within DECODE_MAX_UNION of H, dense past that (the kernels' route and op forced on CPU: the reference
    op stands in for the kernel)."""
    import twell.kernels
    from twell.nn import SparseFFN
    from twell.nn.ffn import DECODE_MAX_UNION

    f = SparseFFN(64, 96).to(torch.bfloat16)
    monkeypatch.setattr(routing, "auto_route", lambda state, x: ("kernel", ""))  # the kernels' route, forced
    monkeypatch.setattr(twell.kernels, "decode_gated_ffn_trusted", decode_gated_ffn, raising=False)
    f._set_activity(0.03)
    assert f._auto_dense and f.decode_max_rows() == 9 and "but for the decoding op" in f.auto_note
    assert 1 - 0.97 ** 9 <= DECODE_MAX_UNION < 1 - 0.97 ** 10
    with torch.no_grad():
        for m, path in ((1, "twell-kernel"), (9, "twell-kernel"), (10, "dense"), (16, "dense")):
            x = torch.randn(m, 64).bfloat16()
            out = f(x)
            assert f.last_path == path, m
            if path == "twell-kernel":
                assert torch.equal(out, decode_gated_ffn(x, f.gate_proj.weight, f.up_proj.weight, f.w_down_t()))
        f.keep_gate = True  # the TwELL is asked for: the decoding op keeps none
        f(torch.randn(2, 64).bfloat16())
        assert f.last_path == "dense"
        f.keep_gate = False
        f.dense_rows = (1, 2048)  # set by hand over the decoding range: dense_rows wins, as on sparse layers
        f(torch.randn(2, 64).bfloat16())
        assert f.last_path == "dense"
        f.dense_rows = (17, 2048)
    for active, rows in ((0.0, 16), (0.005, 16), (0.083, 3), (0.2, 1), (0.3, 0)):
        f._set_activity(active)
        assert f.decode_max_rows() == min(rows, f.decode_rows), active
    f.decode_rows = 4
    f._set_activity(0.005)
    assert f.decode_max_rows() == 4
    f._set_activity(0.3)
    assert "decoding op" not in f.auto_note  # too dense for it at any row count
    f.reset_auto()
    assert f.decode_max_rows() == 0  # nothing measured: no exception to "dense"
