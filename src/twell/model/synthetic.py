"""Random-weight checkpoints of the public ReLU-family models' shapes, their FATReLU gates calibrated to a
chosen activity: what the end-to-end decoding benchmark runs when the real weights cannot be downloaded.

A FATReLU neuron is active where its gate ``g = x . w_gate`` is above the model's threshold ``t``. Scaling a
layer's gate weights by ``s`` scales ``g`` by ``s``, so the layer keeps a fraction ``a`` of its neurons
active on given inputs when ``s = t / q``, with ``q`` the ``1 - a`` quantile of its unscaled gate values.
:func:`calibrate_fatrelu` does that layer by layer, each on the inputs the calibrated layers before it
give (a random model's residual stream changes with every layer), and measures what it got. The
threshold stays the model's own (ProSparse's 0.01), so the checkpoint is in the format's config and
loads through :func:`twell.model.load_pretrained` like the real one.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from twell.model.config import ModelConfig

# The public checkpoints' shapes from their config.json files (docs/models.md), and a tiny one for tests.
SHAPES = {
    "prosparse-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                         num_kv_heads=32, ffn="fatrelu_gated", gate_threshold=0.01, rope_theta=10000.0,
                         max_position_embeddings=4096, tie_embeddings=False, bos_token_id=1, eos_token_id=2),
    "prosparse-13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40,
                          num_kv_heads=40, ffn="fatrelu_gated", gate_threshold=0.01, rope_theta=10000.0,
                          max_position_embeddings=4096, tie_embeddings=False, bos_token_id=1, eos_token_id=2),
    "tiny-fatrelu": dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                         num_kv_heads=2, ffn="fatrelu_gated", gate_threshold=0.01, rope_theta=10000.0,
                         max_position_embeddings=256, tie_embeddings=False, bos_token_id=1, eos_token_id=2),
}


def shape_config(shape: str) -> ModelConfig:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    return ModelConfig(**SHAPES[shape])


def calibrate_fatrelu(model, ids: torch.Tensor, active: float, progress: bool = True) -> list[float]:
    """Scale every FATReLU layer's gate weights so that a fraction ``active`` of its neurons is active on the
    inputs ``ids`` give it (in layer order, after the layers before it). Returns the measured fraction per
    layer (bf16 gates against the threshold, as every path compares). In place; no gradients."""
    from twell.model.llama import capture_ffn_inputs, sparse_ffns
    from twell.progress import progress_bar

    if not 0.0 < active < 0.5:
        raise ValueError(f"active must be a fraction in (0, 0.5) (the gate's upper quantile is positive), got {active}")
    ffns = sparse_ffns(model)
    if not ffns or any(f.activation != "fatrelu" or f.threshold <= 0 for f in ffns):
        raise ValueError("calibrate_fatrelu needs a model whose every MLP is FATReLU with a threshold > 0")
    measured = []
    bar = progress_bar(total=len(ffns), desc="calibrating gates", progress=progress)
    for f in ffns:
        x = capture_ffn_inputs(model, [f], input_ids=ids)[0]
        w = f.gate_proj.weight
        with torch.no_grad():
            g = F.linear(x, w).float().flatten()
            q = float(g.kthvalue(max(1, int(round((1.0 - active) * g.numel())))).values)
            if not math.isfinite(q) or q <= 0:
                raise RuntimeError(f"the gate's {1 - active:.3f} quantile is {q}: no positive scale reaches {active}")
            w.mul_(f.threshold / q)
            measured.append(float((F.linear(x, w) > f.threshold).float().mean()))
        bar.update(1)
    bar.close()
    return measured


def synthetic_checkpoint(shape: str, out: str | Path, active: float, *, seed: int = 0, device: Optional[str] = None,
                         calib_tokens: int = 2048, progress: bool = True) -> dict:
    """Build a random model of ``shape`` (transformers' Llama initialisation, seeded), calibrate its gates to
    ``active`` on ``calib_tokens`` random token ids, and save it in bf16 to ``out``. Returns what it wrote:
    the shape, the target and the measured activity per layer (also in config.json, ``twell_synthetic``)."""
    from twell.model.hub import save_pretrained
    from twell.model.llama import build_model

    mc = shape_config(shape)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(seed)
    with device:
        model = build_model(mc).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(seed + 1)
    seq = min(512, mc.max_position_embeddings)
    ids = torch.randint(0, mc.vocab_size, (max(1, calib_tokens // seq), seq), generator=g).to(device)
    measured = calibrate_fatrelu(model, ids, active, progress=progress)
    info = {"shape": shape, "seed": seed, "target_active": active, "calib_tokens": int(ids.numel()),
            "measured_active": [round(a, 5) for a in measured]}
    save_pretrained(model, None, out, dtype=torch.bfloat16, extra_config={"twell_synthetic": info})
    return info
