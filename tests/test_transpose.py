"""SparseFFN's cached W_down transpose (twell.nn.transpose): refreshed exactly when the weight changed,
in eager and compiled code. The kernels' compiled-module tests (test_kernels.py) run it on the GPU."""
import pytest
import torch
from torch import nn

from twell.nn import SparseFFN
from twell.nn.transpose import new_transpose_, refresh_transpose, refresh_transpose_


def layer(D=64, H=256):
    torch.manual_seed(0)
    return SparseFFN(D, H, path="reference").to(torch.bfloat16).requires_grad_(False)


def test_the_copy_is_made_once_and_refreshed_when_the_weight_changes():
    ffn = layer()
    w = ffn.down_proj.weight
    t = ffn.w_down_t()
    assert torch.equal(t, w.t()) and t.is_contiguous()
    t.fill_(float("nan"))  # a copy made on a call that did not need one would overwrite this
    assert ffn.w_down_t() is t and t.isnan().all()
    w.mul_(2)  # in place: bumps the version
    assert ffn.w_down_t() is t and torch.equal(t, w.t())
    ffn.down_proj.weight = nn.Parameter(torch.randn_like(w), requires_grad=False)  # another storage
    assert torch.equal(ffn.w_down_t(), ffn.down_proj.weight.t())
    ffn.down_proj.weight.data.copy_(torch.randn_like(w))  # through .data: no version bump, documented
    ffn.invalidate_cache()
    assert torch.equal(ffn.w_down_t(), ffn.down_proj.weight.t())


def test_a_new_weight_at_an_old_weights_address_and_version_is_not_mistaken_for_it():
    """The old cache key (address, version) took a new weight that sat where the cached one had been, at
    the same version, for the old one. Two tensors over one bytearray make that case without relying
    on the allocator: same address, both at version 0, contents changed behind torch's back."""
    ffn = layer()
    memory = bytearray(64 * 256 * 2)

    def weight_over_memory(seed):
        values = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        memory[:] = values.view(torch.uint8).flatten().numpy().tobytes()  # in place: same address
        w = torch.frombuffer(memory, dtype=torch.bfloat16).view(64, 256)
        return nn.Parameter(w, requires_grad=False), values

    ffn.down_proj.weight, first = weight_over_memory(1)
    assert torch.equal(ffn.w_down_t(), first.t())
    ptr = ffn.down_proj.weight.data_ptr()
    ffn.down_proj.weight, second = weight_over_memory(2)
    assert ffn.down_proj.weight.data_ptr() == ptr and ffn.down_proj.weight._version == 0
    assert torch.equal(ffn.w_down_t(), second.t())


def test_training_forwards_mark_the_copy_stale():
    """A fused optimizer step after a training forward does not bump W_down's version, so the forward
    marks the copy stale (the tensor stays: compiled graphs that read it stay valid)."""
    from twell.nn.transpose import holds

    ffn = layer().requires_grad_(True)
    with torch.no_grad():
        t = ffn.w_down_t()
    ffn(torch.randn(4, 64).to(torch.bfloat16))  # autograd recording
    assert ffn._w_down_t is t and not holds(t, ffn.down_proj.weight)


def test_a_copy_made_in_inference_mode_is_replaced_outside_it():
    """An inference tensor takes no in-place write outside inference_mode: such a copy is replaced."""
    ffn = layer()
    with torch.inference_mode():
        ffn.w_down_t()
    with torch.no_grad():
        ffn.down_proj.weight.mul_(2)
        assert torch.equal(ffn.w_down_t(), ffn.down_proj.weight.t())
    with torch.inference_mode():
        ffn.down_proj.weight.mul_(2)
        assert torch.equal(ffn.w_down_t(), ffn.down_proj.weight.t())


def test_compiled_code_is_one_graph_and_sees_in_place_updates():
    """The staleness check runs inside the compiled graph (an opaque op), so fullgraph compiles and an
    in-place weight update after compilation is still seen, with no recompilation."""
    from torch._dynamo.utils import counters

    ffn = layer()
    h = torch.randn(5, 256).to(torch.bfloat16)
    with torch.no_grad():
        ffn.w_down_t()  # the copy exists (see the next test for a layer compiled before that)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda h: h @ ffn.w_down_t(), fullgraph=True, dynamic=True)
    try:
        with torch.no_grad():
            for m in (5, 3):
                hm = h[:m].clone()  # not a view: views of h guard on their base
                assert torch.equal(compiled(hm), hm @ ffn.down_proj.weight.t())
            ffn.down_proj.weight.mul_(-3)
            assert torch.equal(compiled(h), h @ ffn.down_proj.weight.t())
            ffn.down_proj.weight.data.mul_(2)  # not seen without invalidate_cache (documented)
            ffn.invalidate_cache()
            assert torch.equal(compiled(h), h @ ffn.down_proj.weight.t())
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        torch._dynamo.reset()


class Layers(nn.Module):
    """A loop over layers, as transformers' models run them (a graph break inside such a loop sends
    dynamo back to eager for the whole forward)."""

    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList(layer() for _ in range(n))

    def forward(self, h):
        return torch.cat([h @ f.w_down_t() for f in self.layers])


def test_a_model_compiled_before_any_eager_call_is_one_graph_and_makes_its_copies_once():
    """With no copy yet, compiled code makes it through an op (memory made by a graph's own code would
    belong to the graph); fullgraph holds in a loop over layers. The layers' copies recompile the graph
    once, not once per layer, and invalidating layers one at a time recompiles nothing."""
    from torch._dynamo.utils import counters

    model = Layers(3)
    h = torch.randn(5, 256).to(torch.bfloat16)
    expect = lambda: torch.cat([h @ f.down_proj.weight.t() for f in model.layers])
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True)
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(compiled(h), expect())
            copies = [f._w_down_t for f in model.layers]
            assert all(t is not None for t in copies)
            model.layers[1].down_proj.weight.mul_(2)
            assert torch.equal(compiled(h), expect())
            assert all(f._w_down_t is t for f, t in zip(model.layers, copies))  # refreshed in place
            graphs = counters["stats"]["unique_graphs"]
            for f in model.layers:  # one layer at a time, as after writes through .data: no recompile
                f.down_proj.weight.data.mul_(-1)
                f.invalidate_cache()
                assert torch.equal(compiled(h), expect())
            assert counters["stats"]["unique_graphs"] == graphs <= 2, dict(counters["stats"])
            model.float()  # a conversion drops the copies: one recompile makes new ones
            hf = h.float()  # fp32 matmuls: compiled and eager may block the sums differently
            expect_fp32 = torch.cat([hf @ f.down_proj.weight.t() for f in model.layers])
            torch.testing.assert_close(compiled(hf), expect_fp32)
            assert all(f._w_down_t.dtype == torch.float32 for f in model.layers)
        assert not counters["graph_break"]
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("backend", [None, "inductor", "aot_eager"])
def test_the_copy_follows_a_fused_adamw_step_and_data_writes(backend):
    """A training step with fused AdamW (the training loop's optimizer on CUDA; it does not bump the
    weight's version) between two evals, eager or compiled, then a ``.data`` write with
    invalidate_cache(): the sparse path follows the weights each time. A compiled step drops the copy
    rather than marking it stale: aot_eager hands ops clones, and would have marked a clone."""
    torch.manual_seed(0)
    ffn = SparseFFN(64, 300, path="reference").to(torch.bfloat16)
    x = torch.randn(8, 64).to(torch.bfloat16)

    def sparse_vs_dense():
        with torch.no_grad():
            ffn.path = "reference"
            out = ffn(x).float()
            assert ffn.last_path == "twell-reference"
            ffn.path = "dense"
            ref = ffn(x).float()
            return ((out - ref).norm() / ref.norm()).item()

    assert sparse_vs_dense() < 1e-2  # makes the copy
    opt = torch.optim.AdamW(ffn.parameters(), lr=0.05, fused=True)
    loss = lambda x: ffn(x).float().pow(2).sum()  # a training forward: the parameters require grad
    torch._dynamo.reset()
    try:
        (loss if backend is None else torch.compile(loss, backend=backend))(x).backward()
        opt.step()  # leaves the weight's version as it was (torch 2.11-2.13)
    finally:
        torch._dynamo.reset()
    assert sparse_vs_dense() < 1e-2
    ffn.down_proj.weight.data.copy_(torch.randn_like(ffn.down_proj.weight))
    ffn.invalidate_cache()
    assert sparse_vs_dense() < 1e-2


def test_moving_a_layer_where_it_already_is_keeps_its_copy():
    """A no-op move (``layer.to`` its own device) keeps the copy, so compiled graphs do not recompile;
    a conversion to another dtype drops it (freed at once, not at the next call)."""
    from torch._dynamo.utils import counters

    model = Layers(4)
    h = torch.randn(5, 256).to(torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True)
    try:
        with torch.no_grad():
            compiled(h)
            compiled(h)
            graphs = counters["stats"]["unique_graphs"]
            for f in model.layers:
                t = f._w_down_t
                f.to("cpu")
                assert f._w_down_t is t
                assert torch.equal(compiled(h), torch.cat([h @ g.down_proj.weight.t() for g in model.layers]))
            assert counters["stats"]["unique_graphs"] == graphs
            model.layers[0].float()
            assert model.layers[0]._w_down_t is None
    finally:
        torch._dynamo.reset()


def test_a_layer_built_under_inference_mode_follows_in_place_writes():
    """Inference tensors have no version counter, so their copy is made again on every call."""
    with torch.inference_mode():
        ffn = layer()
        first = ffn.w_down_t().clone()
        ffn.down_proj.weight.mul_(2)
        assert torch.equal(ffn.w_down_t(), 2 * first)


def test_a_module_with_its_copy_saves_loads_and_deep_copies():
    """The copy's bookkeeping lives outside the tensor, so torch.save(module) works; a loaded or
    deep-copied module makes its own copy on first use. Not a buffer: DDP would broadcast it."""
    import copy
    import io

    ffn = layer()
    ffn.w_down_t()
    assert "_w_down_t" not in dict(ffn.named_buffers()) and "_w_down_t" not in ffn.state_dict()
    buf = io.BytesIO()
    torch.save(ffn, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded.down_proj.weight.mul_(3)
    assert torch.equal(loaded.w_down_t(), loaded.down_proj.weight.t())
    twin = copy.deepcopy(ffn)
    twin.down_proj.weight.mul_(-1)
    assert torch.equal(twin.w_down_t(), twin.down_proj.weight.t())
    assert torch.equal(ffn.w_down_t(), ffn.down_proj.weight.t())


def test_bookkeeping_leaves_with_the_copies():
    from twell.nn import transpose

    ffn = layer()
    key = id(ffn.w_down_t())
    assert key in transpose._HELD
    ffn.float()  # drops the copy, its only reference
    assert key not in transpose._HELD


def test_refresh_refuses_a_wrong_shaped_copy():
    w = torch.randn(4, 6)
    for refresh in (refresh_transpose, refresh_transpose_):
        with pytest.raises(ValueError, match=r"\[6, 4\]"):
            refresh(w, torch.empty(4, 6))
        with pytest.raises(ValueError, match="float32"):
            refresh(w, torch.empty(6, 4, dtype=torch.bfloat16))


def test_the_ops_pass_opcheck():
    w, out = torch.randn(4, 6), torch.empty(6, 4)
    torch.library.opcheck(refresh_transpose_, (w, out))
    torch.library.opcheck(new_transpose_, (w,))
    assert torch.equal(new_transpose_(w), w.t())
