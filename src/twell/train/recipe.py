"""The sparsity recipe: cross-entropy plus an L1 penalty on the FFN hidden activations.

loss = CE + coef * mean over layers of l1_layer, where l1_layer = |h| summed over the hidden
units, averaged over tokens (``SparseFFN.stats.l1``, with h = relu(gate) * up). This matches the
paper's code (sum over hidden units, mean over tokens, mean over layers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from twell.nn import SparseFFN


@dataclass
class LossParts:
    loss: torch.Tensor  # what backward() runs on
    ce: torch.Tensor  # detached
    l1: torch.Tensor  # detached: mean over layers


def l1_penalty(ffns: Sequence[SparseFFN]) -> torch.Tensor:
    """Mean over layers of each layer's ``stats.l1`` (in the graph). Needs ``track=True`` and a forward."""
    if not ffns:
        raise ValueError("no SparseFFN layers: the L1 penalty needs a model built by twell.model")
    missing = [i for i, f in enumerate(ffns) if f.stats is None]
    if missing:
        raise RuntimeError(f"SparseFFN layers {missing} recorded no stats; call twell.model.set_tracking(model) "
                           "before the forward (a train_backend must fill ffn.stats too)")
    return torch.stack([f.stats.l1 for f in ffns]).mean()


def sparse_lm_loss(logits: torch.Tensor, targets: torch.Tensor, ffns: Sequence[SparseFFN], coef: float) -> LossParts:
    """CE over all positions (fp32) + coef * L1. logits [B, T, V], targets int64 [B, T]."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"expected logits [B, T, V] matching targets [B, T], got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    l1 = l1_penalty(ffns)
    loss = ce + coef * l1 if coef > 0 else ce  # coef 0: keep the L1 graph out of backward
    return LossParts(loss=loss, ce=ce.detach(), l1=l1.detach())
