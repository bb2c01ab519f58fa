"""Learning-rate and L1-coefficient schedules (pure functions of the step, so resuming is exact)."""
from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps`` (step 0 gets lr/warmup), then cosine to ``lr*min_lr_ratio``."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay)
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def l1_coef_at(step: int, *, coef: float, warmup_steps: int) -> float:
    """The L1 coefficient: ``coef``, ramped linearly from coef/warmup at step 0 when ``warmup_steps`` > 0."""
    if warmup_steps > 0 and step < warmup_steps:
        return coef * (step + 1) / warmup_steps
    return coef
