"""The sparse training FFN on the CUDA kernels: forward and backward of the ReLU-gated FFN that skip
the inactive neurons, with the signature of :func:`twell.reference.training.train_gated_ffn`.

Forward: the gate GEMM (cuBLAS), then ``train_compact`` keeps each row's active neurons (column,
relu(g)) in ``slots`` per row; rows with more are *heavy*. Light rows run the row kernel (the up
projection at their active neurons, the down projection from them); heavy rows run dense GEMMs on
just those rows. The forward also sorts the light rows' entries by neuron (rows ascending within
each) for the backward. Backward: the row kernel gives dx and the per-entry gradients du and dg; the
column kernel writes the three weight gradients from the sorted entries (long neurons split in
chunks, summed in order); heavy rows recompute their gate and up values and go through dense GEMMs.
Nothing is ever dropped: every row is light or heavy, whatever the pattern, and both passes are
deterministic. The forward does not wait for the GPU: heavy rows take the dense tensor-core path,
which reads their count on the device, and the sizes the backward needs (heavy rows, the work list's
lengths) reach the host by an asynchronous copy; the backward waits on an event at the end of the
forward, which in a model has usually passed (layers whose D is not a multiple of 64 read the
heavy-row count back in the forward). Both
passes run as one C++ call each (``csrc/bindings.cpp``), which keeps the host's share of a call small.

Two custom ops (``twell::train_ffn_fwd``, ``twell::train_ffn_bwd``) with fake implementations carry
the work, so ``torch.compile`` traces a layer without a graph break; an autograd Function ties them.
Design and measurements: docs/training_kernels.md.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from twell.kernels.build import load
from twell.reference.gates import kernel_gate_unsupported
from twell.reference.training import TRAIN_MAX_D, TRAIN_SLOTS, check_hot, check_hot_values, check_train_args

# Entries of one work item of the weight-gradient kernel: a neuron active on more rows is split in
# chunks of this many rows, summed in chunk order (bounds one block's work; fp32 partials).
COLUMN_CHUNK = 512
# Slices of D the weight-gradient kernel walks one after another, so that the rows of x and dy it gathers
# stay in L2; 0: the fewest whose columns of x and dy fit in half of the L2 (csrc/twell_train.cu). A setting
# for measurements and tests, read at each backward.
COLUMN_PARTS = 0


def _train_fwd_eager(x, w_gate, w_up, w_down, slots, sizes_host=None):
    return load().train_forward(x, w_gate, w_up, w_down, slots, COLUMN_CHUNK, sizes_host)


def _train_bwd_eager(*args):
    return load().train_backward(*args)


@torch.library.custom_op("twell::train_ffn_fwd", mutates_args=())
def _train_fwd(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, slots: int) -> list[Tensor]:
    """out, l1 per row, nnz, neuron_active, and what the backward reads: idx, val, u, h (the light rows'
    entries), heavy rows (int32, ascending, padded with -1), the weight-gradient work list (entries,
    items, long neurons), its sizes as int64 [4] on the device (heavy rows, items, partials, long
    neurons: the backward op reads them, one host sync there) and W_down transposed."""
    return _train_fwd_eager(x, w_gate, w_up, w_down, slots)


@_train_fwd.register_fake
def _(x, w_gate, w_up, w_down, slots):
    M, D, H = x.shape[0], x.shape[1], w_gate.shape[0]
    n = M * slots
    max_items = H + (n + COLUMN_CHUNK - 1) // COLUMN_CHUNK
    max_long = max(1, min(H, (n + COLUMN_CHUNK - 1) // COLUMN_CHUNK))
    e = x.new_empty
    i32 = torch.int32
    return [e((M, D)), e((M,), dtype=torch.float32), e((M,), dtype=i32), e((H,), dtype=torch.bool),
            e((M, slots), dtype=i32), e((M, slots)), e((M, slots)), e((M, slots)), e((M,), dtype=i32),
            e((max(n, 1),), dtype=i32), e((4, max_items), dtype=i32), e((3, max_long), dtype=i32),
            e((4,), dtype=torch.int64), e((H, D))]


@torch.library.custom_op("twell::train_ffn_bwd", mutates_args=())
def _train_bwd(d_out: Tensor, l1_grad: Optional[Tensor], x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
               w_down_t: Tensor, idx: Tensor, val: Tensor, u: Tensor, h: Tensor, nnz: Tensor, heavy: Tensor,
               ent: Tensor, items: Tensor, longs: Tensor, sizes: Tensor, slots: int, column_parts: int
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dx, d_gate, d_up, d_down = _train_bwd_eager(d_out, l1_grad, x, w_gate, w_up, w_down, w_down_t, idx, val, u, h,
                                                nnz, heavy, ent, items, longs, sizes, slots, column_parts)
    return dx, d_gate, d_up, d_down


@_train_bwd.register_fake
def _(d_out, l1_grad, x, w_gate, w_up, w_down, w_down_t, idx, val, u, h, nnz, heavy, ent, items, longs, sizes,
      slots, column_parts):
    return (torch.empty_like(x), torch.empty_like(w_gate), torch.empty_like(w_up), torch.empty_like(w_down))


def _cold_forward(ctx, x, w_gate, w_up, w_down, slots):
    """The kernels' forward: (out, l1, nnz, neuron_active, tensors the backward reads); the sizes' copy and
    its event on ctx."""
    # Eager calls skip the custom op's dispatch (~0.1 ms of host time a call); compiled code traces the op.
    ctx.sizes_host = ctx.sizes_ready = None
    if torch.compiler.is_compiling():
        out, row_l1, nnz, act, *saved = _train_fwd(x, w_gate, w_up, w_down, slots)
    else:
        # The backward's sizes come back by an asynchronous copy; the event marks the end of this
        # forward, which the backward waits for (in a model it has long finished).
        ctx.sizes_host = torch.empty(4, dtype=torch.int64, pin_memory=True)
        out, row_l1, nnz, act, *saved = _train_fwd_eager(x, w_gate, w_up, w_down, slots, ctx.sizes_host)
        ctx.sizes_ready = torch.cuda.Event()
        ctx.sizes_ready.record(torch.cuda.current_stream(x.device))
    return out, row_l1.sum() / max(1, x.shape[0]), nnz, act, saved


def _cold_backward(ctx, d_out, d_l1, x, w_gate, w_up, w_down, nnz, saved):
    """The kernels' backward: (dx, d_gate, d_up, d_down)."""
    idx, val, u, h, heavy, ent, items, longs, sizes, w_down_t = saved
    l1_grad = None if d_l1 is None else (d_l1.float() / max(1, x.shape[0])).reshape(1)
    args = (d_out, l1_grad, x, w_gate, w_up, w_down, w_down_t, idx, val, u, h, nnz, heavy, ent, items, longs)
    if torch.compiler.is_compiling() or ctx.sizes_host is None:
        return _train_bwd(*args, sizes, ctx.slots, COLUMN_PARTS)
    # The light rows' kernel needs no sizes: queued before the wait, it keeps the GPU busy while
    # the host waits for the forward's end and then queues the rest.
    rows_done = load().train_rows_backward(d_out, idx, val, u, h, nnz, w_down_t, w_up, w_gate, l1_grad, ctx.slots)
    ctx.sizes_ready.synchronize()
    return _train_bwd_eager(*args, ctx.sizes_host, ctx.slots, COLUMN_PARTS, rows_done)


def _no_double_backward():
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError("train_gated_ffn has no double backward (create_graph=True): its backward is "
                           "not differentiable")


class _TrainGatedFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, slots):
        out, l1, nnz, act, saved = _cold_forward(ctx, x, w_gate, w_up, w_down, slots)
        ctx.save_for_backward(x, w_gate, w_up, w_down, nnz, *saved)
        ctx.slots = slots
        ctx.mark_non_differentiable(nnz, act)
        return out, l1, nnz, act

    @staticmethod
    def backward(ctx, d_out, d_l1, _nnz, _act):
        _no_double_backward()
        x, w_gate, w_up, w_down, nnz, *saved = ctx.saved_tensors
        d_out = torch.zeros_like(x) if d_out is None else d_out.contiguous()
        dx, d_gate, d_up, d_down = _cold_backward(ctx, d_out, d_l1, x, w_gate, w_up, w_down, nnz, saved)
        return dx, d_gate, d_up, d_down, None


def _reference_cold_forward(ctx, x, w_gate, w_up, w_down, slots):
    from twell.reference.training import train_gated_ffn as reference

    with torch.no_grad():
        out, l1, nnz, act = reference(x, w_gate, w_up, w_down, slots)
    return out, l1, nnz, act, []


def _reference_cold_backward(ctx, d_out, d_l1, x, w_gate, w_up, w_down, nnz, saved):
    from twell.reference.training import train_gated_ffn as reference

    leaves = [t.detach().requires_grad_(True) for t in (x, w_gate, w_up, w_down)]
    with torch.enable_grad():
        out, l1, _, _ = reference(*leaves, ctx.slots)
        outs, grads = [out], [d_out]
        if d_l1 is not None:
            outs.append(l1)
            grads.append(d_l1)
        return torch.autograd.grad(outs, leaves, grads)


_COLD = {"kernel": (_cold_forward, _cold_backward), "reference": (_reference_cold_forward, _reference_cold_backward)}


class _HotSplitFFN(torch.autograd.Function):
    """The training FFN with the ``hot`` neurons as dense columns over every row and the rest on the pair
    kernels ("cold"): the cold pass sees W_gate with the hot rows zeroed, so those neurons are inactive there
    (relu(0) = 0) and every (row, neuron) pair is computed exactly once. The hot part is two GEMMs forward
    ([W_gate; W_up] at the hot rows in one, then an addmm into the cold output) and four backward over [M, K];
    its weight gradients overwrite the hot rows of the cold pass's (zero there). The zeroed W_gate is made again
    in the backward rather than kept (H x D per layer)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, hot, slots, cold):
        fwd, _ = _COLD[cold]
        ctx.slots, ctx.cold = slots, cold
        K = hot.shape[0]
        w_cold = w_gate.index_fill(0, hot, 0)
        out, l1, nnz_cold, act, saved = fwd(ctx, x, w_cold, w_up, w_down, slots)
        w_gu = torch.cat([w_gate.index_select(0, hot), w_up.index_select(0, hot)])  # [2K, D]
        w_dh = w_down.index_select(1, hot)                                            # [D, K]
        gu = torch.mm(x, w_gu.t())
        g, u = gu[:, :K], gu[:, K:]
        on = ~(g <= 0)
        h = torch.relu(g) * u
        # In place in eager code (the cold pass's output is a fresh tensor, not saved); out of place when
        # compiling, where the in-place update of the custom op's output was measured lost (the hot part
        # missing from the compiled output and gradients)
        out = torch.addmm(out, h, w_dh.t()) if torch.compiler.is_compiling() else out.addmm_(h, w_dh.t())
        l1 = l1 + h.abs().sum(dtype=torch.float32) / max(1, x.shape[0])
        nnz = nnz_cold + on.sum(-1, dtype=torch.int32)
        act = act.index_copy(0, hot, on.any(0))
        # the cold pass's backward reads its own rows' counts (its entries), not the total
        ctx.save_for_backward(x, w_gate, w_up, w_down, nnz_cold, hot, w_gu, w_dh, gu, *saved)
        ctx.mark_non_differentiable(nnz, act)
        return out, l1, nnz, act

    @staticmethod
    def backward(ctx, d_out, d_l1, _nnz, _act):
        _no_double_backward()
        _, bwd = _COLD[ctx.cold]
        x, w_gate, w_up, w_down, nnz_cold, hot, w_gu, w_dh, gu, *saved = ctx.saved_tensors
        d_out = torch.zeros_like(x) if d_out is None else d_out.contiguous()
        K = hot.shape[0]
        # The hot part first: queued before the cold pass's wait for its sizes, it keeps the GPU busy meanwhile.
        g, u = gu[:, :K], gu[:, K:]
        gr = torch.relu(g)
        h = gr * u
        ds = torch.mm(d_out, w_dh)
        if d_l1 is not None:  # d(mean over rows of sum |h|) / dh, rounded to bf16 as the cold pass's
            ds = ds + torch.sign(h) * (d_l1.float() / max(1, x.shape[0])).to(ds.dtype)
        d_gu = torch.cat([torch.where(g > 0, ds * u, torch.zeros((), dtype=ds.dtype, device=ds.device)),
                          ds * gr], 1)
        dw = torch.mm(d_gu.t(), x)
        dwd = torch.mm(d_out.t(), h)
        dx_hot = torch.mm(d_gu, w_gu)
        w_cold = w_gate.index_fill(0, hot, 0)  # what the cold pass's forward saw (its heavy rows recompute with it)
        dx, d_gate, d_up, d_down = bwd(ctx, d_out, d_l1, x, w_cold, w_up, w_down, nnz_cold, saved)
        del w_cold
        # the cold pass's gradients are fresh tensors, zero at the hot rows, which are overwritten: in place in
        # eager code, out of place when compiling (as in the forward)
        if torch.compiler.is_compiling():
            dx = dx + dx_hot
            d_gate = d_gate.index_copy(0, hot, dw[:K])
            d_up = d_up.index_copy(0, hot, dw[K:])
            d_down = d_down.index_copy(1, hot, dwd)
        else:
            dx.add_(dx_hot)
            d_gate.index_copy_(0, hot, dw[:K])
            d_up.index_copy_(0, hot, dw[K:])
            d_down.index_copy_(1, hot, dwd)
        return dx, d_gate, d_up, d_down, None, None, None


def train_gated_ffn(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, slots: int = TRAIN_SLOTS, *,
                    threshold: float = 0.0, up_relu: bool = False, hot: Optional[Tensor] = None
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Differentiable sparse gated FFN for training on the CUDA kernels:
    ``(out bf16 [M, D], l1 fp32 0-dim = mean over rows of sum |h|, nnz int32 [M], neuron_active bool [H])``.

    x bf16 [M, D]; w_gate, w_up bf16 [H, D]; w_down bf16 [D, H] (nn.Linear layouts). Exact for any
    activation pattern (rows with more than ``slots`` active neurons run dense). ReLU gates only:
    ``threshold`` (FATReLU) and ``up_relu`` (dReLU) other than their defaults raise a ValueError
    (twell.reference.training.train_gated_ffn computes them).

    ``hot`` (:func:`twell.reference.training.choose_hot`, int64 increasing indices on x's device): neurons
    computed as dense columns over every row (tensor cores) instead of pair by pair; the rest take the
    kernels. The result is the same computation either way. Whether it is faster depends on the layer: on
    trained layers whose activity is concentrated it was, where the plain op was slow; on the sparsest layers and
    on the generator's inputs it was slower (docs/training_kernels.md, "Hot neurons"), so the choice is timed per
    layer (twell.train.calibration.time_layer). In eager code the values are checked once per set
    (check_hot_values: duplicates would count a neuron twice, an index past H fault); compiled code does not
    read them."""
    if threshold or up_relu:
        raise ValueError(kernel_gate_unsupported(threshold, up_relu))
    check_train_args(x, w_gate, w_up, w_down, slots)
    check_hot(hot, w_gate.shape[0], x.device)
    if not x.is_cuda:
        raise ValueError(f"the training kernels run on CUDA tensors; x is on {x.device} "
                         "(twell.reference.training.train_gated_ffn runs anywhere)")
    if x.shape[1] % 8 or x.shape[1] > TRAIN_MAX_D:
        raise ValueError(f"the training kernels need D to be a multiple of 8 and at most {TRAIN_MAX_D}, "
                         f"got D={x.shape[1]}")
    if hot is not None and hot.numel():
        if not torch.compiler.is_compiling():
            check_hot_values(hot, w_gate.shape[0])
        return _HotSplitFFN.apply(x, w_gate, w_up, w_down, hot, slots, "kernel")
    return _TrainGatedFFN.apply(x, w_gate, w_up, w_down, slots)
