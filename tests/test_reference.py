"""Reference ops against the dense computation (fp32), with the tolerance rule of STYLE.md:
the sparse op's error must stay within a small multiple of dense bf16 PyTorch's error."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import put_nonfinite
from twell.formats import HybridCapacityError
from twell.nn import SparseFFN
from twell.reference import (
    dense_gated_ffn, hybrid_gated_ffn, sparse_gated_ffn, twell_ffn, twell_gate, twell_gated_ffn,
)
from twell.reference.ffn import SPARSE_FFN_COMPRESSION


def ffn_inputs(M, D, H, offset, seed, heavy_rows=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g)
    x[:, 0] = 1
    if heavy_rows and M:
        x[:heavy_rows, 1:] *= 6  # large rows cross the offset in many columns: heavy tail, overflow
    w_gate = torch.randn(H, D, generator=g) / D**0.5
    w_gate[:, 0] = -offset
    w_up = torch.randn(H, D, generator=g) / D**0.5
    w_down = torch.randn(D, H, generator=g) / H**0.5
    return [t.to(torch.bfloat16) for t in (x, w_gate, w_up, w_down)]


def rel_err(a, ref):
    return ((a.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def fp32_gated(x, wg, wu, wd):
    x, wg, wu, wd = (t.double() for t in (x, wg, wu, wd))
    return ((F.relu(x @ wg.t()) * (x @ wu.t())) @ wd.t()).float()


@settings(max_examples=25, deadline=None)
@given(
    M=st.integers(1, 90), D=st.sampled_from([8, 64, 96]), H=st.integers(5, 600),
    offset=st.sampled_from([0.0, 1.5, 2.5]), heavy=st.integers(0, 3),
    tiling=st.sampled_from([(256, 8), (128, 4), (64, 2)]), seed=st.integers(0, 2**31 - 1),
)
def test_gated_ffn_matches_dense(M, D, H, offset, heavy, tiling, seed):
    x, wg, wu, wd = ffn_inputs(M, D, H, offset, seed, heavy)
    ref = fp32_gated(x, wg, wu, wd)
    if ref.norm() == 0:
        return
    gate = twell_gate(x, wg, *tiling)
    assert torch.equal(gate.unpack(), F.relu(F.linear(x, wg)))
    out = twell_gated_ffn(x, gate, wu, wd.t().contiguous())
    assert out.dtype == torch.bfloat16 and out.shape == (M, D)
    # Strict: given the gate's own bf16 h (the value dense bf16 uses too), the reference may only round
    # its output to bf16 (2**-8 relative) and err in fp32 products and sums: at most (D + H + 2) * 2**-24
    # of the sum of magnitudes (<= 4.2e-5 for these shapes), below the 2**-14 allowed here.
    h = gate.unpack().double()
    exact = (h * (x.double() @ wu.double().t())) @ wd.double().t()
    magnitude = (h * (x.double().abs() @ wu.double().abs().t())) @ wd.double().abs().t()
    assert ((out.double() - exact).abs() <= 2**-8 * exact.abs() + 2**-14 * magnitude).all()
    # STYLE's rule against fp32. Floor: two bf16 roundings (h and the output), which dense makes too;
    # in a row with one or two active neurons they do not average out, and dense's own roundings can
    # cancel by luck (M=1, D=8, H=100, offset 2.5, seed 100: 4.1e-3 against dense's 1.5e-3).
    dense_err = rel_err(dense_gated_ffn(x, wg, wu, wd), ref)
    assert rel_err(out, ref) <= 2 * dense_err + 2**-7


def test_gated_ffn_overflow_rows_are_exact():
    x, wg, wu, wd = ffn_inputs(64, 64, 512, 1.5, seed=11, heavy_rows=5)
    gate = twell_gate(x, wg)
    assert gate.n_overflow_rows >= 5  # the heavy rows overflow their tiles
    out = twell_gated_ffn(x, gate, wu, wd.t().contiguous())
    ref = fp32_gated(x, wg, wu, wd)
    assert rel_err(out, ref) <= 2 * rel_err(dense_gated_ffn(x, wg, wu, wd), ref) + 1e-3


def test_non_gated_ffn_matches_dense():
    x, _, wu, wd = ffn_inputs(50, 64, 300, 1.0, seed=2, heavy_rows=2)
    act = twell_gate(x, wu, 64, 4)
    out = twell_ffn(act, wd.t().contiguous())
    ref = (F.relu(x.double() @ wu.double().t()) @ wd.double().t()).float()
    dense = F.linear(F.relu(F.linear(x, wu)), wd)
    assert rel_err(out, ref) <= 2 * rel_err(dense, ref) + 1e-3


def test_sparse_gated_ffn_composes_gate_and_ffn():
    x, wg, wu, wd = ffn_inputs(33, 64, 260, 1.5, seed=4)
    wdt = wd.t().contiguous()
    assert torch.equal(sparse_gated_ffn(x, wg, wu, wdt, 128, 4), twell_gated_ffn(x, twell_gate(x, wg, 128, 4), wu, wdt))


def test_nan_in_activation_propagates():
    x, wg, wu, wd = ffn_inputs(4, 64, 100, 1.0, seed=5)
    x[2, 3] = float("nan")
    out = sparse_gated_ffn(x, wg, wu, wd.t().contiguous())
    assert out[2].isnan().all() and not out[[0, 1, 3]].isnan().any()


def _bad(t):
    return ~torch.isfinite(t)


@pytest.mark.parametrize("where", ["x", "w_gate", "w_up_active", "w_down_active"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_nonfinite_values_propagate_through_the_ops(where, value):
    """The reference ops (the kernels' contract) read every active entry: a non-finite x row, a
    non-finite gate weight (read for every row), or a non-finite up/down weight of a neuron reach
    every row that the value enters, as in dense PyTorch; they never raise."""
    x, wg, wu, wd = ffn_inputs(16, 64, 300, 1.0, seed=7)
    h = F.relu(F.linear(x, wg))
    n = int(h[5].nonzero()[0])  # a neuron active on row 5
    rows = h[:, n] > 0
    put_nonfinite(where, value, n, x, wg, wu, wd)
    out = sparse_gated_ffn(x, wg, wu, wd.t().contiguous())
    dense = dense_gated_ffn(x, wg, wu, wd)
    bad = _bad(out)
    if where == "x":
        assert bad[5].any() and torch.equal(bad.any(1), _bad(dense).any(1))
    elif where == "w_gate":  # x @ w_gate.T has the value in column n of every row: active everywhere
        assert torch.equal(bad.any(1), _bad(dense).any(1))
    elif where == "w_up_active":
        assert bad[rows].any(1).all()  # every row where n is active
    else:
        assert bad[rows, 7].all() and not bad[:, :7].any()


@pytest.mark.parametrize("where", ["w_up", "w_down"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_sparse_ffn_module_gives_dense_nonfinite_pattern(where, value):
    """A non-finite up/down weight of a neuron that is inactive on most rows: dense PyTorch gives
    NaN on every row (0 * NaN), the module's sparse path gives the same non-finite pattern, and goes
    back to finite outputs once the weight is repaired (the check follows the weight's version)."""
    torch.manual_seed(3)
    ffn = SparseFFN(64, 300, path="reference").to(torch.bfloat16)
    with torch.no_grad():
        ffn.gate_proj.weight[:, 0] = -1.0
    x = torch.randn(2, 9, 64).to(torch.bfloat16)
    x[..., 0] = 1
    with torch.no_grad():
        h = F.relu(ffn.gate_proj(x)).reshape(-1, 300)
        n = int(h.gt(0).sum(0).argmin())  # the least active neuron
        assert h[:, n].eq(0).sum() > 0
        w = ffn.up_proj.weight if where == "w_up" else ffn.down_proj.weight
        old = w.clone()
        idx = (n, 3) if where == "w_up" else (3, n)
        finite = ffn(x)
        assert torch.isfinite(finite).all() and ffn.nonfinite_row() is None
        w[idx] = value
        out = ffn(x)
        assert ffn.last_path == "twell-reference"
        ffn.path = "dense"
        dense = ffn(x)
        assert _bad(dense).any()
        assert torch.equal(_bad(out), _bad(dense))
        ffn.path = "auto"
        assert torch.equal(_bad(ffn(x)), _bad(dense))
        w.copy_(old)
        assert torch.equal(ffn(x), finite)


def test_nonfinite_check_on_a_layer_built_under_inference_mode():
    """Inference tensors have no version counter: the module still runs its sparse path, and sees an
    in-place write of a NaN into an up weight (and its repair) on the next call."""
    torch.manual_seed(4)
    with torch.inference_mode():
        ffn = SparseFFN(64, 300, path="reference").to(torch.bfloat16)
        ffn.gate_proj.weight[:, 0] = -1.0
        x = torch.randn(2, 9, 64).to(torch.bfloat16)
        x[..., 0] = 1
        finite = ffn(x)
        assert torch.isfinite(finite).all() and ffn.last_path == "twell-reference"
        old = ffn.up_proj.weight.clone()
        ffn.up_proj.weight[5, 3] = float("nan")
        assert ffn(x).isnan().all()  # dense: 0 * NaN on every row
        ffn.up_proj.weight.copy_(old)
        assert torch.equal(ffn(x), finite)


@pytest.mark.parametrize("case, err, match", [
    ("x_dtype", TypeError, "x: expected bfloat16"),
    ("w_shape", ValueError, "w_up: expected"),
    ("gate_rows", ValueError, "x: expected"),
    ("noncontig", ValueError, "contiguous"),
    ("gate_type", TypeError, "TwELL"),
])
def test_bad_ffn_inputs_raise(case, err, match):
    x, wg, wu, wd = ffn_inputs(8, 64, 100, 1.0, seed=6)
    gate, wdt = twell_gate(x, wg), wd.t().contiguous()
    args = {"x": x, "gate": gate, "w_up": wu, "w_down_t": wdt}
    if case == "x_dtype":
        args["x"] = x.float()
    elif case == "w_shape":
        args["w_up"] = wu[:, :32].contiguous()
    elif case == "gate_rows":
        args["x"] = x[:5].contiguous()
    elif case == "noncontig":
        args["w_down_t"] = wd.t()
    elif case == "gate_type":
        args["gate"] = gate.unpack()
    with pytest.raises(err, match=match):
        twell_gated_ffn(**args)


def test_hybrid_gated_ffn_forward_and_backward_match_dense_autograd():
    x, wg, wu, wd = ffn_inputs(45, 64, 300, 1.5, seed=7, heavy_rows=3)
    wdt = wd.t().contiguous()
    ref_leaves = [t.double().requires_grad_() for t in (x, wg, wu, wdt)]
    xs, wgs, wus, wds = ref_leaves
    h = F.relu(xs @ wgs.t()) * (xs @ wus.t())
    out_ref, l1_ref = h @ wds, h.abs().sum(-1).mean()
    grad_out = torch.randn(out_ref.shape, dtype=torch.float64)
    ((out_ref * grad_out).sum() + 0.3 * l1_ref).backward()

    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wdt)]
    out, l1 = hybrid_gated_ffn(*leaves, width=32, capacity=10)
    ((out.float() * grad_out.float()).sum() + 0.3 * l1).backward()

    bf16_leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wdt)]
    hb = F.relu(bf16_leaves[0] @ bf16_leaves[1].t()) * (bf16_leaves[0] @ bf16_leaves[2].t())
    ((hb @ bf16_leaves[3]).float() * grad_out.float()).sum().add(0.3 * hb.float().abs().sum(-1).mean()).backward()

    assert rel_err(out, out_ref.float()) <= 2 * rel_err(hb @ bf16_leaves[3], out_ref.float()) + 1e-3
    assert abs(l1.item() - l1_ref.item()) <= 1e-2 * l1_ref.item()
    for mine, bf16, ref in zip(leaves, bf16_leaves, ref_leaves):
        assert rel_err(mine.grad, ref.grad.float()) <= 2 * rel_err(bf16.grad, ref.grad.float()) + 1e-3


def test_hybrid_gated_ffn_refuses_a_full_backup():
    x, wg, wu, wd = ffn_inputs(40, 64, 300, 1.5, seed=8, heavy_rows=6)
    with pytest.raises(HybridCapacityError, match="grow it"):
        hybrid_gated_ffn(x, wg, wu, wd.t().contiguous(), width=8, capacity=1)


def test_module_paths_agree_and_report_themselves():
    torch.manual_seed(0)
    ffn = SparseFFN(64, 300).to(torch.bfloat16)
    with torch.no_grad():
        ffn.gate_proj.weight[:, 0] = -1.0
    x = torch.randn(3, 7, 64).to(torch.bfloat16)
    x[..., 0] = 1
    with torch.no_grad():
        ffn.path = "dense"
        dense = ffn(x)
        assert ffn.last_path == "dense"
        ffn.path = "reference"
        ref = ffn(x)
        assert ffn.last_path == "twell-reference"
        ffn.path = "auto"
        auto = ffn(x)
        assert ffn.last_path == "twell-reference"  # CPU input: the kernels are never used
    assert torch.equal(ref, auto)
    assert rel_err(ref, dense.float()) < 1e-2
    with pytest.raises(ValueError, match="path must be one of"):
        ffn.path = "fast"
    silu = SparseFFN(64, 100, activation="silu")
    with pytest.raises(ValueError, match="needs activation='relu'"):
        silu.path = "reference"


def test_module_runs_one_op_unless_it_needs_the_twell(monkeypatch):
    """A gated layer calls sparse_gated_ffn (the kernels' one op, which keeps the TwELL inside) with its
    tiling and union rule; with keep_gate it calls the gate op and the fused op instead and keeps the
    TwELL. Same result either way (the reference shows the routing on the CPU; the kernels' bits are
    compared on the GPU)."""
    import twell.reference as ref_ops

    calls = []
    one_op = ref_ops.sparse_gated_ffn

    def spy(*args, **kwargs):
        calls.append((args[4:], kwargs))
        return one_op(*args, **kwargs)

    monkeypatch.setattr(ref_ops, "sparse_gated_ffn", spy)
    x, wg, wu, wd = ffn_inputs(70, 64, 300, -1.0, 0)
    ffn = SparseFFN(64, 300, path="reference").to(torch.bfloat16)
    with torch.no_grad():
        for m, w in ((ffn.gate_proj, wg), (ffn.up_proj, wu), (ffn.down_proj, wd)):
            m.weight.copy_(w)
        ffn.union = (0.8, 400)
        out = ffn(x)
        assert calls == [((256, SPARSE_FFN_COMPRESSION), {"union": (0.8, 400.0)})] and ffn.last_gate is None
        ffn.keep_gate = True
        kept = ffn(x)
    assert len(calls) == 1, "keep_gate must take the two ops"
    assert ffn.last_gate.compression == SPARSE_FFN_COMPRESSION and ffn.last_gate.n_rows == 70
    assert torch.equal(out, kept)
    assert torch.equal(out, one_op(x, wg, wu, wd.t().contiguous()))


OPS = ("twell_gate", "twell_gated_ffn", "twell_ffn", "sparse_gated_ffn")


def _arguments(fn):
    """(name, kind, default) of each parameter: the signature without its annotations, which the two
    modules spell differently."""
    import inspect

    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", OPS)
def test_kernel_and_reference_ops_take_the_same_arguments(name):
    """The kernels' ops and the reference ops have the same arguments and defaults, settings included
    (twell.kernels imports without a GPU and builds nothing)."""
    from twell import kernels, reference

    assert _arguments(getattr(kernels, name)) == _arguments(getattr(reference, name))


def test_settings_default_to_the_named_constants():
    """Each setting's default is the one constant of twell.reference.ffn (docs/kernels.md §2), in the
    kernels and the reference alike."""
    import inspect

    from twell import kernels
    from twell.reference import ffn

    for module in (kernels, ffn):
        for name in OPS:
            params = inspect.signature(getattr(module, name)).parameters
            defaults = {"union": None, "dense_cap": ffn.DENSE_CAP, "gate_cluster": ffn.GATE_CLUSTER,
                        "compression": ffn.SPARSE_FFN_COMPRESSION}
            for arg, want in defaults.items():
                if arg in params:
                    assert params[arg].default is want, (module.__name__, name, arg)
    assert ffn.check_union_rule(None) is None and ffn.UNION_OFF == (0.0, 0.0) and ffn.GATE_CLUSTER == 2
    assert inspect.signature(kernels.union_plan).parameters["ratio"].default == ffn.UNION_RULE[0]
    assert inspect.signature(kernels.union_plan).parameters["base"].default == ffn.UNION_RULE[1]


def test_compression_default_is_one_value_for_the_ops():
    """twell_gate, sparse_gated_ffn (kernels and reference), layer_unsupported and SparseFFN default to
    one compression, SPARSE_FFN_COMPRESSION, so twell_gated_ffn(x, twell_gate(x, w_gate), ...) is the
    default sparse_gated_ffn. The format's packer keeps the published one (PUBLISHED_COMPRESSION: it has
    no spill area; docs/kernels.md §6)."""
    import inspect

    from twell import kernels, reference
    from twell.formats import TwELL, pack_twell, twell_nbytes
    from twell.formats.twell import PUBLISHED_COMPRESSION

    def default(fn):
        return inspect.signature(fn).parameters["compression"].default

    ops = [kernels.twell_gate, kernels.sparse_gated_ffn, kernels.layer_unsupported, reference.twell_gate,
           reference.sparse_gated_ffn, SparseFFN.__init__]
    assert {default(fn) for fn in ops} == {SPARSE_FFN_COMPRESSION} == {16}
    assert {default(fn) for fn in (pack_twell, twell_nbytes)} == {PUBLISHED_COMPRESSION} == {8}
    assert TwELL.__dataclass_fields__["compression"].default == PUBLISHED_COMPRESSION
    x, wg, wu, wd = ffn_inputs(70, 64, 300, 1.0, 3, heavy_rows=2)
    wdt = wd.t().contiguous()
    gate = twell_gate(x, wg)
    assert gate.compression == SPARSE_FFN_COMPRESSION
    assert torch.equal(twell_gated_ffn(x, gate, wu, wdt), sparse_gated_ffn(x, wg, wu, wdt))


@pytest.mark.parametrize("kwargs,match", [
    (dict(dense_cap=-1), "dense_cap"), (dict(dense_cap=2.5), "dense_cap"), (dict(dense_cap=True), "dense_cap"),
    (dict(dense_cap="4096"), "dense_cap"), (dict(gate_cluster=0), "gate_cluster"),
    (dict(gate_cluster=4), "gate_cluster"), (dict(gate_cluster=2.0), "gate_cluster"),
])
def test_kernel_settings_are_checked_on_the_cpu(kwargs, match):
    """The kernels' dense-path capacity and gate cluster size are checked by the reference too, so a bad
    setting fails on the CPU as on the GPU; good ones leave the result unchanged."""
    from twell.reference.ffn import check_dense_cap, check_gate_cluster

    x, wg, wu, wd = ffn_inputs(70, 64, 300, -1.0, 0)
    wdt = wd.t().contiguous()
    with pytest.raises(ValueError, match=match):
        sparse_gated_ffn(x, wg, wu, wdt, **kwargs)
    if "dense_cap" in kwargs:
        with pytest.raises(ValueError, match=match):
            twell_gated_ffn(x, twell_gate(x, wg), wu, wdt, **kwargs)
        with pytest.raises(ValueError, match=match):
            twell_ffn(twell_gate(x, wu), wdt, **kwargs)
    else:
        with pytest.raises(ValueError, match=match):
            twell_gate(x, wg, **kwargs)
    assert check_dense_cap(None) is None and check_dense_cap(0) == 0 and check_gate_cluster(1) == 1
    same = sparse_gated_ffn(x, wg, wu, wdt, dense_cap=0, gate_cluster=1)
    assert torch.equal(same, sparse_gated_ffn(x, wg, wu, wdt))


@pytest.mark.parametrize("bad", [(1.0,), (-1.0, 0.0), (0.5, -600.0), (float("inf"), 0.0), "12", 0.5])
def test_union_rule_is_checked(bad):
    """``union`` (the kernels' block-union rule, per call or per layer) is checked in the reference too,
    so a bad setting fails on the CPU as it would on the GPU; a good one leaves the result unchanged."""
    x, wg, wu, wd = ffn_inputs(70, 64, 300, -1.0, 0)
    gate = twell_gate(x, wg)
    wdt = wd.t().contiguous()
    with pytest.raises(ValueError, match="union"):
        twell_gated_ffn(x, gate, wu, wdt, union=bad)
    with pytest.raises(ValueError, match="union"):
        sparse_gated_ffn(x, wg, wu, wdt, union=bad)
    assert torch.equal(twell_gated_ffn(x, gate, wu, wdt, union=(0.43, 600)), twell_gated_ffn(x, gate, wu, wdt))
    assert torch.equal(sparse_gated_ffn(x, wg, wu, wdt, union=(0.43, 600)), sparse_gated_ffn(x, wg, wu, wdt))
    ffn = SparseFFN(64, 300)
    with pytest.raises(ValueError, match="union"):
        ffn.union = bad
    ffn.union = [0.43, 600]
    assert ffn.union == (0.43, 600.0) and "union=(0.43, 600.0)" in repr(ffn)
    ffn.union = None
    assert ffn.union is None and "union" not in repr(ffn)


def test_module_from_llama_mlp_shares_weights():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=200, hidden_act="relu")
    mlp = LlamaMLP(cfg)
    ffn = SparseFFN.from_llama_mlp(mlp, path="reference")
    assert ffn.up_proj is mlp.up_proj and ffn.gate_proj is mlp.gate_proj
    x = torch.randn(5, 64)
    with torch.no_grad():
        torch.testing.assert_close(ffn._dense(x), mlp(x))
    with pytest.raises(TypeError, match="Llama MLP"):
        SparseFFN.from_llama_mlp(torch.nn.Linear(3, 3))


def test_module_from_llama_mlp_keeps_the_mlps_activation():
    """A stock SiLU Llama MLP must not silently become a ReLU FFN."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    x = torch.randn(7, 64, dtype=torch.bfloat16)
    for act in ("silu", "relu"):
        mlp = LlamaMLP(transformers.LlamaConfig(hidden_size=64, intermediate_size=200, hidden_act=act))
        mlp = mlp.to(torch.bfloat16)
        ffn = SparseFFN.from_llama_mlp(mlp)
        assert ffn.activation == act
        with torch.no_grad():
            out, want = ffn(x), mlp(x)
        assert ffn.last_path == ("twell-reference" if act == "relu" else "dense")
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    with pytest.warns(UserWarning, match="act_fn is relu, the SparseFFN will compute silu"):
        SparseFFN.from_llama_mlp(mlp, activation="silu")
    gelu = LlamaMLP(transformers.LlamaConfig(hidden_size=64, intermediate_size=200, hidden_act="gelu"))
    with pytest.raises(ValueError, match="pass activation="):
        SparseFFN.from_llama_mlp(gelu)
    assert SparseFFN.from_llama_mlp(gelu, activation="relu").activation == "relu"
    # Equal to relu on small values only: the probe's large values tell them apart.
    relu6 = LlamaMLP(transformers.LlamaConfig(hidden_size=64, intermediate_size=200, hidden_act="relu6"))
    with pytest.raises(ValueError, match="cannot tell the activation"):
        SparseFFN.from_llama_mlp(relu6)


@pytest.mark.parametrize("act,want", [
    (torch.nn.ReLU(inplace=True), "relu"), (torch.nn.SiLU(inplace=True), "silu"), (torch.relu, "relu"),
    (lambda t: torch.nn.functional.silu(t.to(torch.bfloat16)), "silu"), (torch.nn.ReLU6(), None),
    (lambda t: t.clamp(0, 5), None), (torch.nn.Hardtanh(0, 10), None), (torch.tanh, None), ("relu", None),
    (lambda a, b: a, None)])
def test_activation_name_probe(act, want):
    from twell.nn.ffn import _activation_name

    assert _activation_name(act) == want


def test_module_auto_goes_dense_where_no_sparse_path_fits_and_tiling_fails_early():
    wide = SparseFFN(64, 70000).to(torch.bfloat16)  # H past TwELL's 16-bit column index
    with torch.no_grad():
        wide(torch.randn(3, 64, dtype=torch.bfloat16))
    assert wide.last_path == "dense" and "65536" in wide.auto_note
    with pytest.raises(ValueError, match="multiple of the compression"):
        SparseFFN(64, 256, compression=7)


def test_module_auto_says_why_it_left_the_sparse_paths():
    bf = torch.bfloat16
    ffn = SparseFFN(64, 256)
    x = torch.randn(9, 64)
    with torch.no_grad():
        ffn(x)  # fp32 module and input: no sparse path computes in fp32
        assert ffn.last_path == "dense" and "bfloat16" in ffn.auto_note
        ffn.to(bf)
        out = ffn(x.to(bf))
        assert ffn.last_path == "twell-reference" and "input on cpu" in ffn.auto_note
        assert ffn.last_gate is None  # kept only on request (a TwELL per layer is large)
        ffn.keep_gate = True
        ffn(x.to(bf))
        assert ffn.last_gate is not None and ffn.last_gate.n_rows == 9
        ffn.path = "dense"
        torch.testing.assert_close(out.float(), ffn(x.to(bf)).float(), rtol=2e-2, atol=2e-2)
        ffn.path = "auto"
        with pytest.raises(ValueError, match="hidden_size=64"):
            ffn(torch.randn(9, 32, dtype=bf))
    biased = SparseFFN(64, 256, bias=True).to(bf)
    with torch.no_grad():
        biased(x.to(bf))
    assert biased.last_path == "dense" and "bias" in biased.auto_note
    silu = SparseFFN(64, 256, activation="silu").to(bf)
    with torch.no_grad():
        silu(x.to(bf))
    assert silu.last_path == "dense" and "relu" in silu.auto_note



class _HalfLinear(torch.nn.Linear):  # a subclass with its own forward (fake-quant, adapters, ...)
    def forward(self, x):
        return 0.5 * super().forward(x)


@pytest.mark.parametrize("change", ["pre-hook", "hook", "subclass", "patched forward", "non-contiguous"])
def test_module_runs_dense_where_the_sparse_paths_would_skip_what_a_projection_does(change):
    """The sparse paths read the weights and never call the projections: "auto" runs such a layer
    dense (what a LlamaMLP computes, hooks called), an explicit sparse path refuses it. Global hooks
    (torch's ModuleTracker: FlopCounterMode, memory trackers) only observe and change nothing."""
    bf = torch.bfloat16
    torch.manual_seed(0)
    ffn = SparseFFN(64, 256).to(bf)
    seen, handles = [], []
    if change == "pre-hook":
        handles.append(ffn.down_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape)))
    elif change == "hook":
        handles.append(ffn.down_proj.register_forward_hook(lambda m, a, out: 0 * out))
    elif change == "subclass":
        half = _HalfLinear(256, 64, bias=False).to(bf)
        half.weight = ffn.down_proj.weight
        ffn.down_proj = half
    elif change == "patched forward":
        plain = ffn.up_proj.forward
        ffn.up_proj.forward = lambda x: 2 * plain(x)
    else:  # gate and up split out of a fused input-major [D, 2H] matrix
        fused = torch.randn(64, 512, dtype=bf)
        ffn.gate_proj.weight = torch.nn.Parameter(fused[:, :256].t())
        ffn.up_proj.weight = torch.nn.Parameter(fused[:, 256:].t())
    x = torch.randn(3, 5, 64, dtype=bf)
    if change == "pre-hook":
        from torch.utils.flop_counter import FlopCounterMode

        with torch.no_grad(), FlopCounterMode(display=False):
            fresh = SparseFFN(64, 256).to(bf)
            fresh(x)
        assert fresh.last_path == "twell-reference"
    try:
        with torch.no_grad():
            want = ffn.down_proj(torch.relu(ffn.gate_proj(x)) * ffn.up_proj(x))
            seen.clear()
            out = ffn(x)
            assert ffn.last_path == "dense" and ffn.auto_note.startswith("auto: dense"), ffn.auto_note
            assert torch.equal(out, want)
            if change == "pre-hook":
                assert len(seen) == 1
            ffn.path = "reference"
            with pytest.raises(ValueError, match="cannot run this layer"):
                ffn(x)
    finally:
        for h in handles:
            h.remove()
    if change in ("pre-hook", "hook"):  # without the hook the layer is sparse again
        with torch.no_grad():
            ffn.path = "auto"
            ffn(x)
        assert ffn.last_path == "twell-reference"


def test_module_auto_route_is_what_forward_runs():
    """auto_route (which choose_union_paths asks) names the path forward then takes, with the same reason."""
    bf = torch.bfloat16
    x = torch.randn(5, 64, dtype=bf)
    layers = {"silu": SparseFFN(64, 256, activation="silu").to(bf), "bias": SparseFFN(64, 256, bias=True).to(bf),
              "fp32": SparseFFN(64, 256), "plain": SparseFFN(64, 256).to(bf), "track": SparseFFN(64, 256).to(bf)}
    layers["track"].track = True
    expect = {"silu": ("dense", "relu"), "bias": ("dense", "bias"), "fp32": ("dense", "bfloat16"),
              "plain": ("reference", "input on cpu"), "track": ("dense", "tracking")}
    ran = {"dense": "dense", "reference": "twell-reference"}
    for name, ffn in layers.items():
        xi = x.float() if name == "fp32" else x
        route, why = ffn.auto_route(xi)
        assert route == expect[name][0] and expect[name][1] in why, (name, route, why)
        with torch.no_grad():
            ffn(xi)
        assert ffn.last_path == ran[route] and why in ffn.auto_note, (name, ffn.auto_note)
    with pytest.raises(ValueError, match="hidden_size=64"):
        layers["plain"].auto_route(torch.randn(5, 32, dtype=bf))


def test_reference_gate_errors_name_the_caller_s_tensors():
    bf = torch.bfloat16
    with pytest.raises(ValueError, match="x has D=32 columns but w_gate"):
        twell_gate(torch.randn(4, 32, dtype=bf), torch.randn(256, 64, dtype=bf))
    with pytest.raises(ValueError, match="H=0 .w_gate's rows"):
        twell_gate(torch.randn(4, 64, dtype=bf), torch.randn(0, 64, dtype=bf))
    with pytest.raises(TypeError, match="x: expected bfloat16"):
        hybrid_gated_ffn(torch.randn(4, 64), *(torch.randn(256, 64, dtype=bf) for _ in range(3)))
    x, w = torch.randn(4, 64, dtype=bf), torch.randn(256, 64, dtype=bf)
    for name in ("w_up", "w_down_t"):  # an H other than w_gate's is refused up front, by its own name
        ws = {"w_up": w, "w_down_t": w, name: torch.randn(200, 64, dtype=bf)}
        with pytest.raises(ValueError, match=rf"^{name}: expected bfloat16 \[256, 64\]"):
            hybrid_gated_ffn(x, w, ws["w_up"], ws["w_down_t"])


def test_auto_does_not_decide_on_an_empty_batch():
    """The activity threshold is measured once, on the first kernel call: an empty batch (M = 0) has
    no activity to measure, so the decision waits for a call with tokens."""
    from twell.nn import SparseFFN
    from twell import reference

    ffn = SparseFFN(128, 256).bfloat16()
    wg = ffn.gate_proj.weight.detach()
    ffn._measure_activity(reference.twell_gate(torch.zeros(0, 128, dtype=torch.bfloat16), wg))
    assert ffn._auto_dense is None and ffn.auto_note is None
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    ffn._measure_activity(reference.twell_gate(x, wg))  # random weights: about half active
    assert ffn._auto_dense is True and "dense from the next call on" in ffn.auto_note


def test_explicit_sparse_path_raises_once_the_activation_is_not_relu():
    """The path setter refuses a sparse path for a SiLU layer; a layer whose activation is changed
    after its path was set must not run the ReLU sparse path on it, nor turn dense silently: it raises."""
    from twell.nn import SparseFFN

    ffn = SparseFFN(64, 128).bfloat16()
    ffn.path = "reference"
    ffn.activation = "silu"
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with torch.no_grad(), pytest.raises(ValueError, match="needs activation='relu'.*'silu'"):
        ffn(x)
    ffn.path = "auto"  # "auto" runs it dense, and says why
    with torch.no_grad():
        out = ffn(x)
        g, u = ffn.gate_proj(x), ffn.up_proj(x)
        expect = ffn.down_proj(torch.nn.functional.silu(g) * u)
    assert ffn.last_path == "dense" and torch.equal(out, expect) and "silu" in ffn.auto_note
