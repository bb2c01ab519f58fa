"""Per-layer choice of the fused kernel's block-union path from a calibration batch (and, for layers
on path "auto", of dense or sparse, by timing both).

The block-union path (csrc/twell_union.cu) pays on layers whose tokens share many active neurons
and loses on the others: its plan costs ~0.1 ms per call at 65536 tokens even where no block
qualifies (docs/kernels.md §7). So rather than one process-wide setting, each SparseFFN gets
its own ``union``: the fitted rule where most blocks of a calibration batch qualify and, by default,
the layer's sparse FFN is faster with it on that batch; off elsewhere. The timing is there because the
share alone misroutes some layers (a trained layer with 12 active per token: 79% of blocks qualify,
3% slower; docs/kernels.md §8).
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import nn

from twell.model.llama import capture_ffn_inputs, sparse_ffns
from twell.nn import routing
from twell.reference.ffn import UNION_BLOCK, UNION_RULE, check_union_rule


MIN_TIMED_TOKENS = 16384  # below this a layer's fused op takes ~0.2 ms and its timing is noisy (docs/kernels.md §8)


def choose_union_paths(model: nn.Module, *args: Any, rule: tuple[float, float] = UNION_RULE,
                       min_share: float = 0.5, timed: bool = True, reps: int = 30, min_gain: float = 0.02,
                       **kwargs: Any) -> list[dict]:
    """Run ``model(*args, **kwargs)`` once without gradients, and give every SparseFFN layer
    ``union = rule`` when at least ``min_share`` of its 64-token blocks would take the union path on the
    inputs it saw and (with ``timed``) the layer's sparse FFN (the one op it runs) is at least
    ``min_gain`` faster with the rule than without on those inputs (median of ``reps`` alternating
    calls, 30 as in the benchmark); else
    ``union = (0, 0)`` (per-row kernel only). The margin is there because a
    calibration timing moves by 1-2% on layers of a millisecond or more: a near tie gains nothing and
    the union path holds more memory. (The whole op is timed, not the fused op alone: it also counts
    the gate kernel's last wave, which the union path cannot overlap: its plan reads the whole TwELL
    first.) Calibrate on at least ~16k tokens: on a 4096-token layer
    (~0.2 ms per call) the union / per-row ratio moved by up to 0.2 from one call to the next, with 10
    or 30 reps alike; at 16384 tokens it moved by 0.01 (docs/kernels.md §8). A layer timed on
    fewer than ``MIN_TIMED_TOKENS`` tokens gets a warning.

    Needs the kernels (an H100). Layers the union path cannot serve (not gated, not ReLU, biased, or a
    shape outside ``kernels.union_unsupported``: D a multiple of 512 up to 2048, H up to 8192) get
    ``(0, 0)``, with the reason in ``why``. Returns one dict per layer: ``layer``, ``tokens``,
    ``active_per_token``, ``blocks``, ``union_blocks``, ``share``, ``per_row_ms`` and ``union_ms``
    (None where not timed), ``union`` and ``why``.
    Feed batches like the ones you will serve: the share depends on how consecutive tokens share
    neurons, so sequences should be in order.

    With ``timed``, a layer whose ``path`` is ``"auto"`` also gets its dense-or-sparse choice from
    timing rather than from its activity threshold (``auto_max_active``, 1.25% of H): its sparse FFN with
    the chosen ``union`` against dense PyTorch on the same inputs (``dense_ms``, ``sparse_ms``); it
    stays sparse unless dense is at least ``min_gain`` faster. Trained layers with 1.5-1.9% active ran
    1.10-1.66x faster than dense with the rule, where the threshold sent them to dense
    (docs/kernels.md §8); a layer chosen dense still takes the decoding op on few rows where its
    activity was measured (``SparseFFN.decode_max_rows``). ``runs`` reports the outcome (``"sparse"``
    or ``"dense"``; None where nothing was timed: another path, ``timed=False``, a layer the union analysis does not cover (it
    keeps the threshold), a tracking layer, or inputs "auto" would not run on the kernels). The choice
    lasts until ``SparseFFN.reset_auto()`` or a new ``path``, which go back to the threshold; a later
    call with ``timed=False`` does not undo it.
    """
    from twell import kernels

    rule = check_union_rule(rule)
    if rule is None:
        raise ValueError("rule must be (ratio, base)")
    if not 0.0 <= min_share <= 1.0:
        raise ValueError(f"min_share must be in [0, 1], got {min_share}")
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
    ffns = sparse_ffns(model)
    if not ffns:
        raise ValueError("the model has no SparseFFN layers; build it with twell.model.build_model or load_pretrained")
    ok, why = kernels.available()
    if not ok:
        raise RuntimeError(f"choosing union paths needs the TwELL kernels: {why}")
    seen = capture_ffn_inputs(model, ffns, *args, **kwargs)
    for i, x in enumerate(seen):
        if x is None:
            raise RuntimeError(f"layer {i}: the SparseFFN was not called by the calibration forward")
    # Every layer is measured first and changed only after the last one: an error on layer k (out of
    # memory, say) leaves every layer's union and timed choice as they were (the calibration forward
    # itself may have measured an "auto" layer's activity, as any first call does).
    report, settings = [], []
    for i, f in enumerate(ffns):
        try:
            row, auto_choice = _choose_one(f, i, seen[i], kernels, rule, min_share, timed, reps, min_gain)
        except Exception as exc:
            exc.add_note(f"choose_union_paths: while measuring layer {i} (no layer's union or timed choice was changed)")
            raise
        seen[i] = None
        report.append(row)
        settings.append((f, row["union"], auto_choice))
    for f, union, auto_choice in settings:
        f.union = union
        if auto_choice is not None:
            f.set_auto_choice(*auto_choice)
    return report


def _choose_one(f, i: int, seen_x: torch.Tensor, kernels, rule, min_share: float, timed: bool, reps: int,
                min_gain: float) -> tuple[dict, Optional[tuple[bool, str]]]:
    """One layer's report row and, for a timed "auto" layer, its (dense?, note) choice."""
    x = seen_x.to(torch.bfloat16).contiguous()
    row = {"layer": i, "tokens": x.shape[0], "active_per_token": None,
           "blocks": -(-x.shape[0] // UNION_BLOCK), "union_blocks": 0, "share": 0.0, "per_row_ms": None,
           "union_ms": None, "union": (0.0, 0.0), "dense_ms": None, "sparse_ms": None, "runs": None, "why": ""}
    # Only where the layer runs the kernels on these inputs (as it received them, before the bf16 copy):
    # anything else would report and time a path the layer never takes.
    reason = _unsupported(f, x) or _not_on_kernels(f, seen_x)
    auto_choice = None
    time_auto = timed and reason is None and f.path == "auto"
    if reason is None:
        gate = kernels.twell_gate(x, f.gate_proj.weight, tile=f.tile, compression=f.compression)
        plan = kernels.union_plan(x, gate, f.up_proj.weight, f.w_down_t(), ratio=rule[0], base=rule[1])
        share = plan["union_blocks"] / row["blocks"]
        row.update(active_per_token=float(gate.nnz_per_row().float().mean()), union_blocks=plan["union_blocks"],
                   share=share)
        reason = f"{share:.0%} of blocks qualify ({'>=' if share >= min_share else '<'} {min_share:.0%})"
        if (time_auto or timed and share >= min_share) and x.shape[0] < MIN_TIMED_TOKENS:
            warnings.warn(f"layer {i}: {x.shape[0]} calibration tokens; below ~{MIN_TIMED_TOKENS} the timing of "
                          "the paths is noisy (the union / per-row ratio moved by up to 0.2 at 4096 tokens), so the "
                          "choice may flip between calls", stacklevel=3)  # the caller of choose_union_paths
        if share >= min_share and timed:
            per_row, union = ffn_times(f, x, rule, reps)
            row.update(per_row_ms=per_row, union_ms=union)
            reason += f"; sparse FFN {per_row:.3f} ms per-row, {union:.3f} ms with the rule"
            if union <= per_row * (1.0 - min_gain):
                row["union"] = rule
            else:
                reason += f" (needs {min_gain:.0%} less)"
        elif share >= min_share:
            row["union"] = rule
    if time_auto:
        dense, sparse = path_times(f, x, row["union"], reps)
        runs = "dense" if dense <= sparse * (1.0 - min_gain) else "sparse"
        row.update(dense_ms=dense, sparse_ms=sparse, runs=runs)
        verdict = f"{runs} (dense {dense:.3f} ms, sparse {sparse:.3f} ms)"
        reason += f"; auto runs {verdict}"
        active = 100 * row["active_per_token"] / f.intermediate_size
        auto_choice = (runs == "dense", f"auto: {verdict}, timed by choose_union_paths on "
                                        f"{x.shape[0]} tokens ({active:.2f}% active)")
    row["why"] = reason
    return row, auto_choice


def _median_ms(f, x: torch.Tensor, calls: dict[str, Optional[tuple[float, float]]], reps: int) -> dict[str, float]:
    """Median ms of each named call of the layer on x: None is its dense path (what ``_dense`` runs,
    untracked), a ``(ratio, base)`` its sparse FFN as the layer runs it (the one op) with that union
    setting. Alternating calls, L2 flushed before each, as the benchmark times them."""
    from twell import kernels
    from twell.timing import time_alternating

    wg, wu, wdt = f.gate_proj.weight, f.up_proj.weight, f.w_down_t()

    def call(union):
        if union is None:
            return lambda: f.down_proj(f.hidden(x)[1])
        return lambda: kernels.sparse_gated_ffn(x, wg, wu, wdt, f.tile, f.compression, union=union)

    with torch.no_grad():
        t = time_alternating({name: call(u) for name, u in calls.items()}, x.device, reps=reps, warmup=3)
    return {name: t[name].median_ms for name in calls}


def path_times(f, x: torch.Tensor, union: tuple[float, float], reps: int) -> tuple[float, float]:
    """Median ms of the layer's dense path and of its sparse FFN with ``union`` on x."""
    t = _median_ms(f, x, {"dense": None, "sparse": union}, reps)
    return t["dense"], t["sparse"]


def ffn_times(f, x: torch.Tensor, rule: tuple[float, float], reps: int) -> tuple[float, float]:
    """Median ms of the layer's sparse FFN on x, as the layer runs it (the one op): per-row kernel only,
    then with ``rule``."""
    t = _median_ms(f, x, {"per_row": (0.0, 0.0), "union": rule}, reps)
    return t["per_row"], t["union"]


def _not_on_kernels(f, seen_x: torch.Tensor) -> Optional[str]:
    """Why the layer would not run the kernels on ``seen_x`` (as it received it), or None."""
    if f.path == "auto":
        route, why = f.auto_route(seen_x)
        return None if route == "kernel" else f"path 'auto' runs {route} on these inputs ({why})"
    if f.path != "kernel" or f.track:
        return f"the layer does not run the kernels (path {f.path!r}{', tracking' if f.track else ''})"
    state = f.layer_state()
    return state.no_sparse_why or routing.dtype_why(state, seen_x) or None


def _unsupported(f, x: torch.Tensor) -> Optional[str]:
    from twell import kernels

    if not f.gated or f.activation != "relu":
        return "the union path serves gated ReLU layers only"
    if f.has_bias():
        return f.BIAS_ERROR
    if not x.is_cuda or f.gate_proj.weight.dtype != torch.bfloat16:
        return "the kernels need bf16 weights and inputs on the GPU"
    return kernels.union_unsupported(x.shape[1], f.gate_proj.weight.shape[0]) or None
