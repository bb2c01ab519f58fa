"""Batches from a memory-mapped token file: fixed blocks, a deterministic order, sharded by rank.

The token stream is cut into ``n = (N - 1) // seq_len`` blocks; block ``b`` is the input
``tokens[b*L : b*L + L]`` and the target shifted by one. Training draws global sample ``g``
(``g = step * global_batch + i``) from epoch ``g // n`` at position ``perm_epoch[g % n]``, where
``perm_epoch`` is a permutation seeded by ``(seed, epoch)``. The data order is therefore a pure
function of the step: resuming at step ``s`` continues exactly, and splitting a step's
``global_batch`` over ranks and micro-batches visits the same sequences as one process does.

``TrainOrder(..., max_epochs=1)`` refuses any sample past the first pass, so a unique-token run
(``data.max_epochs``) cannot repeat a block even when the up-front check (:mod:`twell.data.budget`)
was skipped.
"""
from __future__ import annotations

import numpy as np
import torch


class TokenBlocks:
    """Fixed-length blocks of a flat token array (np.memmap or ndarray of uint16/uint32)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str = "tokens"):
        if seq_len <= 0:
            raise ValueError(f"expected seq_len > 0, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.n_blocks = max(0, (len(tokens) - 1) // seq_len)
        if self.n_blocks == 0:
            raise ValueError(f"{name} holds {len(tokens)} tokens, fewer than one block of seq_len+1={seq_len + 1}; "
                             "use a shorter train.seq_len or more data")

    def get(self, block_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [len(block_ids), seq_len]."""
        L = self.seq_len
        rows = np.stack([np.asarray(self.tokens[b * L: b * L + L + 1], dtype=np.int64) for b in block_ids])
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]


class TrainOrder:
    """The deterministic, epoch-wise shuffled order of training blocks (see module docstring)."""

    def __init__(self, blocks: TokenBlocks, seed: int, *, max_epochs: float | None = None):
        self.blocks = blocks
        self.seed = int(seed)
        self.max_epochs = max_epochs  # None: any number of passes
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
            self._perms[epoch] = rng.permutation(self.blocks.n_blocks)
        return self._perms[epoch]

    def block_ids(self, start: int, count: int) -> np.ndarray:
        """Block ids of global samples ``start .. start + count - 1``."""
        n = self.blocks.n_blocks
        if self.max_epochs is not None and start + count > self.max_epochs * n:
            raise ValueError(f"training sample {start + count - 1} is past data.max_epochs = {self.max_epochs:g} "
                             f"pass(es) over the {n} training blocks: the run would repeat tokens; lower train.steps "
                             "or add training data (see twell.data.budget.check_token_budget)")
        g = np.arange(start, start + count, dtype=np.int64)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(g // n):
            sel = (g // n) == epoch
            out[sel] = self._perm(int(epoch))[g[sel] % n]
        return out

    def micro_batch(self, step: int, micro: int, *, rank: int, world: int, micro_batch: int,
                    global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``micro``-th micro-batch of ``step`` for ``rank`` (inputs, targets: int64 [micro_batch, L])."""
        start = step * global_batch + (micro * world + rank) * micro_batch
        return self.blocks.get(self.block_ids(start, micro_batch))

    def epochs(self, samples: int) -> float:
        """How many passes over the training blocks ``samples`` sequences make."""
        return samples / self.blocks.n_blocks


def val_block_count(blocks: TokenBlocks, *, max_tokens: int | None, world: int, micro_batch: int) -> int:
    """How many validation blocks :func:`val_shards` uses: the first ``max_tokens // seq_len`` (all when
    None), rounded down to a multiple of ``world * micro_batch`` so every rank runs the same number of
    forwards; ValueError, naming the setting, when that leaves none."""
    n = blocks.n_blocks if max_tokens is None else min(blocks.n_blocks, max(1, max_tokens // blocks.seq_len))
    per_round = world * micro_batch
    n = (n // per_round) * per_round
    if n == 0:
        if blocks.n_blocks >= per_round:  # the split is large enough: max_tokens took too few of its blocks
            raise ValueError(f"train.eval_tokens = {max_tokens} gives {max(1, max_tokens // blocks.seq_len)} validation "
                             f"blocks of {blocks.seq_len} tokens, fewer than world x eval micro-batch = {per_round}; "
                             "raise train.eval_tokens or lower train.eval_micro_batch")
        raise ValueError(f"the validation split has {blocks.n_blocks} blocks of {blocks.seq_len} tokens, fewer than "
                         f"world x eval micro-batch = {per_round}; lower train.eval_micro_batch or raise data.val_fraction")
    return n


def val_shards(blocks: TokenBlocks, *, max_tokens: int | None, rank: int, world: int, micro_batch: int):
    """Yield this rank's validation micro-batches (inputs, targets), in order, equal counts on every rank
    (the blocks :func:`val_block_count` counts)."""
    n = val_block_count(blocks, max_tokens=max_tokens, world=world, micro_batch=micro_batch)
    per_round = world * micro_batch
    for r in range(n // per_round):
        start = r * per_round + rank * micro_batch
        yield blocks.get(np.arange(start, start + micro_batch))
