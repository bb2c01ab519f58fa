"""A weight's transpose kept in a tensor that is refreshed in place, from eager and compiled code.

The fused kernels read W_down as [H, D] (one contiguous row per neuron); nn.Linear stores it [D, H].
At the paper's shapes a transposed copy is 23 MB per layer, too much to redo on every call, so
``SparseFFN`` keeps one. Whether it is still valid depends on the weight's storage and version counter,
which dynamo cannot trace: checked in Python, it broke a compiled module's graph (and a graph
break inside a loop over layers sends dynamo back to eager for the whole forward). Compiled code therefore
makes and checks the copy through two opaque custom ops that run at run time inside the graph:
``new_transpose_`` and ``refresh_transpose_`` (inductor calls the latter on the cached tensor itself;
backends that functionalize without reinplacing hand it a clone, and then it copies every call:
slower, still right). Eager code calls the same Python functions directly (an op's dispatch costs
~20 us on the host).

Both ops are tagged ``cudagraph_unsafe``: CUDA-graph trees (``mode="reduce-overhead"``) run them at
every call instead of freezing one decision into a replay, and memory the new copy takes comes from
the ordinary allocator, not from a graph's pool (whose outputs a later replay overwrites); with
inductor's graph partitions the rest of the graph is still captured.
"""
from __future__ import annotations

import weakref

import torch

# id(copy) -> what it holds: (weakref to the weight's storage, weight_state(weight)), or None when not
# current. Kept here, not on the tensor: a weakref in a tensor's __dict__ breaks torch.save(module).
# A finalizer removes each entry with its tensor, so a reused id never finds one.
_HELD: dict[int, object] = {}


def weight_state(w: torch.Tensor) -> tuple:
    """What changes when ``w`` is rewritten or replaced: address, layout and version (not for inference
    tensors, which have no version counter)."""
    # Beside the storage object itself (torch keeps one Python object per storage; an address alone can
    # come back for another tensor at the same version), the address too, for what it is worth: a
    # storage resized to nothing and back keeps its object and version, and is caught only where the
    # allocator gives it another address.
    return (w.data_ptr(), w.storage_offset(), tuple(w.shape), tuple(w.stride()), w._version)


def _set_held(out: torch.Tensor, src) -> None:
    key = id(out)
    if key not in _HELD:
        weakref.finalize(out, _HELD.pop, key, None)
    _HELD[key] = src


def forget(out: torch.Tensor) -> None:
    """Mark ``out`` as not current: its next refresh copies. The tensor stays (a compiled graph that
    reads it keeps its guards). Eager code only: a compiled graph may hand an op a clone, and marking a
    clone would leave the real copy trusted."""
    _set_held(out, None)


def holds(out: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``out`` holds ``w.t()`` for the current storage and version of ``w`` (a host-side check)."""
    src = _HELD.get(id(out))
    if src is None or w.is_inference() or src[0]() is not w.untyped_storage():
        # An inference tensor has no version counter: in-place writes to it cannot be seen, so a copy
        # of one is never trusted (it is made again on every call).
        return False
    return src[1] == weight_state(w)


def _transposed_shape(w: torch.Tensor, who: str) -> tuple[int, int]:
    if w.dim() != 2:
        raise ValueError(f"{who}: expected a 2-d weight, got shape {tuple(w.shape)}")
    return w.shape[1], w.shape[0]


def _check(w: torch.Tensor, out: torch.Tensor) -> None:
    if (w.dim() != 2 or out.shape != (w.shape[1], w.shape[0]) or out.dtype != w.dtype
            or out.device != w.device):
        want = f"[{w.shape[1]}, {w.shape[0]}]" if w.dim() == 2 else "[?, ?]"
        raise ValueError(f"refresh_transpose: out must be a {w.dtype} {want} tensor on {w.device} for a 2-d "
                         f"weight {tuple(w.shape)}; got {out.dtype} {tuple(out.shape)} on {out.device}")


def refresh_transpose(w: torch.Tensor, out: torch.Tensor) -> None:
    """Make ``out`` hold ``w.t()`` unless it already does for this storage and version of ``w``.

    In-place writes bump the version and are seen; writes through ``w.data`` are not (they bump
    another counter), so after those the owner must forget the copy (``SparseFFN.invalidate_cache``).
    In a CUDA-graph capture a needed copy is recorded (it runs at each replay) but not trusted
    afterwards, since the capture itself does not run it."""
    _check(w, out)
    if holds(out, w):
        return
    out.copy_(w.detach().t())
    capturing = out.is_cuda and torch.cuda.is_current_stream_capturing()
    _set_held(out, None if capturing or w.is_inference() else (weakref.ref(w.untyped_storage()), weight_state(w)))


def new_transpose(w: torch.Tensor) -> torch.Tensor:
    """A new contiguous ``w.t()`` that :func:`refresh_transpose` knows to hold ``w``. Its address is
    marked static for CUDA-graph trees (no copy into a graph-owned input at each replay)."""
    out = torch.empty(_transposed_shape(w, "new_transpose"), dtype=w.dtype, device=w.device)
    refresh_transpose(w, out)
    torch._dynamo.mark_static_address(out, guard=False)  # a new address makes the trees re-record
    return out


_OPS_TAGS = (torch.Tag.cudagraph_unsafe,)


@torch.library.custom_op("twell::refresh_transpose_", mutates_args=("out",), tags=_OPS_TAGS)
def refresh_transpose_(w: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`refresh_transpose` as an op that compiled graphs keep (and run at run time)."""
    refresh_transpose(w, out)


@refresh_transpose_.register_fake
def _(w, out):
    return None


@torch.library.custom_op("twell::new_transpose", mutates_args=(), tags=_OPS_TAGS)
def new_transpose_(w: torch.Tensor) -> torch.Tensor:
    """:func:`new_transpose` as an op that compiled graphs keep (and run at run time)."""
    return new_transpose(w)


@new_transpose_.register_fake
def _(w):
    return w.new_empty(_transposed_shape(w, "new_transpose"))
