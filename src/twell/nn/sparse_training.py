"""``SparseFFN.train_backend`` on the sparse training kernels, with a per-layer dense switch.

A layer trains through :func:`twell.kernels.training.train_gated_ffn` (or the pure-PyTorch reference
with ``impl="reference"``) once its measured activity is low enough; early in training, when the
ReLU gate is still about half open, the sparse kernels would be slower than dense, so the layer runs
dense. :meth:`SparseTraining.update` takes each layer's mean active neurons per token of the last
step, smooths it over steps (exponential average, weight ``1 - smoothing`` on the new value) and
sets the route for the next step: sparse at or below ``max_active`` (a fraction of the layer's
neurons), dense again only above ``1.25 * max_active`` (no flapping around the threshold).
The route changes between optimizer steps only, so an activation-checkpointed recompute always
takes the route its forward took. A layer the kernels cannot run (bias, D > 2048, another dtype, a
CPU tensor, hooks on the projections) runs dense, and ``ffn.train_note`` says why.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from twell.reference.training import TRAIN_SLOTS

ROUTES = ("dense", "sparse")

# Default activity threshold: the fraction of a layer's neurons active per token at or below which it
# trains sparse. On an H200 at M = 16384, D 2048, H 5632 the kernels' forward and backward ran 1.18x
# dense at 29 active (0.51%) and 0.90x at 64 (1.14%): break-even near 49 (0.87%); 0.8% keeps a margin
# (docs/training_kernels.md).
MAX_ACTIVE = 0.008


class SparseTraining:
    """Callable ``(ffn, x) -> out`` for ``SparseFFN.train_backend``; fills ``ffn.stats`` when tracking."""

    def __init__(self, slots: int = TRAIN_SLOTS, max_active: float = MAX_ACTIVE, impl: str = "kernel",
                 start: str = "dense", smoothing: float = 0.9):
        if impl not in ("kernel", "reference"):
            raise ValueError(f"impl must be 'kernel' or 'reference', got {impl!r}")
        if not 0.0 <= max_active <= 1.0:
            raise ValueError(f"max_active is a fraction of the layer's neurons in [0, 1], got {max_active}")
        if start not in ROUTES:
            raise ValueError(f"start must be one of {ROUTES}, got {start!r}")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.slots = slots
        self.max_active = max_active
        self.smoothing = smoothing
        self.impl = impl
        self.start = start

    def __repr__(self) -> str:
        return f"SparseTraining(impl={self.impl!r}, slots={self.slots}, max_active={self.max_active})"

    def _fn(self):
        if self.impl == "kernel":
            from twell.kernels.training import train_gated_ffn
        else:
            from twell.reference.training import train_gated_ffn
        return train_gated_ffn

    def route(self, ffn) -> str:
        return getattr(ffn, "train_route", self.start)

    def unsupported(self, ffn, x: torch.Tensor, dtype: torch.dtype) -> str:
        """Why this backend cannot run ``ffn`` on x (computed in ``dtype``), or ``''``."""
        if not ffn.gated or ffn.activation != "relu":
            return "the training kernels run ReLU-gated layers"
        if ffn.has_bias():
            return ffn.BIAS_ERROR
        why = ffn._bypassed()
        if why:
            return why
        if dtype != torch.bfloat16:
            return f"the training kernels compute in bfloat16, this forward in {dtype}"
        D = ffn.hidden_size
        if D % 8 or D > 2048:
            return f"the training kernels need D to be a multiple of 8 and at most 2048, got {D}"
        if self.impl == "kernel":
            if not x.is_cuda:
                return f"input on {x.device}"
            from twell.nn.ffn import _kernels_unavailable

            why = _kernels_unavailable()
            if why:
                return f"kernels unavailable: {why}"
        return ""

    def __call__(self, ffn, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        cast = torch.is_autocast_enabled(dev)
        dtype = torch.get_autocast_dtype(dev) if cast else x.dtype
        ws = [ffn.gate_proj.weight, ffn.up_proj.weight, ffn.down_proj.weight]
        why = self.unsupported(ffn, x, dtype)
        if not why and not cast and any(w.dtype != x.dtype for w in ws):
            why = f"x is {x.dtype}, the weights {sorted({str(w.dtype) for w in ws})}"
        if why or self.route(ffn) == "dense":
            ffn.train_note = why or "dense: activity above the threshold (or not measured yet)"
            return ffn._dense(x)
        ffn.train_note = ""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if cast:  # what F.linear does under autocast: bf16 copies, gradients flow back to the originals
            x2, ws = x2.to(dtype), [w.to(dtype) for w in ws]
        x2 = x2.contiguous()
        with torch.autocast(dev, enabled=False):
            out, l1, nnz, active = self._fn()(x2, *ws, slots=self.slots)
        if ffn.track:
            from twell.nn.ffn import FFNStats

            ffn.stats = FFNStats(l1=l1 if ffn.track_l1 else l1.detach(), active_per_token=nnz.reshape(shape[:-1]),
                                 neuron_active=active)
        ffn.last_path = f"train-{self.impl}"
        return out.reshape(*shape[:-1], out.shape[-1])

    def update(self, ffns: Sequence, active_mean: Sequence[float]) -> Optional[list[str]]:
        """Set each layer's route from its mean active neurons per token (one value per layer, e.g.
        the sparsity tracker's ``active_mean`` of the last step), smoothed over the calls
        (``ffn.train_activity`` holds the smoothed fraction). Returns the new routes when any changed,
        else None."""
        if len(active_mean) != len(ffns):
            raise ValueError(f"{len(ffns)} layers but {len(active_mean)} activity values")
        changed = False
        for ffn, a in zip(ffns, active_mean):
            frac = float(a) / ffn.intermediate_size
            seen = getattr(ffn, "train_activity", None)
            frac = frac if seen is None else self.smoothing * seen + (1 - self.smoothing) * frac
            ffn.train_activity = frac
            now = self.route(ffn)
            new = "sparse" if frac <= self.max_active else ("dense" if frac > 1.25 * self.max_active else now)
            if new != now or not hasattr(ffn, "train_route"):
                changed = changed or new != now
                ffn.train_route = new
        return [self.route(f) for f in ffns] if changed else None


def use_sparse_training(model, backend: Optional[SparseTraining] = None) -> SparseTraining:
    """Plug ``backend`` (default: a new :class:`SparseTraining`) into every SparseFFN of the model."""
    from twell.model import sparse_ffns

    backend = backend or SparseTraining()
    ffns = sparse_ffns(model)
    if not ffns:
        raise ValueError("the model has no SparseFFN layers")
    for f in ffns:
        f.train_backend = backend
    return backend
