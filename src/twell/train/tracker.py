"""Per-layer sparsity statistics over training: what every step's JSONL record reports.

After each forward, :meth:`SparsityTracker.observe` reads each SparseFFN's ``stats``
(``active_per_token`` [B, T], ``neuron_active`` [H]) and accumulates on the device; at the end of
the optimizer step :meth:`end_step` reduces over ranks (one all-reduce) and returns

- ``active_mean`` / ``active_max``: active neurons per token, per layer (mean / max over the step's tokens)
- ``dead_frac``: per layer, the fraction of neurons that stayed silent for ``window_tokens``
  tokens (a per-neuron "tokens since last active" counter, reset whenever the neuron fires)

Active neurons by token position are accumulated across steps and read with :meth:`positions`.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from twell.nn import SparseFFN


class SparsityTracker:
    def __init__(self, n_layers: int, width: int, seq_len: int, *, window_tokens: int, device, position_bins: int = 32):
        if window_tokens <= 0:
            raise ValueError(f"expected window_tokens > 0, got {window_tokens}")
        self.n_layers, self.width, self.seq_len = n_layers, width, seq_len
        self.window_tokens = int(window_tokens)
        self.device = torch.device(device)
        self.bins = max(1, min(position_bins, seq_len))
        self.since = torch.zeros(n_layers, width, dtype=torch.int64, device=self.device)
        self.pos_sum = torch.zeros(n_layers, seq_len, dtype=torch.float64, device=self.device)
        self.pos_seqs = 0
        self._new_step()

    def _new_step(self) -> None:
        L, H, T = self.n_layers, self.width, self.seq_len
        self._sum = torch.zeros(L, dtype=torch.float64, device=self.device)
        self._max = torch.zeros(L, dtype=torch.float64, device=self.device)
        self._seen = torch.zeros(L, H, dtype=torch.bool, device=self.device)
        self._pos = torch.zeros(L, T, dtype=torch.float64, device=self.device)
        self._tokens = 0
        self._seqs = 0

    @torch.no_grad()
    def observe(self, ffns: Sequence[SparseFFN]) -> None:
        """Accumulate one forward's statistics (call after every micro-batch forward)."""
        if len(ffns) != self.n_layers:
            raise ValueError(f"expected {self.n_layers} SparseFFN layers, got {len(ffns)}")
        apt = torch.stack([f.stats.active_per_token for f in ffns])  # [L, B, T]
        if apt.dim() != 3 or apt.shape[2] != self.seq_len:
            raise ValueError(f"expected active_per_token of shape [B, {self.seq_len}] per layer, got {tuple(apt.shape[1:])}")
        apt = apt.to(torch.float64)
        self._sum += apt.sum((1, 2))
        self._max = torch.maximum(self._max, apt.amax((1, 2)))
        self._pos += apt.sum(1)
        self._seen |= torch.stack([f.stats.neuron_active for f in ffns])
        self._tokens += apt.shape[1] * apt.shape[2]
        self._seqs += apt.shape[1]

    @torch.no_grad()
    def end_step(self, as_lists: bool = True) -> dict:
        """Reduce the step over ranks, update the dead-neuron counters, return this step's numbers.

        as_lists=False returns device tensors [L] instead of lists (no host sync; the loop converts
        only the steps it logs).
        """
        if self._tokens == 0:
            raise RuntimeError("end_step() without any observe() in this step")
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        tokens, seqs = self._tokens * world, self._seqs * world  # every rank sees the same batch shape
        if world > 1:
            packed = torch.cat([self._sum, self._pos.flatten()])
            dist.all_reduce(packed)
            dist.all_reduce(self._max, op=dist.ReduceOp.MAX)
            seen = self._seen.to(torch.uint8)
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
            self._seen = seen.bool()
            L, T = self.n_layers, self.seq_len
            self._sum, self._pos = packed[:L], packed[L:].view(L, T)
        self.since = torch.where(self._seen, torch.zeros_like(self.since), self.since + tokens)
        self.pos_sum += self._pos
        self.pos_seqs += seqs
        out = {"active_mean": self._sum / tokens, "active_max": self._max,
               "dead_frac": self.dead_mask().double().mean(1)}
        self._new_step()
        return {k: v.tolist() for k, v in out.items()} if as_lists else out

    def dead_mask(self) -> torch.Tensor:
        """bool [L, H]: neurons silent for at least ``window_tokens`` tokens."""
        return self.since >= self.window_tokens

    def revive(self, mask: torch.Tensor) -> None:
        """Reset the silence counters of re-initialised neurons."""
        self.since[mask] = 0

    @torch.no_grad()
    def positions(self, reset: bool = True) -> dict:
        """Mean active neurons per token by position bin, per layer, since the last call."""
        if self.pos_seqs == 0:
            return {}
        edges = torch.linspace(0, self.seq_len, self.bins + 1).round().long().tolist()
        mean = (self.pos_sum / self.pos_seqs).cpu()  # [L, T]; one device sync
        binned = [[float(mean[l, a:b].mean()) for a, b in zip(edges[:-1], edges[1:])] for l in range(self.n_layers)]
        out = {"edges": edges, "active": binned, "sequences": self.pos_seqs}
        if reset:
            self.pos_sum.zero_()
            self.pos_seqs = 0
        return out

    def state_dict(self) -> dict:
        return {"since": self.since.cpu(), "pos_sum": self.pos_sum.cpu(), "pos_seqs": self.pos_seqs,
                "window_tokens": self.window_tokens}

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["since"].shape) != tuple(self.since.shape):
            raise ValueError(f"tracker state for {tuple(state['since'].shape)} neurons, model has {tuple(self.since.shape)}")
        self.since = state["since"].to(self.device)
        self.pos_sum = state["pos_sum"].to(self.device)
        self.pos_seqs = int(state["pos_seqs"])


def dim0_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the rows this rank holds, index of its first row in the full tensor) for a tensor sharded on dim 0.

    A plain tensor is all rows (offset 0). A DTensor (FSDP2's parameters and their AdamW moments) holds,
    along each mesh dimension that shards dim 0, the chunk ``torch.chunk`` gives that rank: chunks of
    ceil(rows / ranks) rows, the last ones shorter or empty (FSDP2 pads them in storage only; ``to_local``
    is the unpadded view, and under no_grad it is the parameter's own storage, so writes reach it).
    Replicated mesh dimensions (HSDP) keep every row of the shard on each replica.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return t, 0
    start, rows = 0, t.shape[0]
    for i, p in enumerate(t.placements):
        if isinstance(p, Replicate):
            continue
        if type(p) is not Shard or p.dim != 0:  # e.g. _StridedShard (FSDP over tensor parallel) interleaves rows
            raise NotImplementedError(f"re-initialising rows of a tensor placed {t.placements} (only dim-0 sharding)")
        n, r = t.device_mesh.size(i), t.device_mesh.get_local_rank(i)
        chunk = -(-rows // n)
        lo, hi = min(r * chunk, rows), min((r + 1) * chunk, rows)
        start, rows = start + lo, hi - lo
    local = t.to_local()
    if local.shape[0] != rows:
        raise RuntimeError(f"expected {rows} local rows from row {start} of a {tuple(t.shape)} tensor placed "
                           f"{t.placements}, got {tuple(local.shape)}")
    return local, start


def _write_rows(t: torch.Tensor, idx: torch.Tensor, values: torch.Tensor | float) -> None:
    """``t[idx] = values`` (rows of the full tensor) on whichever of them this rank holds."""
    local, start = dim0_rows(t)
    mine = (idx >= start) & (idx < start + local.shape[0])
    if not bool(mine.any()):
        return
    rows = (idx[mine] - start).to(local.device)
    if isinstance(values, torch.Tensor):
        local[rows] = values[mine].to(local.device, local.dtype)
    else:
        local[rows] = values


@torch.no_grad()
def reinit_dead_gates(ffns: Sequence[SparseFFN], dead: torch.Tensor, optimizer: torch.optim.Optimizer, *,
                      std: float, generator: torch.Generator) -> int:
    """Re-draw the gate rows (``up_proj`` rows for non-gated FFNs) of dead neurons from N(0, std).

    Their AdamW moments are zeroed so the old statistics do not drive the fresh weights. Returns
    how many neurons were re-initialised.

    Under FSDP2 every rank must call it with the same ``dead`` mask and a generator in the same state
    (the tracker's counters are reduced over ranks, so its mask is global): each rank draws the full
    [n_dead, D] block of every layer, in the same order as one process does, and writes only the rows
    of its own shard of the weight and of the moments (no all-gather). The weights are then those one
    process would get from the same state and generator.
    """
    n = 0
    for layer, ffn in enumerate(ffns):
        idx = dead[layer].nonzero().flatten().cpu()
        if idx.numel() == 0:
            continue
        w = ffn.gate_proj.weight if ffn.gated else ffn.up_proj.weight
        fresh = torch.randn(idx.numel(), w.shape[1], generator=generator) * std
        _write_rows(w, idx, fresh)
        state = optimizer.state.get(w, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                _write_rows(state[key], idx, 0.0)
        n += idx.numel()
    return n
