"""How many passes over its training tokens a run makes, and the ``data.max_epochs`` limit.

Training cuts the training split into ``(N - 1) // seq_len`` blocks and draws ``steps x global_batch``
of them (:mod:`twell.data.loader`); a block is seen twice only once every block was seen once. So a
run sees no token twice exactly when ``steps x global_batch <= blocks``. ``data.max_epochs: 1`` asks
for that (a unique-token run, as the paper's single pass over FineWeb-Edu); the check refuses a run
that would need more, naming the largest ``train.steps`` that fits. Unset, any number of passes is
allowed (the small offline corpora make many).
"""
from __future__ import annotations

import math
from typing import Any


def check_max_epochs(value: Any) -> float | None:
    """``data.max_epochs``: None or a positive number (1 = every training token at most once)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"data.max_epochs must be a positive number of passes over the training tokens (1: each "
                         f"token at most once) or null for no limit, got {value!r}")
    return float(value)


def token_budget(*, n_blocks: int, seq_len: int, steps: int, global_batch: int) -> dict[str, Any]:
    """What a run of ``steps x global_batch`` sequences of ``seq_len`` takes from ``n_blocks`` blocks."""
    samples = steps * global_batch
    return {"blocks": n_blocks, "seq_len": seq_len, "samples": samples, "tokens_needed": samples * seq_len,
            "tokens_available": n_blocks * seq_len, "epochs": samples / n_blocks if n_blocks else math.inf,
            "max_unique_steps": n_blocks // global_batch}


def check_token_budget(*, n_blocks: int, seq_len: int, steps: int, global_batch: int, max_epochs: float | None,
                       label: str = "the training split") -> dict[str, Any]:
    """:func:`token_budget`, or ValueError when it exceeds ``max_epochs`` passes (None: no limit)."""
    b = token_budget(n_blocks=n_blocks, seq_len=seq_len, steps=steps, global_batch=global_batch)
    if max_epochs is None or b["samples"] <= max_epochs * n_blocks:
        return b
    fit = int(max_epochs * n_blocks) // global_batch
    raise ValueError(
        f"train.steps x train.global_batch x train.seq_len = {steps} x {global_batch} x {seq_len} = "
        f"{b['tokens_needed']:,} tokens, but {label} holds {b['tokens_available']:,} ({n_blocks:,} blocks of "
        f"{seq_len}) and data.max_epochs = {max_epochs:g} allows {max_epochs:g} pass(es): the run would see tokens "
        f"{'twice' if max_epochs == 1 else 'more often than allowed'} ({b['epochs']:.3f} passes). Lower train.steps to "
        f"at most {fit}, add training shards (data.shards), or raise data.max_epochs (null: no limit)")


def check_run_budget(cfg: Any, prepared: Any) -> dict[str, Any]:
    """:func:`check_token_budget` for a run config (``cfg.train``, ``cfg.data.max_epochs``) and its
    :class:`~twell.data.prepare.PreparedData`."""
    t = cfg.train
    n_blocks = max(0, (int(prepared.meta["n_train_tokens"]) - 1) // t.seq_len)
    return check_token_budget(n_blocks=n_blocks, seq_len=t.seq_len, steps=t.steps, global_batch=t.global_batch,
                              max_epochs=cfg.data.max_epochs, label=f"the training split of {prepared.label}")
