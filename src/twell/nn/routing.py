"""How one SparseFFN call runs: a pure planning function from the layer's state and the input to a Route.

``SparseFFN.forward`` is two steps: :func:`plan` (or :func:`plan_training` for the training op) turns a
:class:`LayerState` (everything about the layer that decides the path, gathered once per configuration)
and the input into a :class:`Route`; the module's executor runs that Route and records it
(``last_route``, ``last_path``, ``auto_note``). Nothing here reads or writes a module, so every case
is unit-tested on its own (tests/test_routing.py).

The ops a Route names:

======== ====================================================================================
dense    plain PyTorch through the projection modules (hooks and all)
decode   ``decode_gated_ffn``: few rows; reads the gate in full, only active neurons' up/down rows
sparse   ``sparse_gated_ffn``: gate GEMM and fused up/down in one op, the TwELL stays inside
gate-ffn ``twell_gate`` then ``twell_gated_ffn``: the TwELL is kept (``keep_gate``) or measured
ffn      non-gated: ``twell_gate`` on the up projection, then ``twell_ffn``
train    ``train_gated_ffn``: forward with a sparse backward and the L1 statistics
backend  a custom ``train_backend`` callable
======== ====================================================================================

``impl`` is ``"torch"`` (dense, backend), ``"reference"`` (pure-PyTorch ops) or ``"kernel"`` (CUDA).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from twell.reference.gates import SPARSE_ACTIVATIONS

PATHS = ("auto", "dense", "reference", "kernel")
# "auto" runs a sparse op only at or below a fraction of neurons active per token that depends on the row
# count (SparseFFN.auto_ceilings): (at least this many rows, ceiling) pairs, ascending, each capped by the
# layer's auto_max_active; below the first entry (and above the decoding op's rows) "auto" runs dense.
# Fewer rows leave less work to skip for the same gate GEMM and launches (docs/routing.md#auto-by-row-count).
AUTO_CEILINGS = ((2048, 0.0025), (4096, 1.0))
# Default SparseFFN.auto_max_active: the ceiling from 4096 rows on.
AUTO_MAX_ACTIVE = 0.01
# How LayerState.no_kernel_why starts when the kernels cannot run in this process at all.
UNAVAILABLE = "kernels unavailable: "


def pct(fraction: float) -> str:
    """``0.0123`` -> ``"1.23%"``. For eager code only: planning, which compiled code traces, formats no
    float (some dynamo versions cannot trace a format spec, and a per-layer value would be a guard); it
    reads texts made when the values were set (``LayerState.activity_text``)."""
    return f"{100 * fraction:.2f}%"


@dataclass(frozen=True)
class Route:
    """One call's plan: which op, on which implementation, and why (``reason`` is never empty).

    ``measure``: "auto" measures the layer's activity on this call (one host sync, once per layer).
    ``checked``: the plan checked the inputs (bf16 CUDA, aligned weights), so the decoding op may skip
    its Python checks (the extension still checks). ``slots``: the training op's ELL slots per row.
    ``note``: what ``auto_note`` becomes (None when "auto" has nothing to say: it runs the kernels).
    ``training``: autograd records the call (the module marks its cached W_down transpose stale)."""

    op: str
    impl: str
    reason: str
    measure: bool = False
    checked: bool = False
    slots: int = 0
    note: Optional[str] = None
    training: bool = False

    @property
    def path(self) -> str:
        """The ``SparseFFN.last_path`` this Route gives."""
        if self.op == "dense":
            return "dense"
        if self.op == "backend":
            return "train-backend"
        if self.op == "train":
            return f"train-{self.impl}"
        return f"twell-{self.impl}"


@dataclass(frozen=True)
class LayerState:
    """What planning needs to know about a layer, apart from the input (``SparseFFN.layer_state()``).

    The ``*_why`` strings are empty when nothing stands in the way: ``no_sparse_why`` for any sparse
    path (bias, width of H, projections with their own forward or hooks, non-contiguous weights),
    ``no_kernel_why`` for the kernels (unavailable,
    misaligned weights, a shape they do not take), ``no_decode_why`` for the decoding op (which takes
    wider layers than the other kernels and every gate variant), ``no_train_why`` for the training op,
    ``gate_why`` for the kernels but the decoding op on this layer's gate (FATReLU and dReLU: they compute
    ReLU only, twell.reference.gates). A layer only the decoding op runs ("decode-only": a gate variant,
    or a width the other kernels do not take) runs dense but on few rows (:func:`_auto_decode`)."""

    path: str
    hidden_size: int
    intermediate_size: int
    gated: bool
    activation: str
    track: bool
    keep_gate: bool
    backend: str  # "none", "sparse-training" or "custom"
    no_sparse_why: str
    weight_dtypes: tuple[torch.dtype, ...]  # the projections' distinct weight dtypes, in projection order
    no_kernel_why: str
    no_decode_why: str
    no_train_why: str
    decode_rows: int
    dense_rows: Optional[tuple[int, int]]
    auto_dense: Optional[bool]  # None: "auto" has not decided yet (activity not measured, no timed choice)
    timed: bool  # the choice came from timings (set_auto_choice), not from the measured activity
    activity: Optional[float]  # fraction of neurons active per token "auto" measured
    activity_text: str  # the same as a percentage, formatted when it was measured ('' before)
    auto_max_active: float
    ceilings: tuple  # SparseFFN.auto_ceilings
    decode_max_rows: int  # rows up to which a layer run dense by activity still takes the decoding op
    choice_note: Optional[str]  # why "auto" decided what it did (the activity or the timed choice)
    train_slots: int
    gate_why: str = ""  # why the kernels cannot compute this layer's gate variant ('' for ReLU)


def rows(x) -> int:
    """The number of rows (tokens) x holds: every dimension but the last (0 for a zero width)."""
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast computes x's device in, or None when autocast is off there."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def width_error(state: LayerState, x: torch.Tensor) -> Optional[str]:
    if x.shape[-1] != state.hidden_size:
        return (f"x has {x.shape[-1]} features in its last dimension; this layer takes "
                f"hidden_size={state.hidden_size}")
    return None


def ceiling(rows: int, auto_max_active: float, ceilings=AUTO_CEILINGS) -> float:
    """The activity at or below which "auto" runs a sparse op on ``rows`` rows (-1: at none). No
    ceilings: ``auto_max_active`` at every row count."""
    if not ceilings:
        return auto_max_active
    c = -1.0
    for fewest, value in ceilings:
        if rows >= fewest:
            c = value
    return min(c, auto_max_active) if c >= 0 else -1.0


def check_ceilings(value) -> tuple:
    """``auto_ceilings`` validated: (rows, fraction) pairs with rows ascending, fractions in [0, 1]."""
    try:
        pairs = tuple((int(r), float(c)) for r, c in value)
    except (TypeError, ValueError):
        pairs = None
    if pairs is None or any(r < 1 or not 0.0 <= c <= 1.0 for r, c in pairs) or \
            any(a[0] >= b[0] for a, b in zip(pairs, pairs[1:])):
        raise ValueError(f"auto_ceilings must be (rows, fraction) pairs, rows ascending from 1, fractions in "
                         f"[0, 1] (() for the auto_max_active threshold alone), got {value!r}")
    return pairs


def _in(rng: Optional[tuple[int, int]], rows: int) -> bool:
    return rng is not None and rng[0] <= rows <= rng[1]


def _sparse_op(state: LayerState, rows: int, impl: str, reason: str, *, measure: bool = False,
               checked: bool = False, note: Optional[str] = None) -> Route:
    """The sparse op for a layer and row count: the decoding op on few rows (kernels), one op when
    nothing needs the TwELL, else the gate and fused ops in turn."""
    if not state.gated:
        return Route("ffn", impl, reason, measure=measure, note=note)
    if measure or state.keep_gate:
        return Route("gate-ffn", impl, reason, measure=measure, note=note)
    if impl == "kernel" and 0 < rows <= state.decode_rows:
        return Route("decode", impl, reason + f"; {rows} rows <= decode_rows {state.decode_rows}",
                     checked=checked, note=note)
    return Route("sparse", impl, reason, note=note)


def sparse_route(state: LayerState, rows: int, impl: str, reason: str) -> Route:
    """The sparse op the layer runs on ``rows`` rows on ``impl``, whatever "auto" would choose (for timing
    the layer's sparse path against dense)."""
    return _sparse_op(state, rows, impl, reason, checked=False)


def _auto_kernel(state: LayerState, rows: int, *, compiling: bool, capturing: bool) -> Route:
    """"auto" on a layer and input the kernels can run."""
    if state.auto_dense:
        if 0 < rows <= state.decode_max_rows and not state.keep_gate and not _in(state.dense_rows, rows):
            return Route("decode", "kernel", f"{state.choice_note}; {rows} rows: decoding op", checked=True,
                         note=state.choice_note)
        why = state.choice_note or (f"auto: dense ({state.activity_text} of neurons active per token, above "
                                    "auto_max_active)" if state.activity is not None
                                    else "auto: dense (chosen by timings)")
        return Route("dense", "torch", why, note=state.choice_note)
    if _in(state.dense_rows, rows):
        note = (f"auto: dense at {rows} rows (dense_rows {state.dense_rows[0]}-{state.dense_rows[1]}: "
                "dense is faster there)")
        if state.auto_dense is None and rows > 0 and not compiling and not capturing:
            # measured on its first call with rows, whichever path runs it: a prefill run dense here decides
            # the layer on all its tokens, not a later single token
            return Route("dense", "torch", note, measure=True, note=note)
        return Route("dense", "torch", note, note=note)
    if state.activity is not None and not state.timed and rows > state.decode_rows:
        c = ceiling(rows, state.auto_max_active, state.ceilings)
        if state.activity > c:
            note = (f"auto: dense at {rows} rows ({state.activity_text} of neurons active per token; "
                    + ("above the ceiling for this row count, auto_ceilings)" if c >= 0 else
                       "the sparse op is slower than dense at this row count)"))
            return Route("dense", "torch", note, note=note)
    if state.auto_dense is None:
        if capturing:
            # measuring reads a count back to the host, which a capture forbids: the first call outside one does
            note = "auto: activity not measured yet (this call was captured in a CUDA graph)"
            return _sparse_op(state, rows, "kernel", note, checked=True, note=note)
        return _sparse_op(state, rows, "kernel", "auto: kernels (measuring the layer's activity)", measure=True,
                          checked=True)
    return _sparse_op(state, rows, "kernel", state.choice_note or "auto: kernels", checked=True, note=state.choice_note)


def decode_only_why(state: LayerState) -> str:
    """Why only the decoding op of the kernels runs this layer ('' when the others run it too, or when the
    decoding op cannot either): a gate variant, or a width the other kernels do not take."""
    other = state.gate_why or state.no_kernel_why
    if (not other or state.no_decode_why or not state.gated or state.no_kernel_why.startswith(UNAVAILABLE)
            or state.activation not in SPARSE_ACTIVATIONS):
        return ""
    return other


def auto_route(state: LayerState, x: torch.Tensor) -> tuple[str, str]:
    """Where "auto" sends x before its activity decision: ``("dense" | "reference" | "kernel" | "decode",
    why)``, ``why`` empty for the kernels; "decode": only the decoding op can run the layer (why not the
    others), so it runs dense but on as few rows as the op beats dense on (:func:`_auto_decode`)."""
    if state.activation not in SPARSE_ACTIVATIONS:
        return "dense", f"activation {state.activation}: the sparse paths need relu (or its gate variants)"
    if state.track:
        return "dense", "tracking: the statistics need the dense hidden state"
    why = width_error(state, x)
    if why:
        raise ValueError(why)
    why = state.no_sparse_why or dtype_why(state, x)
    if why:
        return "dense", why
    if not x.is_cuda:
        return "reference", f"input on {x.device}"
    why = decode_only_why(state)
    if why:
        return "decode", why
    if state.gate_why:
        # exact either way; on the GPU plain PyTorch is much faster than the reference's gathers
        return "dense", state.gate_why
    return ("reference", state.no_kernel_why) if state.no_kernel_why else ("kernel", "")


def _auto_decode(state: LayerState, rows: int, why: str, *, compiling: bool, capturing: bool) -> Route:
    """"auto" on a decode-only layer (``why``: what keeps the other kernels off it): dense, but for the
    decoding op on up to ``decode_max_rows`` rows, the rows whose expected union of active neurons the
    measured activity keeps small enough for the op to beat dense (SparseFFN.decode_max_rows). Dense
    calls measure the activity until it is known (the first call with rows outside a capture)."""
    if state.auto_dense is None:
        note = f"auto: dense ({why}; the decoding op on few rows once the layer's activity is measured)"
        return Route("dense", "torch", note, measure=rows > 0 and not compiling and not capturing, note=note)
    if 0 < rows <= state.decode_max_rows and not state.keep_gate and not _in(state.dense_rows, rows):
        note = (f"auto: the decoding op on up to {state.decode_max_rows} rows, dense on more ({why})"
                + (f"; {state.choice_note}" if state.choice_note else ""))
        return Route("decode", "kernel", f"{note}; {rows} rows: decoding op", checked=True, note=note)
    note = f"auto: dense at {rows} rows ({why}" + (
        f"; the decoding op on up to {state.decode_max_rows} rows)" if state.decode_max_rows else ")")
    return Route("dense", "torch", note, note=note)


def _dtypes(state: LayerState) -> list[str]:
    return sorted(str(d) for d in state.weight_dtypes)


def dtype_why(state: LayerState, x: torch.Tensor) -> str:
    """Why the sparse paths cannot compute this call in bfloat16 ('' when they can)."""
    if x.dtype != torch.bfloat16 or state.weight_dtypes != (torch.bfloat16,):
        return f"the sparse paths compute in bfloat16; x is {x.dtype}, the weights {_dtypes(state)}"
    return ""


def plan(state: LayerState, x: torch.Tensor, *, grad_enabled: bool, compiling: bool = False,
         capturing: bool = False, autocast_dtype: Optional[torch.dtype] = None) -> Route:
    """The Route of one call. ``grad_enabled``: autograd records this call (training); ``compiling``:
    inside torch.compile; ``capturing``: inside a CUDA graph capture; ``autocast_dtype``: the autocast
    dtype when autocast is on for x's device. Raises where an explicit path cannot run the layer."""
    path = state.path
    n = rows(x)
    if grad_enabled:
        if state.backend == "custom":
            return Route("backend", "torch", "training: the layer's train_backend", training=True)
        if path in ("reference", "kernel"):
            return plan_training(state, x, sparse=True, impl=path, strict=f"path={path!r}",
                                 autocast_dtype=autocast_dtype, why=f"path {path!r}")
        return Route("dense", "torch", f"training: path {path!r} trains dense (no train_backend)", training=True)
    if path == "auto":
        route, why = auto_route(state, x)
        if route == "dense":
            note = f"auto: dense ({why})"
            return Route("dense", "torch", note, note=note)
        if route == "reference":
            note = f"auto: TwELL reference ({why})"
            return _sparse_op(state, n, "reference", note, note=note)
        if route == "decode":
            return _auto_decode(state, n, why, compiling=compiling, capturing=capturing)
        return _auto_kernel(state, n, compiling=compiling, capturing=capturing)
    if path == "dense":
        return Route("dense", "torch", "path 'dense'")
    # an explicit sparse path raises where "auto" would leave it
    if state.activation not in SPARSE_ACTIVATIONS:
        raise ValueError(f"path={path!r} needs activation='relu' (or its gate variants 'fatrelu', 'drelu'), this "
                         f"layer uses {state.activation!r}")
    why = width_error(state, x)
    if why:
        raise ValueError(why)
    if state.no_sparse_why:
        raise ValueError(f"path={path!r} cannot run this layer: {state.no_sparse_why} (path='auto' runs it dense)")
    if path == "kernel":
        only = decode_only_why(state)
        if only and not state.track and not state.keep_gate:
            if 0 < n <= state.decode_rows:
                return Route("decode", "kernel", f"path 'kernel': the decoding op ({only}); {n} rows <= "
                             f"decode_rows {state.decode_rows}")
            raise ValueError(f"path='kernel' runs this layer on the decoding op only, on 1 to decode_rows="
                             f"{state.decode_rows} rows ({only}); this call has {n} rows (path='auto' runs "
                             "the others dense)")
        if state.gate_why:
            raise ValueError(f"path='kernel' cannot run this layer: {state.gate_why} (path='reference' or 'dense' "
                             "compute it exactly; 'auto' chooses)")
        if state.no_kernel_why.startswith(UNAVAILABLE):
            raise RuntimeError(f"path='kernel' requested but the TwELL kernels are unavailable: "
                               f"{state.no_kernel_why[len(UNAVAILABLE):]}")
        if state.no_kernel_why:
            raise ValueError(f"path='kernel' cannot run this layer: {state.no_kernel_why} "
                             "(path='auto' takes the reference)")
    if state.track:
        # the statistics come from the training op, which computes them sparse (no autograd here)
        return plan_training(state, x, sparse=True, impl=path, strict=f"path={path!r} with tracking",
                             autocast_dtype=autocast_dtype, why=f"path {path!r}, statistics from the training op")
    return _sparse_op(state, n, path, f"path {path!r}")


def plan_training(state: LayerState, x: torch.Tensor, *, sparse: bool, impl: str, strict: Optional[str] = None,
                  autocast_dtype: Optional[torch.dtype] = None, why: str = "", slots: Optional[int] = None) -> Route:
    """The Route of a training call: the training op on ``impl`` when ``sparse`` and the op can run the
    layer, else dense, with the reason (``why``: the caller's reason for its choice; ``slots``: the op's
    ELL slots per row, default the layer's). ``strict`` names
    what demands the op (``"train.sparse_kernels=always"``, an explicit path): where the op cannot run
    the layer, raise instead of running dense."""
    dtype = autocast_dtype or x.dtype
    cannot = state.no_train_why
    if not cannot:
        bad_width = width_error(state, x)
        if bad_width:
            raise ValueError(bad_width)
    if not cannot and dtype != torch.bfloat16:
        cannot = f"the training kernels compute in bfloat16, this forward in {dtype}"
    if not cannot and autocast_dtype is None and state.weight_dtypes != (x.dtype,):
        cannot = f"x is {x.dtype}, the weights {_dtypes(state)}"
    if not cannot and impl == "kernel":
        if state.gate_why:
            cannot = state.gate_why
        elif state.no_kernel_why.startswith(UNAVAILABLE):
            cannot = state.no_kernel_why
        elif not x.is_cuda:
            cannot = f"input on {x.device}"
    if cannot:
        if strict:
            raise ValueError(f"{strict}: the {impl} training op cannot run this layer: {cannot}")
        return Route("dense", "torch", f"training: dense ({cannot})", training=True)
    if not sparse:
        return Route("dense", "torch", f"training: dense ({why or 'by choice'})", training=True)
    return Route("train", impl, f"training: sparse ({why or 'by choice'})", slots=slots or state.train_slots,
                 training=True)
