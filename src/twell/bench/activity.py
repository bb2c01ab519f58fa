"""Activity statistics of a ReLU gate, for comparing captured activations with the generator, and of
a trained checkpoint on held-out text (``python -m twell.bench activity``).

``union_reuse`` is the quantity a kernel that loads each weight row once per block of consecutive
tokens saves: active (token, neuron) pairs divided by the sizes of the blocks' unions of active
neurons (1 = no neuron shared inside a block, B = every token of a block uses the same neurons).

``model_activity_profile`` / ``checkpoint_activity``: active FFN neurons per token of a model, per
layer and per position in the sequence, on token blocks cut as the trainer cuts them (consecutive
``seq``-token blocks of a prepared split), the numbers that the trainer's ``positions`` records
estimate during training, here measured once on held-out documents.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
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


QUANTILES = (0.5, 0.9, 0.99)


def position_bins(seq: int, bins: int) -> list[int]:
    """Edges of ``min(bins, seq)`` near-equal position bins over ``[0, seq)`` (the trainer's binning)."""
    n = max(1, min(int(bins), int(seq)))
    return torch.linspace(0, seq, n + 1).round().long().tolist()


@torch.inference_mode()
def model_activity_profile(model, ids: torch.Tensor, *, batch: int = 8, bins: int = 32,
                           quantiles: Sequence[float] = QUANTILES) -> dict:
    """Active FFN neurons per token of ``model`` on ``ids`` [N, T] (N sequences of T tokens), run in
    batches of ``batch`` sequences on the model's device, every SparseFFN on its dense path (tracking).

    Returns per layer (lists of length L): ``active_mean_per_layer`` / ``active_frac_per_layer`` (mean
    over all tokens, count / fraction of H), ``active_quantiles_per_layer`` ({"p50": [L], ..., "max": [L]},
    exact, over tokens), ``dead_frac_per_layer`` (neurons active on none of these tokens); per position:
    ``active_per_position`` [L][T] (mean over sequences) and ``positions`` ({"edges", "active" [L][bins],
    "sequences"}, as the trainer's positions records); and ``ce`` (mean next-token cross-entropy).
    """
    from twell.model import set_tracking, sparse_ffns

    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise ValueError(f"ids must be [sequences >= 1, tokens >= 2], got shape {tuple(ids.shape)}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    ffns = sparse_ffns(model)
    if not ffns:
        raise ValueError("the model has no SparseFFN layers; load it with twell.model.load_pretrained")
    L, (N, T), H = len(ffns), ids.shape, ffns[0].intermediate_size
    device = next(model.parameters()).device
    pos_sum = torch.zeros(L, T, dtype=torch.float64, device=device)
    hist = torch.zeros(L, H + 1, dtype=torch.float64, device=device)  # tokens with k active neurons
    seen = torch.zeros(L, H, dtype=torch.bool, device=device)
    ce_sum = torch.zeros((), dtype=torch.float64, device=device)
    set_tracking(model, True)
    try:
        for s in range(0, N, batch):
            x = ids[s:s + batch].to(device)
            logits = model(input_ids=x, use_cache=False).logits
            ce_sum += F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                      reduction="sum").double()
            for layer, f in enumerate(ffns):
                apt = f.stats.active_per_token  # [b, T] int32
                pos_sum[layer] += apt.double().sum(0)
                hist[layer] += torch.bincount(apt.reshape(-1).long(), minlength=H + 1).double()
                seen[layer] |= f.stats.neuron_active
                f.stats = None
            del logits
    finally:
        set_tracking(model, False)
    per_pos = (pos_sum / N).cpu()
    cdf = (hist.cumsum(1) / hist.sum(1, keepdim=True)).cpu()
    q = {f"p{round(100 * p)}": [int(torch.searchsorted(cdf[l], torch.tensor(p, dtype=cdf.dtype)).clamp(max=H))
                                for l in range(L)] for p in quantiles}
    q["max"] = [int(hist[l].nonzero().max()) for l in range(L)]
    mean = per_pos.mean(1).tolist()
    edges = position_bins(T, bins)
    return {
        "sequences": N, "seq": T, "tokens": N * T, "layers": L, "intermediate_size": H,
        "ce": float(ce_sum) / (N * (T - 1)),
        "active_mean_per_layer": mean, "active_frac_per_layer": [m / H for m in mean],
        "active_frac_mean": sum(mean) / L / H,
        "active_quantiles_per_layer": q,
        "dead_frac_per_layer": (~seen).double().mean(1).tolist(),
        "active_per_position": per_pos.tolist(),
        "positions": {"edges": edges, "sequences": N,
                      "active": [[float(per_pos[l, a:b].mean()) for a, b in zip(edges[:-1], edges[1:])]
                                 for l in range(L)]},
    }


def checkpoint_activity(checkpoint: str | Path, tokens: str | Path, *, seq: int | None = None,
                        max_tokens: int | None = None, split: str = "val", device: str = "cpu",
                        dtype: torch.dtype = torch.bfloat16, batch: int = 8, bins: int = 32) -> dict:
    """:func:`model_activity_profile` of a checkpoint (directory or hub id) on the ``split`` of ``tokens``
    (a prepared data directory, or a ``.npy`` of ids): consecutive blocks of ``seq`` tokens (default:
    the model's context, at most 1024), as many whole blocks as the split holds, at most ``max_tokens``.
    Loaded in ``dtype`` (bf16: the dtype the sparse paths run). Adds ``checkpoint``, ``data`` (where the
    tokens came from) and ``trained`` (the run recorded in the checkpoint, when there is one)."""
    from twell.bench.captured import check_same_tokenizer, read_tokens
    from twell.model import load_pretrained

    model, _ = load_pretrained(str(checkpoint), ffn_path="dense", device=device, dtype=dtype, load_tokenizer=False)
    model.eval()
    max_pos = int(model.config.max_position_embeddings)
    seq = min(1024, max_pos) if seq is None else int(seq)
    if not 2 <= seq <= max_pos:
        raise ValueError(f"seq must be in [2, {max_pos}] (the model's context), got {seq}")
    ids, where = read_tokens(tokens, None, split)
    n_seq = len(ids) // seq if max_tokens is None else min(len(ids), int(max_tokens)) // seq
    if n_seq < 1:
        raise ValueError(f"{tokens}: {len(ids)} tokens{' in the ' + split + ' split' if 'split' in where else ''} "
                         f"(max_tokens {max_tokens}) hold no whole sequence of {seq}: lower seq")
    ids = np.array(ids[:n_seq * seq])  # a writable copy (a .npy comes memory-mapped)
    check_same_tokenizer(model.config, ids, where, tokens, checkpoint)
    out = model_activity_profile(model, torch.from_numpy(ids).view(n_seq, seq), batch=batch, bins=bins)
    cfg_file = Path(str(checkpoint)).expanduser() / "config.json"  # twell.train's export records its run there
    run = json.loads(cfg_file.read_text()).get("twell_run") if cfg_file.is_file() else None
    return {"checkpoint": str(checkpoint), "data": where, "trained": run,
            "dtype": str(dtype).replace("torch.", ""), "device": str(device), **out}
