"""Per-layer choice of the FFN path by row count, from timings on a calibration batch.

``SparseFFN`` on path "auto" takes the decoding op up to ``decode_rows`` rows, runs dense for row counts in
``dense_rows`` and the large-batch sparse op beyond. The defaults are one rule measured on calibrated
layers (docs/decoding.md); where a layer gains or loses depends on its own activity, so
:func:`choose_row_paths` times dense against the layer's sparse op at a grid of row counts on the inputs the
layer receives and sets both per layer, so that "auto" runs sparse only where it measured faster.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from twell.model.llama import capture_ffn_inputs, sparse_ffns
from twell.nn import routing
from twell.reference.decode import DECODE_MAX_ROWS

ROW_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ALL_ROWS = 2 ** 31 - 1  # dense_rows' upper end when the large-batch op never won


def row_rule(wins: dict[int, bool], decode_max: int = DECODE_MAX_ROWS) -> tuple[int, Optional[tuple[int, int]]]:
    """``(decode_rows, dense_rows)`` from ``wins``: row count -> whether the layer's sparse op beat dense there.

    Sparse runs only where every measured count of its segment won: the decoding op up to the largest
    count ``m <= decode_max`` such that it won at every measured count up to ``m``; the large-batch op from
    the smallest measured count above ``decode_max`` from which it won at every larger measured count (the
    counts up to ``decode_max`` timed the decoding op). Row counts
    between two measured ones take the safe side (dense), and so does everything past the grid when the
    largest count lost."""
    grid = sorted(wins)
    decode_rows = 0
    for m in grid:
        if m > decode_max or not wins[m]:
            break
        decode_rows = m
    start = None  # the smallest count from which on the large-batch op won at every larger one
    for m in reversed(grid):
        if m <= decode_max or not wins[m]:  # counts up to decode_max timed the decoding op, not this one
            break
        start = m
    hi = ALL_ROWS if start is None else start - 1
    return decode_rows, ((decode_rows + 1, hi) if decode_rows + 1 <= hi else None)


def _graph_timer(reps: int) -> Callable[[dict[str, Callable[[], object]], torch.device], dict[str, float]]:
    """Median ms of each function replayed from a CUDA graph (launch overhead out, as when decoding runs
    under graphs), alternating, L2 overwritten before each call (shared/BENCHMARK.md)."""
    from twell.timing import graphed, time_alternating

    def timer(fns, device):
        replays = {name: graphed(fn, device)[0] for name, fn in fns.items()}
        t = time_alternating(replays, device, reps=reps, warmup=3)
        return {name: t[name].median_ms for name in fns}

    return timer


def choose_row_paths(model: nn.Module, *args: Any, rows: Sequence[int] = ROW_GRID, reps: int = 30,
                     min_gain: float = 0.05, timer: Optional[Callable] = None, **kwargs: Any) -> list[dict]:
    """Run ``model(*args, **kwargs)`` once without gradients and, for every SparseFFN on path "auto" that runs
    the kernels on the inputs it received, time its dense path against its sparse op (the decoding op up to
    ``DECODE_MAX_ROWS`` rows, the large-batch op above) on the first ``m`` of those rows for each ``m`` in
    ``rows`` that they hold (CUDA graph replays, L2 flushed, median of ``reps``); the sparse op wins a count
    when it is at least ``min_gain`` faster. Sets the layer's ``decode_rows`` and ``dense_rows`` by
    :func:`row_rule`. Feed at least ``max(rows)`` tokens; layers elsewhere (dense, another path, kernels
    unavailable) are left as they are, with the reason in ``why``.

    Returns one dict per layer: ``layer``, ``tokens``, ``times`` (row count -> ``{"dense", "sparse"}`` ms),
    ``decode_rows``, ``dense_rows`` and ``why`` (None where set). ``timer(fns, device) -> {name: ms}``
    replaces the GPU timing (tests)."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
    grid = sorted({int(m) for m in rows})
    if not grid or grid[0] < 1:
        raise ValueError(f"rows must be positive row counts, got {rows}")
    ffns = sparse_ffns(model)
    if not ffns:
        raise ValueError("the model has no SparseFFN layers; build it with twell.model.build_model or load_pretrained")
    seen = capture_ffn_inputs(model, ffns, *args, **kwargs)
    report, settings = [], []
    for i, (f, x) in enumerate(zip(ffns, seen)):
        row = {"layer": i, "tokens": 0 if x is None else int(x.shape[0]), "times": {}, "decode_rows": f.decode_rows,
               "dense_rows": f.dense_rows, "why": None}
        why = _not_timed(f, x)
        if why is None and timer is None and not x.is_cuda:
            why = f"input on {x.device}: nothing to time (the kernels run on CUDA inputs)"
        if why is None and timer is None:
            from twell import kernels

            ok, reason = kernels.available()
            why = None if ok else f"kernels unavailable: {reason}"
        if why is not None:
            row["why"] = why
            report.append(row)
            continue
        wins = {}
        for m in (m for m in grid if m <= x.shape[0]):
            xm = x[:m].contiguous()
            t = (timer or _graph_timer(reps))(_calls(f, xm), x.device)
            row["times"][m] = t
            wins[m] = t["sparse"] <= (1.0 - min_gain) * t["dense"]
        row["decode_rows"], row["dense_rows"] = row_rule(wins)
        report.append(row)
        settings.append((f, row["decode_rows"], row["dense_rows"]))
    for f, decode_rows, dense_rows in settings:  # every layer measured before any is changed
        f.decode_rows, f.dense_rows = decode_rows, dense_rows
        f.auto_ceilings = ()  # the timings decide by rows in place of the default activity ceilings
    return report


def _calls(f, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The layer's dense path and its sparse op on x (as ``_sparse`` runs it with the decoding op allowed up to
    its limit)."""
    state = dataclasses.replace(f.layer_state(), decode_rows=DECODE_MAX_ROWS, keep_gate=False)
    route = routing.sparse_route(state, x.shape[0], "kernel" if x.is_cuda else "reference", "timed by choose_row_paths")

    def sparse():
        return f._sparse(x, route)

    return {"dense": lambda: f.down_proj(f.hidden(x)[1]), "sparse": sparse}


def _not_timed(f, x: Optional[torch.Tensor]) -> Optional[str]:
    if x is None:
        return "the SparseFFN was not called by the calibration forward"
    if f.path != "auto":
        return f"path {f.path!r}: only layers on path 'auto' choose by rows"
    if not f.gated:
        return "the decoding op serves gated layers only"
    route, why = f.auto_route(x)
    if route == "reference" and not x.is_cuda:
        return None  # CPU: the reference stands in for the kernels (a test of the choice, not a timing)
    if route != "kernel":
        return f"path 'auto' runs {route} on these inputs ({why})"
    if f.layer_state().auto_dense:
        n = f.decode_max_rows()
        return ("the layer runs dense by its activity threshold ("
                + (f"the decoding op on up to {n} rows: SparseFFN.decode_max_rows)" if n else "at every row count)"))
    return None
