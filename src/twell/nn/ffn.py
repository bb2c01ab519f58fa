"""The project's feedforward block: a Llama MLP whose hidden activation can run sparse.

``SparseFFN`` has the parameter names of a transformers Llama MLP (``gate_proj``, ``up_proj``,
``down_proj``), so checkpoints load in plain transformers. It computes

    gated:      out = down_proj(act(gate_proj(x)) * up_proj(x))
    non-gated:  out = down_proj(act(up_proj(x)))

and chooses *how* through one interface:

- With autograd recording (training), the dense path runs, or ``train_backend`` when one is set
  (the hook the training kernels plug into; it receives ``(module, x)``, returns ``out`` and, when
  ``track`` is on, must set ``module.stats`` like the dense path does).
- Without autograd (inference), ``path`` decides: ``"dense"`` (plain PyTorch), ``"reference"``
  (pure-PyTorch TwELL ops), ``"kernel"`` (CUDA kernels; an error if they are unavailable) or
  ``"auto"`` (kernels when available, else the reference, recorded in ``last_path``). Sparse paths
  need ``activation="relu"``. On its first kernel call, ``"auto"`` also measures the layer's activity
  (one host sync, once): a layer with more than ``auto_max_active`` of its neurons active per token
  runs dense from then on, and ``auto_note`` says why (the kernels stay exact on such a layer but
  get slower than dense: spill area full, tiles recomputed; measured 19x slower on a 23%-active model).

``last_path`` says which path the last forward used: ``"dense"``, ``"train-backend"``,
``"twell-reference"`` or ``"twell-kernel"``. With ``track=True`` the forward also records
``stats`` (:class:`FFNStats`) for the L1 loss and the sparsity tracker; ``track_l1=False`` keeps
``stats.l1`` out of the autograd graph (for runs whose L1 coefficient is 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from twell.reference.ffn import check_union_rule

PATHS = ("auto", "dense", "reference", "kernel")
ACTIVATIONS = {"relu": F.relu, "silu": F.silu}


@dataclass
class FFNStats:
    """What one forward saw. ``l1`` stays in the autograd graph; the rest is detached.

    l1:               0-dim fp32, ``|h|`` summed over hidden units, mean over tokens
    active_per_token: int32 [*x.shape[:-1]], neurons with a nonzero activation per token
    neuron_active:    bool [H], neurons active for at least one token of this forward
    """

    l1: torch.Tensor
    active_per_token: torch.Tensor
    neuron_active: torch.Tensor


class SparseFFN(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        gated: bool = True,
        activation: str = "relu",
        bias: bool = False,
        path: str = "auto",
        tile: int = 256,
        compression: int = 8,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gated = gated
        self.activation = activation
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias) if gated else None
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.tile = tile
        self.compression = compression
        # Block-union rule of this layer's fused kernel, (ratio, base), or None for the process-wide
        # TWELL_UNION_* setting (default off). It pays on layers with many active neurons that
        # consecutive tokens share (csrc/NOTES.md, session 19); set it per layer.
        self.union = None
        self.path = path
        self.train_backend: Optional[Callable[["SparseFFN", torch.Tensor], torch.Tensor]] = None
        self.track = False
        self.track_l1 = True
        self.stats: Optional[FFNStats] = None
        self.last_path: Optional[str] = None
        self.last_gate = None  # the TwELL of the last sparse forward (inspect lazily: no host sync)
        # "auto" leaves the kernels for dense above this active fraction: the v2 kernel FFN broke even
        # with dense cuBLAS near 50 of 5632 neurons per token (0.9%) at M = 65536 on an H100; the v5
        # kernels are 1.06x at 64 (1.1%), so the threshold is conservative (csrc/NOTES.md).
        self.auto_max_active = 0.01
        self.auto_note: Optional[str] = None
        self._auto_dense: Optional[bool] = None  # None: not measured yet
        self._w_down_t: Optional[torch.Tensor] = None
        self._w_down_t_version: Optional[tuple] = None

    # -- configuration ---------------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self._path

    @path.setter
    def path(self, value: str) -> None:
        if value not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {value!r}")
        if value in ("reference", "kernel") and self.activation != "relu":
            raise ValueError(f"sparse path {value!r} needs activation='relu', this layer uses {self.activation!r}")
        self._path = value
        self.reset_auto()

    @property
    def union(self) -> Optional[tuple[float, float]]:
        return self._union

    @union.setter
    def union(self, value) -> None:
        self._union = check_union_rule(value)

    def reset_auto(self) -> None:
        """Forget the activity that ``"auto"`` measured (e.g. after loading other weights)."""
        self._auto_dense = None
        self.auto_note = None

    @classmethod
    def from_llama_mlp(cls, mlp: nn.Module, *, path: str = "auto", activation: str = "relu") -> "SparseFFN":
        """Wrap a transformers ``LlamaMLP`` (shares its Linear modules, no copy)."""
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not isinstance(getattr(mlp, name, None), nn.Linear):
                raise TypeError(f"expected a Llama MLP with nn.Linear {name}, got {type(mlp).__name__}")
        ffn = cls(mlp.up_proj.in_features, mlp.up_proj.out_features, activation=activation,
                  bias=mlp.up_proj.bias is not None, path="dense")
        ffn.gate_proj, ffn.up_proj, ffn.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        ffn.path = path
        return ffn

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, gated={self.gated}, "
                f"activation={self.activation}, path={self.path}" + (f", union={self.union}" if self.union else ""))

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            if self.train_backend is not None:
                self.last_path = "train-backend"
                return self.train_backend(self, x)
            return self._dense(x)
        path = self.path
        if path == "dense" or self.activation != "relu" or self.track:
            # Tracking needs the dense hidden state for its statistics.
            return self._dense(x)
        if path == "auto":
            from twell import kernels

            # available() is cached per process; a failed build makes "auto" use the reference
            ok, _ = kernels.available() if x.is_cuda else (False, "input on CPU")
            if not ok:
                return self._sparse(x, use_kernel=False)
            if self._auto_dense:
                return self._dense(x)
            out = self._sparse(x, use_kernel=True)
            if self._auto_dense is None:
                self._measure_activity(self.last_gate)
            return out
        return self._sparse(x, use_kernel=(path == "kernel"))

    def _measure_activity(self, gate) -> None:
        active = gate.nnz_per_row().float().mean().item() / self.intermediate_size
        self._auto_dense = active > self.auto_max_active
        if self._auto_dense:
            self.auto_note = (f"auto: {100 * active:.2f}% of neurons active per token on the first call "
                              f"(> {100 * self.auto_max_active:.2f}%): dense from the next call on")

    def hidden(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-activation that decides sparsity, hidden activation h) for input x, dense."""
        act = ACTIVATIONS[self.activation]
        if self.gated:
            g = self.gate_proj(x)
            return g, act(g) * self.up_proj(x)
        u = self.up_proj(x)
        return u, act(u)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        pre, h = self.hidden(x)
        if self.track:
            active = pre > 0 if self.activation == "relu" else h != 0
            # fp32 accumulation without an fp32 copy of h kept for the backward pass
            l1 = h.abs().sum(-1, dtype=torch.float32).mean()
            self.stats = FFNStats(
                l1=l1 if self.track_l1 else l1.detach(),
                active_per_token=active.sum(-1, dtype=torch.int32).detach(),
                neuron_active=active.reshape(-1, active.shape[-1]).any(0).detach(),
            )
        self.last_path = "dense"
        return self.down_proj(h)

    def w_down_t(self) -> torch.Tensor:
        """W_down transposed to [H, D] (one contiguous row per neuron), cached until the weight changes."""
        w = self.down_proj.weight
        key = (w.data_ptr(), w._version, w.device, w.dtype)
        if self._w_down_t is None or self._w_down_t_version != key:
            self._w_down_t = w.detach().t().contiguous()
            self._w_down_t_version = key
        return self._w_down_t

    BIAS_ERROR = "the sparse TwELL paths support bias-free projections only (Llama MLPs have none)"

    def has_bias(self) -> bool:
        """Whether any projection carries a bias (the sparse paths take none: BIAS_ERROR)."""
        return any(p is not None and p.bias is not None for p in (self.gate_proj, self.up_proj, self.down_proj))

    def _sparse(self, x: torch.Tensor, *, use_kernel: bool) -> torch.Tensor:
        if self.has_bias():
            raise ValueError(self.BIAS_ERROR)
        if use_kernel:
            from twell import kernels as impl

            ok, why = impl.available()
            if not ok:
                raise RuntimeError(f"path='kernel' requested but the TwELL kernels are unavailable: {why}")
            self.last_path = "twell-kernel"
        else:
            from twell import reference as impl

            self.last_path = "twell-reference"
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if self.gated:
            gate = impl.twell_gate(x2, self.gate_proj.weight, tile=self.tile, compression=self.compression)
            out = impl.twell_gated_ffn(x2, gate, self.up_proj.weight, self.w_down_t(), union=self.union)
        else:
            act = impl.twell_gate(x2, self.up_proj.weight, tile=self.tile, compression=self.compression)
            out = impl.twell_ffn(act, self.w_down_t())
            gate = act
        self.last_gate = gate
        return out.reshape(*shape[:-1], out.shape[-1])
