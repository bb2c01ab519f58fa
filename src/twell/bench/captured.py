"""FFN inputs captured from a trained sparse checkpoint: the benchmark's real-activation cases.

shared/BENCHMARK.md calls activations captured from a trained sparse model "the best input of all".
``capture_ffn_inputs`` runs a checkpoint (directory or hub id, ``twell.model.load_pretrained``) on
tokens of a prepared data directory, sequences in order, with every FFN on its dense path, and keeps
what each SparseFFN layer receives (the post-attention-norm hidden state, [tokens, D]) next to that
layer's weights. The benchmark then times dense and sparse FFNs on exactly those inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch


@dataclass
class CapturedLayer:
    """What one SparseFFN layer saw: x [M, D] and its weights in nn.Linear layouts, all bf16 on CPU."""

    layer: int
    x: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """(M, D, H)."""
        return self.x.shape[0], self.x.shape[1], self.w_gate.shape[0]


@dataclass
class CapturedInputs:
    """Every captured layer plus where the inputs came from (for the report)."""

    layers: list[CapturedLayer]
    source: dict


TOKENIZER_KEYS = ("kind", "name", "vocab_size", "trained_on")  # what says two tokenizers are the same


def read_tokens(tokens: str | Path, count: int | None, split: str = "val") -> tuple[np.ndarray, dict]:
    """The first ``count`` tokens (None: all) of a prepared data directory's split (twell.data.prepare)
    or of a ``.npy`` file of token ids, as int64, with a description of where they came from (for a
    prepared directory, ``tokenizer``: the tokenizer it was made with)."""
    from twell.data.prepare import PreparedData, is_prepared_dir

    path = Path(tokens).expanduser()
    if is_prepared_dir(str(path)):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        data = PreparedData.load(path)
        ids, where = data.tokens(split), {"tokens": str(path), "split": split, "label": data.label,
                                          "tokenizer": data.tokenizer_choice}
    elif path.suffix == ".npy" and path.is_file():
        ids, where = np.load(path, mmap_mode="r"), {"tokens": str(path)}
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{path}: expected a 1-D integer array of token ids, got {ids.dtype} {ids.shape}")
    else:
        raise FileNotFoundError(f"tokens: expected a prepared data directory (with meta.json, made by "
                                f"twell.data.prepare) or a .npy file of token ids, got {str(tokens)!r}")
    if count is None:
        count = len(ids)
    if len(ids) < count:
        raise ValueError(f"{path}: {len(ids)} tokens{' in the ' + split + ' split' if 'split' in where else ''}, "
                         f"need {count} (whole sequences: lower the token count or the sequence length)")
    out = np.asarray(ids[:count], dtype=np.int64)
    if count and int(out.min()) < 0:
        raise ValueError(f"{path}: negative token id {int(out.min())}")
    return out, where


def check_same_tokenizer(config, ids: np.ndarray, where: dict, tokens, checkpoint) -> None:
    """Raise ValueError when token ids from ``tokens`` (``read_tokens``' ``ids`` and ``where``) cannot be
    text for the model of ``config`` (a transformers config): an id outside its vocabulary, or a data
    directory that records another tokenizer than the checkpoint was trained with."""
    vocab = int(config.vocab_size)
    if len(ids) and int(ids.max()) >= vocab:
        raise ValueError(f"token id {int(ids.max())} of {tokens} is outside the model's vocabulary ({vocab}): "
                         "the tokens were made with another tokenizer")
    # Ids that fit the vocabulary can still come from another tokenizer, which would give activations
    # of nonsense text: compare what the checkpoint and the data directory record.
    ours, theirs = getattr(config, "twell_tokenizer", None) or {}, where.get("tokenizer") or {}
    differ = {k: (ours[k], theirs[k]) for k in TOKENIZER_KEYS if k in ours and k in theirs and ours[k] != theirs[k]}
    if differ:
        raise ValueError(f"{tokens} was tokenised with another tokenizer than {checkpoint} was trained with "
                         f"(checkpoint vs data: {differ})")


def capture_ffn_inputs(checkpoint: str | Path, tokens: str | Path, n_tokens: int, seq: int | None = None, *,
                       layers: Sequence[int] | None = None, split: str = "val", device="cpu",
                       batch: int = 8, progress: bool = True) -> CapturedInputs:
    """Run ``checkpoint`` on ``n_tokens`` tokens (sequences of ``seq``, default the model's context up to
    1024, in order) and return each chosen SparseFFN layer's input and weights (bf16, on CPU).

    ``layers``: indices of the SparseFFN layers to keep (default all). The FFNs run their dense path
    while capturing, so the inputs do not depend on the kernels. Host memory: n_tokens x D x 2 bytes
    per kept layer (268 MB at 65536 tokens and D = 2048).
    """
    from twell.model import load_pretrained
    from twell.model.llama import sparse_ffns
    from twell.nn.ffn import call_input

    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    model, _ = load_pretrained(checkpoint, ffn_path="dense", device=device, dtype=torch.bfloat16,
                               load_tokenizer=False)
    model.eval()
    ffns = sparse_ffns(model)
    if not ffns:
        raise ValueError(f"{checkpoint}: the model has no SparseFFN layers")
    keep = list(range(len(ffns))) if layers is None else [int(i) for i in layers]
    bad = [i for i in keep if not 0 <= i < len(ffns)]
    if bad or len(set(keep)) != len(keep):
        raise ValueError(f"layers must be distinct indices in [0, {len(ffns)}), got {list(layers)}")
    unfit = [i for i in keep if not ffns[i].gated or ffns[i].activation != "relu" or ffns[i].has_bias()]
    if unfit:
        raise ValueError(f"{checkpoint}: layers {unfit} are not bias-free ReLU-gated FFNs; the benchmark "
                         "times relu(x Wg^T) * (x Wu^T) Wd^T only")
    max_pos = int(model.config.max_position_embeddings)
    seq = min(1024, max_pos, n_tokens) if seq is None else int(seq)
    if not 1 <= seq <= max_pos:
        raise ValueError(f"seq must be in [1, {max_pos}] (the model's context), got {seq}")
    n_seq = -(-n_tokens // seq)
    ids, where = read_tokens(tokens, n_seq * seq, split)
    check_same_tokenizer(model.config, ids, where, tokens, checkpoint)
    ids = torch.from_numpy(ids).view(n_seq, seq)

    chunks: dict[int, list[torch.Tensor]] = {i: [] for i in keep}

    def hook(i):
        def pre(_mod, args, kw):
            x = call_input(args, kw)
            chunks[i].append(x.reshape(-1, x.shape[-1]).to("cpu", torch.bfloat16))
        return pre

    handles = [ffns[i].register_forward_pre_hook(hook(i), with_kwargs=True) for i in keep]
    bar = None
    if progress:
        try:
            from twell.progress import progress_bar

            bar = progress_bar(total=n_seq, desc="capture FFN inputs", unit="seq")
        except ImportError:
            bar = None
    try:
        with torch.no_grad():
            for s in range(0, n_seq, batch):
                # The decoder alone: the hooks have what they need, and no vocabulary-wide logits are made.
                model.model(input_ids=ids[s:s + batch].to(device), use_cache=False)
                if bar is not None:
                    bar.update(min(batch, n_seq - s))
    finally:
        for h in handles:
            h.remove()
        if bar is not None:
            bar.close()
    out = []
    for i in keep:
        f = ffns[i]
        w = [t.detach().to("cpu", torch.bfloat16).contiguous()
             for t in (f.gate_proj.weight, f.up_proj.weight, f.down_proj.weight)]
        out.append(CapturedLayer(i, torch.cat(chunks.pop(i))[:n_tokens].contiguous(), *w))
    source = {"checkpoint": str(checkpoint), **where, "n_tokens": n_tokens, "seq": seq,
              "layers": keep, "n_ffn_layers": len(ffns)}
    return CapturedInputs(out, source)
