"""torch.library ops around the CUDA kernels, with the signatures of ``twell.reference``.

Three custom ops carry the work (fake implementations registered, so ``torch.compile`` and CUDA
graphs can trace them without running them):

- ``twell::gate(x, w_gate, tile, compression, gate_cluster) -> (packed, spill)`` : TwELL words from the
  gate GEMM epilogue, and its spill area (entries of tile rows that overflowed their slots)
- ``twell::ffn(x, packed, spill?, w_act?, w_up?, w_down_t, tile, compression, union_ratio, union_base,
  dense_cap?) -> out`` : fused up/down
- ``twell::sparse_ffn(x, w_gate, w_up, w_down_t, tile, compression, union_ratio, union_base, dense_cap?,
  gate_cluster) -> out`` : both in one call, the fused kernel overlapping the gate kernel's tail

Every setting is an argument (block-union rule, dense-path capacity, gate cluster size), defaulting
to the constants of ``twell.reference.ffn``; nothing is read from the environment. The spill area's
size comes from :func:`spill_capacity` alone: the ops pass it to the extension, which allocates what
it is given, and the fake implementations size their outputs with it.

The public functions validate inputs with readable errors (shared with the reference), then call
the ops. A TwELL from :func:`twell_gate` carries the gate kernel's spill area (the entries of tile rows that
overflowed their slots) and remembers ``(x, w_gate)``, so the fused kernel reads every nonzero and,
should the spill area be full, recomputes the remaining tiles itself (exact for any activation
pattern, no host synchronisation). A TwELL packed
elsewhere (``pack_twell``) has its dense backup instead: the kernel skips those rows and they are
computed densely from the backup right after, in the same call.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from twell.formats import TwELL, check_tensor, check_tiling
from twell.formats.twell import columns_limit
from twell.kernels.build import available, load
from twell.reference.decode import DECODE_MAX_H, check_decode_args
from twell.reference.gates import check_gate_settings
from twell.reference.gates import kernel_gate_unsupported as gate_unsupported
from twell.reference.ffn import (
    DENSE_CAP, GATE_CLUSTER, SPARSE_FFN_COMPRESSION, UNION_OFF, UNION_RULE, check_dense_cap, check_ffn_args,
    check_gate_args, check_gate_cluster, check_union_rule,
)


# The kernels' shape limits, once: the ops raise them, layer_unsupported reports them.
def _width_limit(D: int) -> str:
    return f"the TwELL kernels need D to be a positive multiple of 64, got D={D}" if D % 64 or D <= 0 else ""


FFN_MAX_D = 8192  # csrc/twell_kernels.h kFfnMaxD: rows wider than 2048 take the wide (panelled) kernels


def _fused_limit(D: int) -> str:
    return _width_limit(D) or (f"the fused TwELL kernels support D <= {FFN_MAX_D}, got D={D}" if D > FFN_MAX_D else "")


def _tile_limit(tile: int) -> str:
    return "" if tile in (64, 128, 256) else f"the gate kernel supports tile widths 64, 128 and 256, got {tile}"


def _raise_if(why: str) -> None:
    if why:
        raise ValueError(why)


def _kernel_checks(x: Tensor) -> None:
    if not x.is_cuda:
        raise ValueError(f"the TwELL kernels run on CUDA tensors; x is on {x.device} (use twell.reference on CPU)")
    _raise_if(_width_limit(x.shape[1]))


def misaligned(t: Optional[Tensor]) -> bool:
    """Whether the kernels cannot read t where it starts: they load rows with 16-byte vectors and TMA,
    which fault on a misaligned start (a contiguous view at an element offset, e.g.
    ``buf[1:].view(M, D)``) and lose the CUDA context. ``None`` and empty tensors (never read) pass.
    Always False under torch.compile (no addresses while tracing): the extension's own check raises
    at run time."""
    return (t is not None and not torch.compiler.is_compiling() and t.numel() > 0
            and t.data_ptr() % 16 != 0)


def check_aligned(**tensors: Optional[Tensor]) -> None:
    """Refuse any tensor the kernels cannot read where it starts (:func:`misaligned`) with a readable
    error, instead of a fault."""
    for name, t in tensors.items():
        if misaligned(t):
            raise ValueError(f"{name} must start at a 16-byte aligned address for the TwELL kernels; it starts "
                             f"{t.data_ptr() % 16} bytes past one (a view at an element offset?): pass "
                             f"{name}.clone()")


def spill_capacity(M: int) -> int:
    """Words of the gate kernel's spill area for M rows: room for about 1% of rows fully dense (past it,
    tiles keep their true counts and the fused kernel recomputes them exactly). The one formula: the
    ops pass it to the extension (``spill_cap``), and the gate op's fake output has this size plus one
    word (the words-used counter). M may be a SymInt while tracing."""
    return torch.sym_max(1 << 20, M * 64)


def sparse_ffn_spill_words(M: int) -> int:
    """Words of the one op's internal spill block for M rows: the spill area, its counter and the gate
    kernel's ready counters (what tests poison before a call). Builds the extension."""
    return int(load().sparse_ffn_spill_words(int(M), int(spill_capacity(int(M)))))


def dense_capacity(M: int, dense_cap: Optional[int] = DENSE_CAP) -> int:
    """Rows per round that the dense path for heavy rows takes for M rows under ``dense_cap`` (``None``:
    its rule; the rule lives in the extension, csrc/bindings_dense.cpp). Builds the extension."""
    return int(load().dense_cap(int(M), check_dense_cap(dense_cap)))


@torch.library.custom_op("twell::gate", mutates_args=())
def _gate_op(x: Tensor, w_gate: Tensor, tile: int, compression: int, gate_cluster: int) -> tuple[Tensor, Tensor]:
    packed, spill = load().gate_twell(x, w_gate, tile, compression, spill_cap=spill_capacity(x.shape[0]),
                                      cluster=gate_cluster)
    return packed, spill


@_gate_op.register_fake
def _(x, w_gate, tile, compression, gate_cluster):
    n_tiles = -(-w_gate.shape[0] // tile)
    packed = x.new_empty((x.shape[0], n_tiles * (tile // compression)), dtype=torch.uint32)
    return packed, x.new_empty((spill_capacity(x.shape[0]) + 1,), dtype=torch.uint32)


@torch.library.custom_op("twell::ffn", mutates_args=())
def _ffn_op(x: Tensor, packed: Tensor, spill: Optional[Tensor], w_act: Optional[Tensor], w_up: Optional[Tensor],
            w_down_t: Tensor, tile: int, compression: int, union_ratio: float, union_base: float,
            dense_cap: Optional[int]) -> Tensor:
    return load().ffn_forward(x, packed, spill, w_act, w_up, w_down_t, tile, compression, 0, None,
                              union_ratio=union_ratio, union_base=union_base, dense_cap=dense_cap)


@_ffn_op.register_fake
def _(x, packed, spill, w_act, w_up, w_down_t, tile, compression, union_ratio, union_base, dense_cap):
    return x.new_empty((packed.shape[0], w_down_t.shape[1]))


@torch.library.custom_op("twell::sparse_ffn", mutates_args=())
def _sparse_ffn_op(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down_t: Tensor, tile: int, compression: int,
                   union_ratio: float, union_base: float, dense_cap: Optional[int], gate_cluster: int) -> Tensor:
    return load().sparse_ffn(x, w_gate, w_up, w_down_t, tile, compression, union_ratio=union_ratio,
                             union_base=union_base, dense_cap=dense_cap, spill_cap=spill_capacity(x.shape[0]),
                             cluster=gate_cluster)


@_sparse_ffn_op.register_fake
def _(x, w_gate, w_up, w_down_t, tile, compression, union_ratio, union_base, dense_cap, gate_cluster):
    return x.new_empty(x.shape)


def _gate_kernel_checks(x: Tensor, w_gate: Tensor, tile: int, compression: int) -> None:
    check_gate_args(x, w_gate, tile, compression)  # the tiling and H's range too
    _kernel_checks(x)
    _raise_if(_tile_limit(tile))
    check_aligned(x=x, w_gate=w_gate)


def layer_unsupported(D: int, H: int, tile: int = 256, compression: int = SPARSE_FFN_COMPRESSION) -> str:
    """Why the kernels cannot run a layer of width D with H hidden units at this tiling (the limits
    the ops check), or ``""`` when they can. Builds nothing."""
    try:
        check_tiling(tile, compression)
    except ValueError as exc:
        return str(exc)
    if _fused_limit(D):
        return _fused_limit(D)
    return columns_limit(H) or _tile_limit(tile)


def gate_product(g: Tensor, u: Tensor, threshold: float = 0.0, up_relu: bool = False) -> Tensor:
    """A gate variant's dense hidden state, :func:`twell.reference.gates.hidden` (the same bits), in one kernel
    where PyTorch runs two or three (compare, where, relu, mul): bf16 CUDA ``g`` and ``u`` of one shape. No
    autograd: ``SparseFFN``'s dense path takes it for inference calls only."""
    threshold, up_relu = check_gate_settings(threshold, up_relu)
    if not (g.is_cuda and g.dtype == torch.bfloat16 and u.dtype == g.dtype and u.shape == g.shape):
        raise ValueError(f"gate_product takes bf16 CUDA g and u of one shape, got {g.dtype} {tuple(g.shape)} on "
                         f"{g.device} and {u.dtype} {tuple(u.shape)}")
    return load().gate_product(g.contiguous(), u.contiguous(), threshold, up_relu)


def decode_layer_unsupported(D: int, H: int) -> str:
    """Why the decoding op cannot run a gated layer of width D with H hidden units, or ``""`` when it can
    (it takes wider layers than the other kernels: any D that is a multiple of 64). Builds nothing."""
    if D % 64 or D <= 0:
        return f"the decoding FFN needs D to be a positive multiple of 64, got D={D}"
    return "" if 1 <= H <= DECODE_MAX_H else f"the decoding FFN takes 1 to {DECODE_MAX_H} hidden units, got H={H}"


def _fused_kernel_checks(x: Tensor) -> None:
    _kernel_checks(x)
    _raise_if(_fused_limit(x.shape[1]))




def twell_gate(x: Tensor, w_gate: Tensor, tile: int = 256, compression: int = SPARSE_FFN_COMPRESSION,
               *, gate_cluster: int = GATE_CLUSTER, threshold: float = 0.0) -> TwELL:
    """TwELL of ``relu(x @ w_gate.T)`` written by the gate GEMM (x bf16 [M, D], w_gate bf16 [H, D]).

    ``gate_cluster``: CTAs per cluster of the gate kernel, 2 (``GATE_CLUSTER``: each pair shares the
    W_gate tiles by TMA multicast) or 1 (the single-CTA variant, kept for comparison). ``threshold``
    (FATReLU) must be 0: the epilogue does not compare against a threshold yet (ValueError otherwise)."""
    if threshold:  # the default costs no call: the ReLU path's host time stays as it was
        _raise_if(gate_unsupported(threshold))
    _gate_kernel_checks(x, w_gate, tile, compression)
    check_gate_cluster(gate_cluster)
    packed, spill = _gate_op(x, w_gate, tile, compression, gate_cluster)
    return TwELL(packed, None, None, w_gate.shape[0], tile, compression, source=(x, w_gate), spill=spill)


def _ffn(x: Tensor, gate: TwELL, w_up: Optional[Tensor], w_down_t: Tensor,
         union: Optional[tuple[float, float]], dense_cap: Optional[int]) -> Tensor:
    _fused_kernel_checks(x)
    for name, t in (("the TwELL's words", gate.packed), ("the TwELL's spill area", gate.spill)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} are on {t.device}, x on {x.device}")
    check_aligned(x=x, w_up=w_up, w_down_t=w_down_t, packed=gate.packed, spill=gate.spill)
    ratio, base = check_union_rule(union) or UNION_OFF
    check_dense_cap(dense_cap)
    # w_act lets the kernel recompute gate values from x (the dense path for heavy rows, tiles the
    # spill area could not hold): only right when x is the tensor the TwELL was made from. With any
    # other x the kernel gets no w_act, and rows it cannot finish are completed below from the
    # TwELL's own source.
    w_act = gate.source[1] if gate.source is not None and gate.source[0] is x else None
    out = _ffn_op(x, gate.packed, gate.spill, w_act, w_up, w_down_t, gate.tile, gate.compression, ratio, base,
                  dense_cap)
    if w_act is None and gate.n_overflow_rows:
        rows, h = gate.overflow_rows, gate.overflow_dense.float()
        if w_up is not None:
            h = h * (x[rows].float() @ w_up.float().t())
        out[rows] = (h @ w_down_t.float()).to(out.dtype)
    return out


def twell_gated_ffn(x: Tensor, gate: TwELL, w_up: Tensor, w_down_t: Tensor,
                    union: Optional[tuple[float, float]] = None, *, dense_cap: Optional[int] = DENSE_CAP,
                    up_relu: bool = False) -> Tensor:
    """bf16 [M, D]: ``sum over active n of h[m, n] * (x[m] . w_up[n]) * w_down_t[n]``, exact on overflow.
    ``up_relu`` (dReLU) must be False: the fused kernel has no ReLU on the up product yet (ValueError).

    ``union``: ``(ratio, base)`` of the block-union rule for this call (``twell.reference.ffn.
    check_union_rule``), or ``None``: off (``UNION_OFF``, the per-row kernel only). ``dense_cap``: rows
    per round of the dense path for heavy rows, or ``None`` (``DENSE_CAP``): its rule, M / 8 rows, at
    least 4096, at most M (``twell.reference.ffn.check_dense_cap``; the path needs a TwELL from
    :func:`twell_gate` of this x)."""
    if up_relu:
        _raise_if(gate_unsupported(up_relu=up_relu))
    check_ffn_args(x, gate, ("w_up", w_up), ("w_down_t", w_down_t))
    return _ffn(x, gate, w_up, w_down_t, union, dense_cap)


def twell_ffn(act: TwELL, w_down_t: Tensor, *, dense_cap: Optional[int] = DENSE_CAP) -> Tensor:
    """Non-gated FFN, bf16 [M, D]: ``act @ w_down_t`` (act = twell_gate(x, w_up)); ``dense_cap`` as in
    :func:`twell_gated_ffn`."""
    if not isinstance(act, TwELL):
        raise TypeError(f"act: expected a twell.formats.TwELL, got {type(act).__name__}")
    check_tensor("w_down_t", w_down_t, dtype=torch.bfloat16, shape=(act.n_cols, "D"), device=act.device,
                 contiguous=True)
    if act.source is not None:
        x = act.source[0]
        if w_down_t.shape[1] != x.shape[1]:
            raise ValueError(f"the kernel's non-gated FFN writes rows as wide as its input: w_down_t must be "
                             f"[H, {x.shape[1]}] (D of the x the TwELL was made from), got {list(w_down_t.shape)}")
    else:  # no x needed by the kernel in this case; pass a correctly shaped placeholder
        x = torch.empty(act.n_rows, w_down_t.shape[1], dtype=torch.bfloat16, device=act.device)
    return _ffn(x, act, None, w_down_t, None, dense_cap)


def sparse_gated_ffn(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down_t: Tensor, tile: int = 256,
                     compression: int = SPARSE_FFN_COMPRESSION,
                     union: Optional[tuple[float, float]] = None, *, dense_cap: Optional[int] = DENSE_CAP,
                     gate_cluster: int = GATE_CLUSTER, threshold: float = 0.0, up_relu: bool = False) -> Tensor:
    """The whole sparse gated FFN on the GPU: gate GEMM writing TwELL, then the fused up/down kernel.
    ReLU gates only: ``threshold`` (FATReLU) and ``up_relu`` (dReLU) other than their defaults raise.

    One op, so the TwELL stays internal: the fused kernel starts on the SMs that the gate kernel's
    last wave leaves idle and waits for each row's words (docs/kernels.md §6). Same result, bit for
    bit, as ``twell_gated_ffn(x, twell_gate(x, w_gate), w_up, w_down_t)`` with the same settings (every
    default included), at any compression while the spill area holds the fuller tiles (entries are
    summed in column order either way; past it, tiles are recomputed and agree to rounding).
    ``union`` and ``dense_cap`` as in :func:`twell_gated_ffn`, ``gate_cluster`` as in
    :func:`twell_gate`; with the union rule on, the kernels run in turn (its plan reads the whole
    TwELL first), so there is no overlap. The TwELL stays inside, and so does
    its overflow count: the two-op path gives it (``twell_gate(x, w_gate).n_overflow_rows``), as
    does a ``SparseFFN`` with ``keep_gate=True`` (``last_gate.n_overflow_rows``).
    """
    if threshold or up_relu:
        _raise_if(gate_unsupported(threshold, up_relu))
    _gate_kernel_checks(x, w_gate, tile, compression)
    _fused_kernel_checks(x)
    for name, w in (("w_up", w_up), ("w_down_t", w_down_t)):
        check_tensor(name, w, dtype=torch.bfloat16, shape=tuple(w_gate.shape), device=x.device, contiguous=True)
    check_aligned(w_up=w_up, w_down_t=w_down_t)
    ratio, base = check_union_rule(union) or UNION_OFF
    check_dense_cap(dense_cap)
    check_gate_cluster(gate_cluster)
    return _sparse_ffn_op(x, w_gate, w_up, w_down_t, tile, compression, ratio, base, dense_cap, gate_cluster)


@torch.library.custom_op("twell::decode_ffn", mutates_args=())
def _decode_ffn_op(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down_t: Tensor, threshold: float = 0.0,
                   up_relu: bool = False) -> Tensor:
    return load().decode_ffn(x, w_gate, w_up, w_down_t, threshold, up_relu)


@_decode_ffn_op.register_fake
def _(x, w_gate, w_up, w_down_t, threshold=0.0, up_relu=False):
    return x.new_empty(x.shape)


def decode_gated_ffn(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down_t: Tensor, *, threshold: float = 0.0,
                     up_relu: bool = False) -> Tensor:
    """The gated FFN for 1 to ``DECODE_MAX_ROWS`` rows (token-by-token generation), bf16 [M, D], for every gate
    variant: ReLU, FATReLU (``threshold``: a neuron is active where its bf16 gate is above it) and dReLU
    (``up_relu``: ReLU on the up product too; the down rows are read only where both are positive).

    Reads ``w_gate`` in full and only the active neurons' rows of ``w_up`` and ``w_down_t``: two
    kernels (csrc/twell_decode.cu), no host synchronisation, deterministic, so it runs under CUDA
    graphs. Same values as :func:`twell.reference.decode_gated_ffn` up to the order of fp32 sums.

    The gate kernel starts copying ``w_gate`` before the kernel launched just before it has finished (it
    reads x only after): do not write ``w_gate`` in place in the kernel right before this call on the same
    stream (e.g. an optimizer step); anything earlier is complete."""
    threshold, up_relu = check_gate_settings(threshold, up_relu)
    check_decode_args(x, w_gate, w_up, w_down_t)
    _kernel_checks(x)
    check_aligned(x=x, w_gate=w_gate, w_up=w_up, w_down_t=w_down_t)
    return _decode_ffn_op(x, w_gate, w_up, w_down_t, threshold, up_relu)


def decode_gated_ffn_trusted(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down_t: Tensor, threshold: float = 0.0,
                             up_relu: bool = False) -> Tensor:
    """:func:`decode_gated_ffn` without its Python checks, for a caller that has validated these tensors
    and settings (``SparseFFN`` on its kernel route: bf16 CUDA, contiguous and aligned, the layer's shapes).
    The extension still checks every tensor and raises on anything it cannot run; eager calls also skip
    the custom op's dispatch (compiled code traces the op). About 25 us less host time per call, which
    a token-by-token loop on the host pays once per layer."""
    if torch.compiler.is_compiling():
        return _decode_ffn_op(x, w_gate, w_up, w_down_t, threshold, up_relu)
    return load().decode_ffn(x, w_gate, w_up, w_down_t, threshold, up_relu)


def union_unsupported(D: int, H: int) -> str:
    """Why the block-union path cannot serve a gated layer with model width D and H hidden units, or
    ``""`` when it can (the limits live in csrc/twell_union.cu; builds the extension, so where the
    kernels cannot run at all it returns why, from :func:`twell.kernels.available`, and builds nothing)."""
    ok, why = available()
    if not ok:
        return why
    return load().union_unsupported(int(D), int(H))


def union_plan(x: Tensor, gate: TwELL, w_up: Tensor, w_down_t: Tensor, ratio: float = UNION_RULE[0],
               base: float = UNION_RULE[1]) -> dict:
    """Which rows the fused kernel would give to the block-union path (csrc/twell_union.cu) under the
    rule ``union=(ratio, base)``.

    A block of 64 rows takes it when its union U of active neurons satisfies
    ``|U| <= ratio * (entries - base)``, counting the rows the path can take (at most 128 entries,
    no unresolved overflow). Default: the fitted rule ``UNION_RULE`` (the ops' own default is the
    path off, under which no block takes it); ratio 0: no block. Returns ``union_blocks``,
    ``union_block_ids`` (ascending) and ``union_sizes`` (|U| of each; CPU int64 tensors), and
    ``per_row_rows`` (rows left to the per-row kernel). Synchronises the device: a diagnostic, not
    part of the timed path.
    """
    check_ffn_args(x, gate, ("w_up", w_up), ("w_down_t", w_down_t))
    _kernel_checks(x)
    check_aligned(x=x, w_up=w_up, w_down_t=w_down_t, packed=gate.packed, spill=gate.spill)
    ratio, base = check_union_rule((ratio, base))
    n_light, sizes, blocks = load().ffn_plan(x, gate.packed, gate.spill, w_up, w_down_t, gate.tile,
                                             gate.compression, float(ratio), float(base))
    return {"union_blocks": int(sizes.numel()), "union_block_ids": blocks, "union_sizes": sizes,
            "per_row_rows": int(n_light.item())}
