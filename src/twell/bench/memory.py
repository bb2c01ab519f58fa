"""Peak device memory of a call above what is already allocated (inputs, weights)."""
from __future__ import annotations

from typing import Callable

import torch


def peak_memory_above_baseline(fn: Callable[[], object], device: torch.device | str) -> int | None:
    """Bytes of ``max_memory_allocated`` during fn() above the memory allocated before it.

    Counts everything fn allocates and still holds at its peak, its output included; the
    output is dropped before returning. None on CPU (no allocator statistics).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return int(peak - baseline)
