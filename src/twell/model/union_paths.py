"""Per-layer choice of the fused kernel's block-union path from a calibration batch.

The block-union path (csrc/twell_union.cu) pays on layers whose tokens share many active neurons
and loses on the others: its plan costs ~0.1 ms per call at 65536 tokens even where no block
qualifies (csrc/NOTES.md, session 19). So rather than one process-wide setting, each SparseFFN gets
its own ``union``: the fitted rule where most blocks of a calibration batch qualify, off elsewhere.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from twell.model.llama import sparse_ffns
from twell.reference.ffn import UNION_RULE, check_union_rule


def choose_union_paths(model: nn.Module, *args: Any, rule: tuple[float, float] = UNION_RULE,
                       min_share: float = 0.5, **kwargs: Any) -> list[dict]:
    """Run ``model(*args, **kwargs)`` once without gradients, and give every SparseFFN layer
    ``union = rule`` when at least ``min_share`` of its 64-token blocks would take the union path on the
    inputs it saw, else ``union = (0, 0)`` (per-row kernel only; overrides TWELL_UNION_*).

    Needs the kernels (an H100). Layers the union path cannot serve (not gated, not ReLU, biased, or a
    shape outside ``kernels.union_unsupported``: D a multiple of 512 up to 2048, H up to 8192) get
    ``(0, 0)``, with the reason in ``why``. Returns one dict per layer: ``layer``, ``tokens``,
    ``active_per_token``, ``blocks``, ``union_blocks``, ``share``, ``union`` and ``why``.
    Feed batches like the ones you will serve: the share depends on how consecutive tokens share
    neurons, so sequences should be in order.
    """
    from twell import kernels

    rule = check_union_rule(rule)
    if rule is None:
        raise ValueError("rule must be (ratio, base)")
    if not 0.0 <= min_share <= 1.0:
        raise ValueError(f"min_share must be in [0, 1], got {min_share}")
    ffns = sparse_ffns(model)
    if not ffns:
        raise ValueError("the model has no SparseFFN layers; build it with twell.model.build_model or load_pretrained")
    ok, why = kernels.available()
    if not ok:
        raise RuntimeError(f"choosing union paths needs the TwELL kernels: {why}")
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(ffns))}
    hooks = [f.register_forward_pre_hook(lambda mod, a, i=i: seen[i].append(a[0].detach().reshape(-1, a[0].shape[-1])))
             for i, f in enumerate(ffns)]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    report = []
    for i, f in enumerate(ffns):
        if not seen[i]:
            raise RuntimeError(f"layer {i}: the SparseFFN was not called by the calibration forward")
        x = torch.cat(seen[i]).to(torch.bfloat16).contiguous()
        seen[i] = []
        row = {"layer": i, "tokens": x.shape[0], "active_per_token": None, "blocks": -(-x.shape[0] // 64),
               "union_blocks": 0, "share": 0.0, "union": (0.0, 0.0), "why": ""}
        reason = _unsupported(f, x)
        if reason is None:
            gate = kernels.twell_gate(x, f.gate_proj.weight, tile=f.tile, compression=f.compression)
            plan = kernels.union_plan(x, gate, f.up_proj.weight, f.w_down_t(), ratio=rule[0], base=rule[1])
            share = plan["union_blocks"] / row["blocks"]
            row.update(active_per_token=float(gate.nnz_per_row().float().mean()), union_blocks=plan["union_blocks"],
                       share=share)
            if share >= min_share:
                row["union"] = rule
                reason = f"{share:.0%} of blocks qualify (>= {min_share:.0%})"
            else:
                reason = f"{share:.0%} of blocks qualify (< {min_share:.0%})"
        f.union = row["union"]
        row["why"] = reason
        report.append(row)
    return report


def _unsupported(f, x: torch.Tensor) -> Optional[str]:
    from twell import kernels

    if not f.gated or f.activation != "relu":
        return "the union path serves gated ReLU layers only"
    if f.has_bias():
        return f.BIAS_ERROR
    if not x.is_cuda or f.gate_proj.weight.dtype != torch.bfloat16:
        return "the kernels need bf16 weights and inputs on the GPU"
    return kernels.union_unsupported(x.shape[1], f.gate_proj.weight.shape[0]) or None
