"""The project's feedforward block: a Llama MLP whose hidden activation can run sparse.

``SparseFFN`` has the parameter names of a transformers Llama MLP (``gate_proj``, ``up_proj``,
``down_proj``), so checkpoints load in plain transformers. It computes

    gated:      out = down_proj(act(gate_proj(x)) * up_proj(x))
    non-gated:  out = down_proj(act(up_proj(x)))

and chooses *how* in two steps: :meth:`SparseFFN.plan` asks the pure planner
(:func:`twell.nn.routing.plan`) for a :class:`~twell.nn.routing.Route` (op, implementation, reason)
from the layer's :meth:`~SparseFFN.layer_state` and the input, and :meth:`SparseFFN.run` runs it and
records it in ``last_route`` (``last_path`` is its short name, ``auto_note`` its note on path
``"auto"``). docs/routing.md describes every case; in short:

- With autograd recording (training): ``train_backend`` plans the call when one is set
  (:class:`twell.nn.sparse_training.SparseTraining`: the training op or dense, per layer); else an
  explicit sparse path (``"reference"``, ``"kernel"``) runs the training op of that implementation
  and raises where it cannot; ``"auto"`` and ``"dense"`` run dense.
- Without autograd (inference), ``path`` decides: ``"dense"`` (plain PyTorch), ``"reference"``
  (pure-PyTorch TwELL ops), ``"kernel"`` (CUDA kernels) or ``"auto"``. An explicit sparse path never
  turns dense: it raises where it cannot run (kernels unavailable, bias, hooks, activation not ReLU).
  ``"auto"`` runs the kernels when they can run the layer on this input and are faster there, else the
  reference (CPU input, kernels unavailable, a shape they do not take), else dense (bias, dtypes other
  than bfloat16, tracking, ...). On its first call on the kernels' route it measures the layer's
  activity (one host sync, once); it then runs a sparse op only where the activity is under the
  ceiling measured for the row count (``routing.AUTO_CEILINGS``, ``auto_max_active``), dense on
  ``dense_rows`` (17-2047 by default), and the decoding op ``decode_gated_ffn`` on at most
  ``decode_rows`` rows (also on layers dense by activity while the rows' expected union of active
  neurons stays within ``DECODE_MAX_UNION`` of H: ``decode_max_rows()``).
  ``twell.model.choose_union_paths`` and ``choose_row_paths`` replace these rules by timings.

A gated layer's large-batch sparse op is ``sparse_gated_ffn`` (gate and fused kernel in one call, the
TwELL internal), or the gate op and the fused op in turn when the TwELL is needed (``keep_gate``, or
"auto" measuring); on the kernels both give the same bits while the spill area holds the tiles that
overflow their slots (past it, tiles are recomputed: equal to rounding). The layer's TwELL uses
``SPARSE_FFN_COMPRESSION`` by default (docs/kernels.md §6).

Non-finite values propagate as in dense PyTorch: a NaN or Inf in x, or anywhere in ``gate_proj``, is an
active entry (the gate GEMM reads it for every row), so the rows it reaches come out non-finite; a
non-finite ``up_proj`` or ``down_proj`` weight, which the sparse paths read only where its neuron is
active, makes the output NaN where dense's ``0 * NaN`` would (:meth:`SparseFFN.nonfinite_row`). The raw
ops (``twell.kernels``, ``twell.reference``) leave that last case to the caller: an inactive neuron
contributes exactly nothing there.

``last_path`` says which path the last forward used: ``"dense"``, ``"twell-reference"``,
``"twell-kernel"``, ``"train-reference"``, ``"train-kernel"`` or ``"train-backend"`` (a custom
callable backend). ``keep_gate=True`` keeps the last sparse forward's TwELL
in ``last_gate`` for inspection (off by default: at M = 65536 one layer's TwELL and spill area hold
~200 MB). With ``track=True`` the forward also records
``stats`` (:class:`FFNStats`) for the L1 loss and the sparsity tracker; ``track_l1=False`` keeps
``stats.l1`` out of the autograd graph (for runs whose L1 coefficient is 0).

The sparse paths keep W_down's transpose (``w_down_t()``), refreshed when the weight's storage or
version changed; compiled code makes and checks it through ops inside the graph, so it does not break
a compiled layer's graph. Every forward with autograd recording marks it stale (a fused optimizer
step does not bump the weight's version); after writing the weights through ``.data`` outside
training, call ``invalidate_cache()``. A CUDA graph captured while the copy was current reads it at
each replay without checking it: after changing the weights, capture again.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from twell.formats import check_tiling
from twell.formats.twell import columns_limit
from twell.nn.transpose import (
    forget, holds, new_transpose, new_transpose_, refresh_transpose, refresh_transpose_, weight_state,
)
from twell.nn import routing
from twell.nn.routing import PATHS
from twell.reference.decode import DECODE_MAX_ROWS
from twell.reference import gates
from twell.reference.ffn import SPARSE_FFN_COMPRESSION, check_union_rule
from twell.reference.training import TRAIN_MAX_D, TRAIN_SLOTS

# Row counts up to which the kernel path takes the decoding op by default (SparseFFN.decode_rows); past
# 16 rows it stops beating dense (docs/decoding.md#which-path-runs-sparseffn-by-rows).
DEFAULT_DECODE_ROWS = 16
# Row counts that "auto" runs dense by default (SparseFFN.dense_rows): too many for the decoding op, too
# few for the large-batch op to beat dense reliably (docs/routing.md#auto-by-row-count); from 2048 rows on
# the activity ceilings of twell.nn.routing decide.
DEFAULT_DENSE_ROWS = (DEFAULT_DECODE_ROWS + 1, 2047)
# A layer that "auto" runs dense by its activity still takes the decoding op on up to decode_rows rows while the
# rows' expected union of active neurons, 1 - (1 - activity)^rows of H, stays at most this: the op reads every
# gate weight and only the union's up and down rows (measured in docs/decoding.md).
DECODE_MAX_UNION = 0.25
# What compiled "auto" planning shows in place of a layer's measured activity and its note: compiled code
# guards on every attribute it reads, so per-layer values gave each layer of a shared compiled forward its own
# graph, and past dynamo's recompile limit (8) the rest ran eager. The decisions use a class of the activity
# (_auto_stable) that layers share; auto_note keeps the layer's own note.
COMPILED_ACTIVITY = "the measured share"
COMPILED_NOTE = "auto: as the layer's measured activity decided (auto_note)"
ACTIVATIONS = {"relu": F.relu, "silu": F.silu}
# What a SparseFFN computes: ReLU and its gate variants FATReLU (a threshold on the gate) and dReLU (ReLU on the
# up projection too), which the sparse paths run (twell.reference.gates), and SiLU, which runs dense.
ALL_ACTIVATIONS = (*gates.SPARSE_ACTIVATIONS, "silu")


def _activation_name(act) -> Optional[str]:
    """'relu' / 'silu' when ``act`` (a module or function, e.g. transformers' ACT2FN entries, whose
    classes vary between versions) computes it, else None. Known types answer directly; anything
    else is applied to a copy of a probe whose large values tell relu from relu6 or clamps."""
    if isinstance(act, nn.ReLU) or act in (F.relu, torch.relu):
        return "relu"
    if isinstance(act, nn.SiLU) or act is F.silu:
        return "silu"
    if not callable(act):
        return None
    probe = torch.cat([torch.linspace(-4.0, 4.0, 33, device="cpu"),  # explicit: models are built
                       torch.tensor([-1e4, -1e3, -10.0, 10.0, 1e3, 1e4], device="cpu")])  # under a meta device
    try:
        with torch.no_grad():
            got = act(probe.clone())  # clone: an in-place activation would change the probe
            if not isinstance(got, torch.Tensor) or got.shape != probe.shape:
                return None
            for name, fn in ACTIVATIONS.items():
                if torch.allclose(got.float(), fn(probe), rtol=1e-2, atol=1e-3):  # bf16-computed ones too
                    return name
    except Exception:  # not an elementwise activation of one tensor, or one that cannot run here
        return None
    return None


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


def _nonfinite_row(up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """[D]: NaN in the output columns that non-finite up_proj ([H, D]) or down_proj ([D, H]) weights make
    NaN on every row of dense PyTorch (``0 * NaN``), 0 elsewhere; on the weights' device, no host sync."""
    bad = (~torch.isfinite(down)).any(1) | ~torch.isfinite(up).all()
    return torch.where(bad, torch.tensor(float("nan"), dtype=down.dtype, device=down.device),
                       torch.zeros((), dtype=down.dtype, device=down.device))


@torch.compiler.assume_constant_result
def _kernels_unavailable() -> str:
    """Why the kernels cannot run in this process ('' when they can). Compiled code takes the answer as
    a constant: ``kernels.available()`` looks for files (nvcc, sources), which dynamo cannot trace, so
    every compiled forward would otherwise break its graph here."""
    from twell import kernels

    ok, why = kernels.available()
    return "" if ok else why


def call_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The input x of a SparseFFN call as a forward pre-hook registered ``with_kwargs=True`` sees it:
    positional, or ``x=`` (a custom model may call ``mlp(x=h)``)."""
    return args[0] if args else kwargs["x"]


@contextlib.contextmanager
def ffn_inputs(ffns, on_input):
    """While open, each call of ``ffns[i]`` hands its input to ``on_input(i, x)``: detached, as [rows, D] in bf16
    (what the training op sees). Forward pre-hooks, removed on exit."""
    def hook(i):
        def fn(module, args, kwargs):
            x = call_input(args, kwargs)
            on_input(i, x.detach().reshape(-1, x.shape[-1]).to(torch.bfloat16))
        return fn

    hooks = [f.register_forward_pre_hook(hook(i), with_kwargs=True) for i, f in enumerate(ffns)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


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
        compression: int = SPARSE_FFN_COMPRESSION,
        threshold: float = 0.0,
    ):
        super().__init__()
        if activation not in ALL_ACTIVATIONS:
            raise ValueError(f"activation must be one of {ALL_ACTIVATIONS}, got {activation!r}")
        if activation in ("fatrelu", "drelu") and not gated:
            raise ValueError(f"activation {activation!r} is a gate variant: it needs gated=True")
        gates.check_gate_settings(threshold, False)
        if threshold and activation != "fatrelu":
            raise ValueError(f"threshold={threshold!r} is FATReLU's gate threshold: it needs activation='fatrelu', "
                             f"this layer uses {activation!r}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gated = gated
        self.activation = activation
        # FATReLU's gate threshold t (h = g where g > t, else 0); 0 for every other activation.
        self.threshold = float(threshold)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias) if gated else None
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        check_tiling(tile, compression)  # a bad tiling fails here, not on the first sparse forward
        self.tile = tile
        self.compression = compression
        # Block-union rule of this layer's fused kernel, (ratio, base), or None for off (the per-row
        # kernel only). It pays on layers with many active neurons that
        # consecutive tokens share (docs/kernels.md §7); set it per layer.
        self.union = None
        self._state: Optional[tuple] = None  # (key, LayerState) of layer_state()
        self._state_gen = 0  # bumped by the setters of what planning reads (_changed)
        self._auto_dense: Optional[bool] = None  # None: not measured yet, no timed choice
        self._timed = False  # the choice came from set_auto_choice (timings), not from the activity
        self._activity: Optional[float] = None  # the fraction of neurons active per token "auto" measured
        self._activity_text = ""  # the same as a percentage, formatted when measured (planning formats no float)
        self._activity_note: Optional[str] = None
        self.path = path
        # The training backend (twell.nn.sparse_training.SparseTraining, which plans training calls), or any
        # callable (module, x) -> out that fills module.stats when tracking.
        self.train_backend = None
        # That backend's state of this layer (twell.nn.sparse_training.LayerTraining); only it writes this.
        self.train_state = None
        self.track = False
        self.track_l1 = True
        self.stats: Optional[FFNStats] = None
        self.last_route: Optional[routing.Route] = None  # what the last forward ran, and why (last_path)
        # Row counts up to this take the decoding op on the sparse paths (twell.kernels.decode_gated_ffn:
        # reads only the active neurons' up and down rows); 0 turns it off.
        self.decode_rows = DEFAULT_DECODE_ROWS
        # "auto" runs dense for row counts in this closed range (None: never by row count);
        # twell.model.choose_row_paths sets it per layer from timings.
        self.dense_rows = DEFAULT_DENSE_ROWS
        self.keep_gate = False  # keep the last sparse forward's TwELL in last_gate
        self.last_gate = None  # that TwELL (inspect lazily: no host sync)
        # "auto" leaves the kernels for dense above this active fraction (at every row count; lower ceilings
        # at fewer rows, auto_ceilings): docs/routing.md#auto-by-row-count.
        self.auto_max_active = routing.AUTO_MAX_ACTIVE
        # ... and below this activity by row count ((rows, fraction) pairs; () for auto_max_active alone);
        # choose_row_paths, which times the rows, clears it.
        self.auto_ceilings = routing.AUTO_CEILINGS
        self.auto_note: Optional[str] = None
        # W_down transposed, [H, D] (w_down_t()). A plain attribute, not a buffer: DDP broadcasts buffers,
        # and ranks that ran different inference calls would disagree on it.
        self._w_down_t: Optional[torch.Tensor] = None
        # (weights' key, NaN row or None) of the last non-finite check (:meth:`nonfinite_row`).
        self._nonfinite: Optional[tuple] = None
        # What compiled planning reads of the activity and its settings (_refresh_stable; the setters keep it)
        self._auto_stable: Optional[tuple] = None
        self._refresh_stable()

    # -- configuration ---------------------------------------------------------------------------
    @property
    def last_path(self) -> Optional[str]:
        """Short name of the path the last forward ran (``last_route.path``); None before any, or after
        ``last_path = None`` (which forgets the last Route)."""
        r = self.last_route
        return None if r is None else r.path

    @last_path.setter
    def last_path(self, value: None) -> None:
        if value is not None:
            raise ValueError("last_path follows last_route; only None (forget the last Route) can be set")
        self.last_route = None

    @property
    def path(self) -> str:
        return self._path

    @path.setter
    def path(self, value: str) -> None:
        if value not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {value!r}")
        if value in ("reference", "kernel") and self.activation not in gates.SPARSE_ACTIVATIONS:
            raise ValueError(f"sparse path {value!r} needs activation='relu' (or its gate variants 'fatrelu', "
                             f"'drelu'), this layer uses {self.activation!r}")
        self._path = value
        self.reset_auto()
        self._changed()

    @property
    def decode_rows(self) -> int:
        return self._decode_rows

    @decode_rows.setter
    def decode_rows(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= DECODE_MAX_ROWS:
            raise ValueError(f"decode_rows must be an int in [0, {DECODE_MAX_ROWS}], got {value!r}")
        self._decode_rows = value
        self._changed()

    @property
    def dense_rows(self) -> Optional[tuple[int, int]]:
        return self._dense_rows

    @dense_rows.setter
    def dense_rows(self, value) -> None:
        if value is not None:
            ok = (isinstance(value, (tuple, list)) and len(value) == 2
                  and all(isinstance(v, int) and not isinstance(v, bool) for v in value) and 1 <= value[0] <= value[1])
            if not ok:
                raise ValueError(f"dense_rows must be None or (lo, hi) ints with 1 <= lo <= hi, got {value!r}")
            value = (int(value[0]), int(value[1]))
        self._dense_rows = value
        self._changed()

    @property
    def auto_max_active(self) -> float:
        """"auto" leaves the kernels for dense above this active fraction (at every row count)."""
        return self._auto_max_active

    @auto_max_active.setter
    def auto_max_active(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"auto_max_active must be a fraction in [0, 1], got {value!r}")
        self._auto_max_active = float(value)
        self._changed()

    @property
    def auto_ceilings(self) -> tuple:
        return self._auto_ceilings

    @auto_ceilings.setter
    def auto_ceilings(self, value) -> None:
        self._auto_ceilings = routing.check_ceilings(value)
        self._changed()

    @property
    def union(self) -> Optional[tuple[float, float]]:
        return self._union

    @union.setter
    def union(self, value) -> None:
        self._union = check_union_rule(value)

    def reset_auto(self) -> None:
        """Forget the activity that ``"auto"`` measured, or the choice set_auto_choice made (e.g. after
        loading other weights)."""
        self._auto_dense = self._activity = None
        self.auto_note = self._activity_note = None
        self._activity_text = ""
        self._timed = False
        self._changed()

    def set_auto_choice(self, dense: bool, note: str) -> None:
        """Fix what ``"auto"`` runs from now on (dense, or the sparse path) in place of the activity
        threshold it would apply on its next call; ``note`` becomes ``auto_note`` (why). Lasts until
        :meth:`reset_auto` or a new ``path``. Where "auto" cannot run the kernels on an input (CPU, dtype,
        shape), it still takes the reference or dense for that input. A layer fixed to dense keeps the
        decoding op on few rows when its activity was measured before (:meth:`decode_max_rows`): the
        choice is about the large-batch path. Used by ``twell.model.choose_union_paths``, which times
        both on real inputs."""
        self._auto_dense = bool(dense)
        self._timed = True
        self.auto_note = self._activity_note = note
        self._changed()

    @classmethod
    def from_llama_mlp(cls, mlp: nn.Module, *, path: str = "auto", activation: Optional[str] = None) -> "SparseFFN":
        """Wrap a transformers ``LlamaMLP`` (shares its Linear modules, no copy).

        ``activation=None`` takes the MLP's own ``act_fn`` (ReLU or SiLU; anything else is an error),
        so the wrapped module computes what the MLP computed. An explicit activation overrides it, with
        a warning when it differs from ``act_fn``: pass ``activation="relu"`` for a checkpoint trained
        with ReLU whose config names SiLU (the paper's ``sparsity_*`` configs do; ``load_pretrained``
        handles those itself).
        """
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not isinstance(getattr(mlp, name, None), nn.Linear):
                raise TypeError(f"expected a Llama MLP with nn.Linear {name}, got {type(mlp).__name__}")
        own = _activation_name(getattr(mlp, "act_fn", None))
        if activation is None:
            if own is None:
                raise ValueError(f"cannot tell the activation of {type(mlp).__name__} (act_fn="
                                 f"{getattr(mlp, 'act_fn', None)!r}); SparseFFN runs {sorted(ACTIVATIONS)}: "
                                 "pass activation= to choose one")
            activation = own
        elif own is not None and own != activation:
            warnings.warn(f"from_llama_mlp: the MLP's act_fn is {own}, the SparseFFN will compute {activation}: "
                          "its outputs differ from the MLP's", stacklevel=2)
        ffn = cls(mlp.up_proj.in_features, mlp.up_proj.out_features, activation=activation,
                  bias=mlp.up_proj.bias is not None, path="dense")
        ffn.gate_proj, ffn.up_proj, ffn.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        ffn.path = path
        return ffn

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, gated={self.gated}, "
                f"activation={self.activation}" + (f", threshold={self.threshold:g}" if self.threshold else "")
                + f", path={self.path}" + (f", union={self.union}" if self.union else ""))

    def gate_settings(self) -> tuple[float, bool]:
        """(threshold, up_relu) of this layer's gate for the sparse ops (twell.reference.gates): (0, False)
        for ReLU, (t, False) for FATReLU, (0, True) for dReLU."""
        return gates.settings(self.activation, self.threshold)

    def _gate_kwargs(self) -> dict:
        """The ops' gate keywords for this layer; none for ReLU, so its calls are the ones they always were."""
        if self.activation == "relu":
            return {}
        threshold, up_relu = self.gate_settings()
        return {"threshold": threshold, "up_relu": up_relu}


    def _gate_why(self) -> str:
        """Why the kernels cannot compute this layer's gate ('' for ReLU, and for SiLU, which no sparse path runs)."""
        if self.activation not in gates.SPARSE_ACTIVATIONS:
            return ""
        return gates.kernel_gate_unsupported(*self.gate_settings())

    # -- forward ---------------------------------------------------------------------------------
    def _bypassed(self) -> str:
        """What the sparse paths would skip: they read the projections' weights and never call the
        modules, so hooks, a subclass's own forward or a patched forward (adapters, fake-quant,
        activation capture, offloading) would be lost; '' when nothing is."""
        for name in ("gate_proj", "up_proj", "down_proj"):
            m = getattr(self, name)
            if m is None:
                continue
            if type(m) is not nn.Linear or "forward" in m.__dict__:
                return f"{name} is a {type(m).__name__} with its own forward, which the sparse paths would not call"
            if m._forward_hooks or m._forward_pre_hooks:
                return f"{name} has forward hooks, which the sparse paths would not call"
            if not m.weight.is_contiguous():
                return f"{name}.weight is not contiguous (a view of a fused matrix?)"
        # Global hooks (torch's ModuleTracker: FlopCounterMode, memory trackers) only observe: not counted.
        return ""

    def _no_sparse_layer(self) -> str:
        """Why no sparse path (reference or kernels) can run this layer on any input; '' when one can."""
        if self.has_bias():
            return self.BIAS_ERROR
        if columns_limit(self.intermediate_size):
            return f"{columns_limit(self.intermediate_size)} (this layer's intermediate size)"
        return self._bypassed()

    def _no_kernels_here(self) -> str:
        """Why no kernel can read this layer's weights in this process (kernels unavailable, a misaligned gate
        or up weight); '' when they can. The common start of _no_kernel_layer and _no_decode_layer."""
        from twell import kernels

        why = _kernels_unavailable()
        if why:
            return routing.UNAVAILABLE + why
        for name in ("gate_proj", "up_proj"):
            m = getattr(self, name)
            if m is not None and kernels.misaligned(m.weight):
                return f"{name}.weight does not start on 16 bytes (a view into a flat buffer?)"
        return ""

    def _no_kernel_layer(self) -> str:
        """Why the kernels cannot run this layer on any CUDA input; '' when they can."""
        from twell import kernels

        return self._no_kernels_here() or kernels.layer_unsupported(self.hidden_size, self.intermediate_size,
                                                                    self.tile, self.compression)

    def _no_decode_layer(self) -> str:
        """Why the decoding op cannot run this layer on any CUDA input; '' when it can (it takes wider
        layers than the other kernels, and every gate variant)."""
        from twell import kernels

        why = self._no_kernels_here()
        if why or not self.gated:
            return why or "the decoding op runs gated layers"
        return kernels.decode_layer_unsupported(self.hidden_size, self.intermediate_size)

    def _no_train_layer(self) -> str:
        """Why the training op cannot run this layer on any input; '' when it can."""
        if not self.gated or self.activation not in gates.SPARSE_ACTIVATIONS:
            return "the training kernels run ReLU-gated layers (the reference also FATReLU and dReLU)"
        if self.has_bias():
            return self.BIAS_ERROR
        why = self._bypassed()
        if why:
            return why
        D = self.hidden_size
        if D % 8 or D > TRAIN_MAX_D:
            return f"the training kernels need D to be a multiple of 8 and at most {TRAIN_MAX_D}, got {D}"
        return ""

    def _state_key(self) -> tuple:
        """What the cached LayerState depends on beyond the setters (which bump ``_state_gen``): plain
        attributes, the projection modules, their hooks and own forwards, weights, dtypes and addresses.
        Read on every eager call, so kept to attribute reads."""
        # ids where objects could define __eq__ (a Parameter's would compare elementwise)
        key = (self._state_gen, self.track, self.keep_gate, self.activation, self.threshold, self.auto_max_active,
               id(self.train_backend), self.tile, self.compression, self.hidden_size, self.intermediate_size,
               self.gated)
        mods = self._modules
        for name in ("gate_proj", "up_proj", "down_proj"):
            m = mods.get(name)
            if m is None:
                key += (None,)
                continue
            params = m._parameters
            w = params.get("weight")
            # len(__dict__): a patched forward (or any new instance attribute) rebuilds the state
            key += (id(m), m.__class__, len(m.__dict__), len(m._forward_hooks) + len(m._forward_pre_hooks),
                    params.get("bias") is None, id(w))
            if w is not None:
                key += (w.dtype, w.data_ptr(), w.is_contiguous())
        return key

    def layer_state(self) -> routing.LayerState:
        """What planning knows about this layer (:class:`twell.nn.routing.LayerState`), rebuilt when
        anything it depends on changed (eager code caches it; compiled code traces its build)."""
        if torch.compiler.is_compiling():
            return self._build_state(compiled=True)
        return self._cached_state()[1]

    def _cached_state(self) -> tuple:
        """(key, LayerState, routes planned on it by input): the Routes are memoised per input signature,
        so a call whose state and input kind repeat costs a key and a dict lookup."""
        key = self._state_key()
        cached = self._state
        if cached is None or cached[0] != key:
            cached = self._state = (key, self._build_state(), {})
        return cached

    def _build_state(self, training_only: bool = False, compiled: bool = False) -> routing.LayerState:
        """The LayerState of this layer; ``training_only``: "auto"'s per-layer settings and measurements,
        which training planning does not read, left at neutral values (see :meth:`train_layer_state`);
        ``compiled``: the activity as its class and the note as ``COMPILED_NOTE`` (see ``_refresh_stable``)."""
        ws = [m.weight for m in (self.gate_proj, self.up_proj, self.down_proj) if m is not None]
        b = self.train_backend
        stable = self._auto_stable if compiled else None
        if training_only:
            auto = dict(decode_rows=0, dense_rows=None, auto_dense=None, timed=False, activity=None,
                        activity_text="", auto_max_active=0.0, ceilings=(), decode_max_rows=0, choice_note=None)
        elif stable is not None:
            auto = dict(decode_rows=self.decode_rows, dense_rows=self.dense_rows, auto_dense=self._auto_dense,
                        timed=self._timed, activity=stable[0],
                        activity_text=COMPILED_ACTIVITY if stable[0] is not None else "",
                        auto_max_active=self.auto_max_active, ceilings=self.auto_ceilings,
                        decode_max_rows=stable[1], choice_note=COMPILED_NOTE if stable[2] else None)
        else:
            auto = dict(decode_rows=self.decode_rows, dense_rows=self.dense_rows, auto_dense=self._auto_dense,
                        timed=self._timed, activity=self._activity, activity_text=self._activity_text,
                        auto_max_active=self.auto_max_active, ceilings=self.auto_ceilings,
                        decode_max_rows=self.decode_max_rows(), choice_note=self._activity_note)
        return routing.LayerState(
            path=self.path, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            gated=self.gated, activation=self.activation, track=self.track, keep_gate=self.keep_gate,
            backend="none" if b is None else ("sparse-training" if hasattr(b, "plan") else "custom"),
            no_sparse_why=self._no_sparse_layer(), weight_dtypes=tuple(dict.fromkeys(w.dtype for w in ws)),
            no_kernel_why=self._no_kernel_layer(), no_decode_why=self._no_decode_layer(),
            no_train_why=self._no_train_layer(), gate_why=self._gate_why(),
            train_slots=TRAIN_SLOTS, **auto)

    def train_layer_state(self) -> routing.LayerState:
        """The LayerState a training call is planned on (:func:`twell.nn.routing.plan_training`). Eager code
        takes :meth:`layer_state`; compiled code builds it from what training planning reads alone, since
        compiled code guards on every attribute it reads: "auto"'s per-layer measurements (activity, its
        note, its choice) gave each layer of a shared compiled forward its own graph, and past dynamo's
        recompile limit (8) the rest ran eager."""
        if not torch.compiler.is_compiling():
            return self._cached_state()[1]
        return self._build_state(training_only=True)

    def _changed(self) -> None:
        """A setter changed what planning reads: the next call rebuilds the LayerState."""
        self._state_gen += 1
        if hasattr(self, "_auto_stable"):  # set up (the setters run in __init__ too)
            self._refresh_stable()

    def _refresh_stable(self) -> None:
        """``_auto_stable``: (the activity's class, decode_max_rows, whether a note is set), for compiled
        planning; every write of what it is made of (the activity, its note and choice, the thresholds,
        decode_rows) goes through ``_changed``, which makes it again. The class is the smallest threshold ("auto_max_active" and the
        ceilings) at or above the activity, or 1.0 above them all: every comparison planning makes with a
        threshold gives the same answer for it as for the activity, and layers in the same class share it."""
        a = self._activity
        if a is not None:
            ts = sorted({min(c, self.auto_max_active) for _, c in self.auto_ceilings} | {self.auto_max_active})
            a = next((t for t in ts if a <= t), 1.0 if ts[-1] < 1.0 else a)
        # decode_max_rows matters to planning only on a layer "auto" runs dense (decode-only layers always are)
        # (activity first: the state asks whether the kernels load, which builds them; not at construction)
        decode_only = self._activity is not None and routing.decode_only_why(self._build_state(training_only=True))
        rows = self.decode_max_rows() if self._auto_dense or decode_only else 0
        self._auto_stable = (a, rows, self._activity_note is not None)

    def auto_route(self, x: torch.Tensor) -> tuple[str, str]:
        """Where ``"auto"`` sends x, before its activity decision: ``("dense" | "reference" | "kernel" | "decode",
        why)``, ``why`` empty for the kernels ("decode": only the decoding op runs the layer, routing.auto_route).
        A wrong input width raises here, as in forward."""
        return routing.auto_route(self.layer_state(), x)

    def recording(self, x: torch.Tensor) -> bool:
        """Whether autograd records a call on x (training): grad mode on, and x or a weight needs grad."""
        return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))

    def plan(self, x: torch.Tensor) -> routing.Route:
        """The Route a call on x takes now (:func:`twell.nn.routing.plan`; a SparseTraining backend plans
        training calls). Plans only: runs nothing and changes nothing."""
        grad = self.recording(x)
        if grad and self.train_backend is not None and hasattr(self.train_backend, "plan"):
            return self.train_backend.plan(self, x)
        cast = routing.autocast_dtype(x) if grad or self.track else None
        if torch.compiler.is_compiling():  # traced once per guard set; a capture replays what was traced
            return routing.plan(self._build_state(compiled=True), x, grad_enabled=grad, compiling=True,
                                autocast_dtype=cast)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        _, state, routes = self._cached_state()
        key = (x.shape[-1], x.numel(), x.dtype, x.device, grad, capturing, cast)
        route = routes.get(key)
        if route is None:
            route = routing.plan(state, x, grad_enabled=grad, capturing=capturing, autocast_dtype=cast)
            if len(routes) >= 64:  # many input sizes (e.g. evaluation batches): keep the memo small
                routes.clear()
            routes[key] = route
        return route

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.plan(x), x)

    def run(self, route: routing.Route, x: torch.Tensor) -> torch.Tensor:
        """Run a Route (from :meth:`plan`) on x and record it: ``last_route``, ``last_path`` and, for
        "auto"'s inference routes, ``auto_note``."""
        if self.last_route is not route:  # Module.__setattr__ is slow: repeated Routes are memoised objects
            self.last_route = route
        if route.training:
            # The optimizer step that follows may update W_down without bumping its version (fused
            # AdamW), so the cached transpose must be copied again before its next use.
            self.invalidate_cache()
        elif self._path == "auto":
            if not torch.compiler.is_compiling():
                if self.auto_note is not route.note:
                    self.auto_note = route.note
            elif route.note is not None and COMPILED_NOTE not in route.note and COMPILED_ACTIVITY not in route.note:
                self.auto_note = route.note  # written, not read: reading it would guard on each layer's note
        op = route.op
        if op == "dense":
            return self._dense(x, measure=route.measure)
        if op == "train":
            return self._train_op(x, route)
        if op == "backend":
            return self.train_backend(self, x)
        return self._sparse(x, route)

    @torch.compiler.disable  # a host read and a formatted note: eager even inside compiled code
    def _measure_activity(self, gate) -> None:
        if gate.n_rows == 0:  # an empty batch says nothing: the next call with tokens measures
            return
        self._set_activity(gate.nnz_per_row().float().mean().item() / self.intermediate_size)

    def _set_activity(self, active: float) -> None:
        """Fix "auto"'s dense-or-sparse choice from the fraction of neurons active per token (one measurement)."""
        self._activity = active
        self._activity_text = routing.pct(active)
        self._auto_dense = active > self.auto_max_active
        self._timed = False
        if self._auto_dense:
            self._activity_note = (f"auto: {100 * active:.2f}% of neurons active per token on the first call "
                                   f"(> {100 * self.auto_max_active:.2f}%): dense from the next call on"
                                   + (", but for the decoding op on as few rows as keep their expected union "
                                      f"of active neurons within {100 * DECODE_MAX_UNION:.0f}% of H "
                                      "(decode_max_rows())" if self.decode_max_rows() else ""))
        else:
            self._activity_note = None
        self.auto_note = self._activity_note
        self._changed()

    def decode_max_rows(self) -> int:
        """Up to how many rows "auto" takes the decoding op on a layer it runs dense by its measured activity
        (the rows' expected union of active neurons at most ``DECODE_MAX_UNION`` of H, and at most
        ``decode_rows``); 0 when it never does (activity not measured, or too high)."""
        a = self._activity
        if a is None or not self.gated or a > DECODE_MAX_UNION:
            return 0
        if a <= 0.0:
            return self.decode_rows
        # the largest n with 1 - (1 - a)^n <= DECODE_MAX_UNION
        return min(self.decode_rows, int(math.log1p(-DECODE_MAX_UNION) / math.log1p(-a) + 1e-9))

    def hidden(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-activation that decides sparsity, hidden activation h) for input x, dense."""
        pre, h, _ = self._hidden(x)
        return pre, h

    def _hidden(self, x: torch.Tensor):
        """(pre-activation, h, the variants' up pre-activation u, else None). A variant's active mask is
        ``_active(pre, u)``, made only where it is read (tracking, measuring): an [M, H] pass of its own."""
        if self.activation in ("fatrelu", "drelu"):
            threshold, up_relu = self.gate_settings()
            g, u = self.gate_proj(x), self.up_proj(x)
            if (g.is_cuda and g.dtype == torch.bfloat16 and u.dtype == g.dtype and not torch.compiler.is_compiling()
                    and not (torch.is_grad_enabled() and (g.requires_grad or u.requires_grad))
                    and not torch.jit.is_tracing() and not _kernels_unavailable()):
                # one kernel for where/relu and the product (the same bits as eager PyTorch): compiled code
                # fuses them itself, training needs autograd's, a TorchScript trace would not record it
                from twell import kernels

                return g, kernels.gate_product(g, u, threshold, up_relu), u
            return g, gates.hidden(g, u, threshold, up_relu), u
        act = ACTIVATIONS[self.activation]
        if self.gated:
            g = self.gate_proj(x)
            return g, act(g) * self.up_proj(x), None
        u = self.up_proj(x)
        return u, act(u), None

    def _active(self, pre: torch.Tensor, u: Optional[torch.Tensor]) -> torch.Tensor:
        """bool: where a neuron is active, from ``_hidden``'s pre-activation and u (ReLU: ``pre > 0``)."""
        if u is not None:
            return gates.active(pre, u, *self.gate_settings())
        return pre > 0

    def _dense(self, x: torch.Tensor, measure: bool = False) -> torch.Tensor:
        pre, h, u = self._hidden(x)
        if self.track:
            active = self._active(pre, u) if u is not None or self.activation == "relu" else h != 0
            # fp32 accumulation without an fp32 copy of h kept for the backward pass
            l1 = h.abs().sum(-1, dtype=torch.float32).mean()
            self.stats = FFNStats(
                l1=l1 if self.track_l1 else l1.detach(),
                active_per_token=active.sum(-1, dtype=torch.int32).detach(),
                neuron_active=active.reshape(-1, active.shape[-1]).any(0).detach(),
            )
        if measure:  # "auto" decides the layer on this call's tokens (one host sync, once)
            note = self.auto_note
            on = self._active(pre, u) if u is not None else ~(pre <= 0)
            self._set_activity(float(on.sum(-1, dtype=torch.float32).mean()) / self.intermediate_size)
            self.auto_note = f"{note}; {self._activity_note}" if self._activity_note else note
        return self.down_proj(h)

    def _train_op(self, x: torch.Tensor, route: routing.Route) -> torch.Tensor:
        """The training op (forward; its backward is sparse too) with the L1 statistics."""
        if route.impl == "kernel":
            from twell.kernels.training import train_gated_ffn
        else:
            from twell.reference.training import train_gated_ffn
        dtype = routing.autocast_dtype(x)
        ws = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if dtype is not None:  # what F.linear does under autocast: copies, gradients flow back to the originals
            x2, ws = x2.to(dtype), [w.to(dtype) for w in ws]
        x2 = x2.contiguous()
        with torch.autocast(x.device.type, enabled=False):
            kw = self._gate_kwargs()
            # the backend's hot neurons of this layer (dense columns), on the kernels: the reference computes
            # every neuron densely anyway
            hot = getattr(self.train_state, "hot", None) if route.impl == "kernel" else None
            if hot is not None:
                kw["hot"] = hot
            out, l1, nnz, active = train_gated_ffn(x2, *ws, slots=route.slots, **kw)
        if self.track:
            self.stats = FFNStats(l1=l1 if self.track_l1 else l1.detach(), active_per_token=nnz.reshape(shape[:-1]),
                                  neuron_active=active)
        return out.reshape(*shape[:-1], out.shape[-1])

    def invalidate_cache(self) -> None:
        """Mark the cached W_down transpose (:meth:`w_down_t`) stale: the next sparse call copies the
        weight again. Call it after writing the weights through ``.data`` (or with a fused optimizer
        step) outside training forwards: such writes do not bump the version counter that the cache
        follows. In eager code the tensor itself stays, so compiled graphs that read it stay valid
        (dropping it would recompile them); moving or converting the module (``.to``, ``.half``, ...)
        to another device or dtype drops it."""
        self._nonfinite = None
        t = self._w_down_t
        if t is None:
            return
        if torch.compiler.is_compiling():
            # Dropped, not marked: backends that functionalize without reinplacing would mark a clone.
            # A compiled training step drops every layer's copy at once: one more graph, not one per
            # layer.
            self._w_down_t = None
        else:
            forget(t)

    def w_down_t(self) -> torch.Tensor:
        """W_down transposed to [H, D] (one contiguous row per neuron), cached until the weight changes.

        The same tensor is refreshed in place when the weight's storage or version moved
        (``twell.nn.transpose``), so a caller that keeps it sees later refreshes. In compiled code ops
        make and check it at run time, so the graph does not break here (a compiled layer that had no
        copy yet recompiles once). Forwards with autograd recording mark it stale; writes through
        ``.data`` need :meth:`invalidate_cache`."""
        w = self.down_proj.weight.detach()  # the copy is a constant of the sparse paths, never a leaf's view
        t = self._w_down_t
        fits = (t is not None and t.shape == (w.shape[1], w.shape[0]) and t.dtype == w.dtype
                and t.device == w.device)
        if torch.compiler.is_compiling():
            if fits:
                refresh_transpose_(w, t)
            else:
                self._w_down_t = t = new_transpose_(w)
            return t
        if fits and t.is_inference() and not torch.is_inference_mode_enabled():
            fits = False  # made under inference_mode: outside it, no in-place write is allowed
        if w.is_cuda and torch.cuda.is_current_stream_capturing() and not (fits and holds(t, w)):
            # A copy recorded into the cache would write, at every replay, into memory that a later
            # reallocation frees; the graph makes (and replays) its own copy in its own pool instead.
            return w.t().contiguous()
        if not fits:
            self._w_down_t = t = new_transpose(w)
        elif not holds(t, w):
            refresh_transpose(w, t)
        return t

    def nonfinite_row(self) -> Optional[torch.Tensor]:
        """What non-finite up/down weights do to every output row of dense PyTorch, or ``None`` when
        they are finite: NaN in the columns that dense PyTorch makes NaN on every row, 0 elsewhere.

        Dense PyTorch multiplies inactive neurons by zero, and ``0 * NaN`` and ``0 * Inf`` are NaN: a
        non-finite ``up_proj`` weight makes every output NaN, a non-finite ``down_proj`` weight
        ``[j, n]`` makes column j NaN on every row. The sparse paths never read an inactive neuron's
        weights, so they add this row to match. Checked once per weight version (one host sync), and
        again after :meth:`invalidate_cache`; weights made under ``inference_mode`` have no version, so
        for them the row is computed on the device at every call (no sync; like their W_down copy).
        Compiled code and CUDA graph captures use the last eager answer (``None`` before any)."""
        up, down = self.up_proj.weight, self.down_proj.weight
        if torch.compiler.is_compiling() or (up.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None if self._nonfinite is None else self._nonfinite[1]
        with torch.no_grad():
            if up.is_inference() or down.is_inference():
                return _nonfinite_row(up, down)
            key = (weight_state(up), weight_state(down))
            if self._nonfinite is None or self._nonfinite[0] != key:
                row = _nonfinite_row(up, down)
                self._nonfinite = (key, row if bool(row.isnan().any()) else None)  # the one host sync
        return self._nonfinite[1]

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        t, w = self._w_down_t, self.down_proj.weight
        if t is not None and (t.device != w.device or t.dtype != w.dtype):
            self._w_down_t = None  # a copy for the weight before the move or conversion: free it now
        return out

    def __getstate__(self):
        # pickles and deep copies make their own transpose and planning state
        return {**super().__getstate__(), "_w_down_t": None, "_state": None}

    BIAS_ERROR = "the sparse TwELL paths support bias-free projections only (Llama MLPs have none unless mlp_bias=True)"

    def has_bias(self) -> bool:
        """Whether any projection carries a bias (the sparse paths take none: BIAS_ERROR)."""
        return any(p is not None and p.bias is not None for p in (self.gate_proj, self.up_proj, self.down_proj))

    def _sparse(self, x: torch.Tensor, route: routing.Route) -> torch.Tensor:
        """A sparse inference op of a Route: decode, sparse, gate-ffn or ffn on its impl. With
        ``route.checked`` ("auto"'s kernel route: bf16 CUDA input, bf16 contiguous aligned weights) the
        decoding op skips its Python checks; the extension still checks every tensor (a RuntimeError, not a
        ValueError)."""
        use_kernel = route.impl == "kernel"
        if use_kernel:
            from twell import kernels as impl
        else:
            from twell import reference as impl
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        elif use_kernel and impl.misaligned(x2):
            x2 = x2.clone()  # the kernels need 16-byte aligned rows; a view at an element offset is not
        op = route.op
        gate = None
        kw = self._gate_kwargs()  # {} for ReLU
        if op == "decode":
            # A few rows (generation): the gate read in full, only the active neurons' up and down rows
            # (docs/decoding.md); no TwELL. On a checked route (x2 contiguous and aligned here) the op skips
            # its Python checks: host time a token-by-token loop pays per layer.
            fn = impl.decode_gated_ffn_trusted if route.checked else impl.decode_gated_ffn
            out = fn(x2, self.gate_proj.weight, self.up_proj.weight, self.w_down_t(), **kw)
        elif op == "sparse":
            # One op: its TwELL stays inside, so the fused kernel can start on the SMs the gate
            # kernel's last wave leaves idle (docs/kernels.md §6).
            out = impl.sparse_gated_ffn(x2, self.gate_proj.weight, self.up_proj.weight, self.w_down_t(),
                                        self.tile, self.compression, union=self.union, **kw)
        elif op == "gate-ffn":  # the caller needs the TwELL: the gate op, then the fused op
            gate_kw = {"threshold": kw["threshold"]} if kw else {}
            up_kw = {"up_relu": kw["up_relu"]} if kw else {}
            gate = impl.twell_gate(x2, self.gate_proj.weight, tile=self.tile, compression=self.compression, **gate_kw)
            out = impl.twell_gated_ffn(x2, gate, self.up_proj.weight, self.w_down_t(), union=self.union, **up_kw)
        elif op == "ffn":
            gate = impl.twell_gate(x2, self.up_proj.weight, tile=self.tile, compression=self.compression)
            out = impl.twell_ffn(gate, self.w_down_t())
        else:
            raise ValueError(f"not a sparse inference op: {route!r}")
        if route.measure:
            self._measure_activity(gate)
        self.last_gate = gate if self.keep_gate else None
        poison = self.nonfinite_row()
        if poison is not None:
            out = out + poison
        return out.reshape(*shape[:-1], out.shape[-1])
