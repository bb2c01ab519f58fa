"""Activity statistics of a ReLU gate, for comparing captured activations with the generator.

``union_reuse`` is the quantity a kernel that loads each weight row once per block of consecutive
tokens saves: active (token, neuron) pairs divided by the sizes of the blocks' unions of active
neurons (1 = no neuron shared inside a block, B = every token of a block uses the same neurons).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

BLOCKS = (16, 64, 128, 256, 512, 1024)


def union_reuse(active: torch.Tensor, blocks: Iterable[int] = BLOCKS) -> dict[int, float]:
    """{B: active pairs / sum over blocks of |union|} for a bool [M, H] activity matrix (rows in
    sequence order); the last M % B rows are left out. A block size larger than M is skipped."""
    if active.dtype != torch.bool or active.dim() != 2:
        raise ValueError(f"active must be a 2-D bool tensor, got {active.dtype} with shape {tuple(active.shape)}")
    out: dict[int, float] = {}
    for b in blocks:
        if b < 1:
            raise ValueError(f"block sizes must be >= 1, got {b}")
        m = active.shape[0] // b * b
        if m == 0:
            continue
        blk = active[:m].view(-1, b, active.shape[1])
        out[b] = blk.sum().item() / max(1, blk.any(1).sum().item())
    return out


def gate_activity(x: torch.Tensor, w_gate: torch.Tensor, tile: int = 256,
                  blocks: Iterable[int] = BLOCKS) -> dict:
    """Activity of relu(x @ w_gate^T) rounded to x's dtype: mean / max active neurons per row, max
    per tile of ``tile`` columns, fraction of neurons never active, and ``union_reuse``."""
    active = F.relu(F.linear(x, w_gate)) != 0
    per_row = active.sum(1)
    H = active.shape[1]
    tiles = F.pad(active.to(torch.uint8), (0, -H % tile)).view(active.shape[0], -1, tile).sum(-1)
    return {"mean_active": per_row.float().mean().item(), "max_active": int(per_row.max()),
            "max_per_tile": int(tiles.max()), "dead_frac": (active.sum(0) == 0).float().mean().item(),
            "reuse": {b: round(r, 3) for b, r in union_reuse(active, blocks).items()}}
