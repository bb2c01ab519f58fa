"""``SparseFFN.train_backend`` on the sparse training kernels, with a per-layer dense switch.

A layer trains through :func:`twell.kernels.training.train_gated_ffn` (or the pure-PyTorch reference
with ``impl="reference"``) once its measured activity is low enough; early in training, when the
ReLU gate is still about half open, the sparse kernels would be slower than dense, so the layer runs
dense. :meth:`SparseTraining.update` takes each layer's mean active neurons per token of the last
step, smooths it over steps (exponential average, weight ``1 - smoothing`` on the new value) and
sets the route for the next step: sparse at or below ``max_active`` (a fraction of the layer's
neurons), dense again only above ``keep_max`` (1.25 x ``max_active`` by default: no flapping around the
threshold).
The route changes between optimizer steps only, so an activation-checkpointed recompute always
takes the route its forward took.

The backend owns each layer's training state (:class:`LayerTraining`: the route it asks for, the
smoothed activity). Each call is planned by :func:`twell.nn.routing.plan_training`: a layer the op
cannot run (bias, D above the kernels' limit, another dtype, a CPU tensor, hooks on the projections)
runs dense with the reason in its ``last_route``, or raises with ``strict=True``
(``train.sparse_kernels=always``). :meth:`SparseTraining.route_events` reports, per layer, what was
asked, what ran and why, whenever any of it changed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from twell.nn.routing import Route, autocast_dtype, pct, plan_training, rows
from twell.reference.training import TRAIN_SLOTS

ROUTES = ("dense", "sparse")

# Default activity threshold: the fraction of a layer's neurons active per token at or below which it
# trains sparse: below the measured break-even of the training op against dense
# (docs/training_kernels.md, section 3).
MAX_ACTIVE = 0.008
# Default row floor: a forward of fewer rows (tokens) trains dense, where the training op's fixed costs
# (gate GEMM, compaction, work list, launches) outweigh the skipped work (docs/routing.md, "Training").
MIN_ROWS = 8192
# The reason a compiled training call's Route carries in place of the layer's ``why``: compiled code guards
# on every attribute it reads, so a per-layer reason string gave each layer its own graph, and past
# dynamo's recompile limit (8) the remaining layers ran eager. route_events puts the layer's why back.
COMPILED_WHY = "the reason set with the route"


@dataclass
class LayerTraining:
    """One layer's state in a :class:`SparseTraining` backend.

    route:     what the activity asks for on the next training calls, "dense" or "sparse"
    activity:  smoothed fraction of the layer's neurons active per token (None: not measured yet)
    why:       why the route is what it is, written when it was set (a reason that changed every step
               would log an event every step); compiled code does not read it (``COMPILED_WHY``)
    reported:  (route, ran, why, hot set size) as the last :meth:`SparseTraining.route_events` reported them
    hot:       neurons the training op computes as dense columns over every row (int64 [K] on the layer's
               device, set by :meth:`SparseTraining.set_hot`; None: none)
    timed:     the route was set from timings on the layer's own input (:meth:`SparseTraining.set_route`):
               :meth:`SparseTraining.update` then keeps it (and still smooths the activity)
    """

    route: str
    activity: Optional[float] = None
    why: str = ""
    reported: Optional[tuple] = None
    hot: Optional[torch.Tensor] = None
    timed: bool = False
    owner: Optional["SparseTraining"] = field(default=None, repr=False, compare=False)  # the backend it belongs to


class SparseTraining:
    """The training backend of SparseFFN layers: plans their training calls (:meth:`plan`), keeps their
    routes (:meth:`update`) and reports what ran (:meth:`route_events`). Calling it, ``backend(ffn, x)``,
    plans and runs one call."""

    def __init__(self, slots: int = TRAIN_SLOTS, max_active: float = MAX_ACTIVE, impl: str = "kernel",
                 start: str = "dense", smoothing: float = 0.9, strict: bool = False, min_rows: int = MIN_ROWS,
                 threshold_source: str = "set", keep_max: Optional[float] = None):
        if impl not in ("kernel", "reference"):
            raise ValueError(f"impl must be 'kernel' or 'reference', got {impl!r}")
        if not 0.0 <= max_active <= 1.0:
            raise ValueError(f"max_active is a fraction of the layer's neurons in [0, 1], got {max_active}")
        if start not in ROUTES:
            raise ValueError(f"start must be one of {ROUTES}, got {start!r}")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 0:
            raise ValueError(f"min_rows must be an integer >= 0, got {min_rows!r}")
        self.slots = slots
        self.max_active = max_active
        # a sparse layer goes dense again above this (the band against flapping); default 1.25 x max_active
        self.keep_max = 1.25 * max_active if keep_max is None else float(keep_max)
        if not self.keep_max >= max_active:
            raise ValueError(f"keep_max ({keep_max}) must be at least max_active ({max_active})")
        self.smoothing = smoothing
        self.impl = impl
        self.start = start
        self.strict = strict
        self.min_rows = min_rows
        self.threshold_source = threshold_source  # where max_active came from ("set", "timed", ...), for the reasons

    def __repr__(self) -> str:
        return (f"SparseTraining(impl={self.impl!r}, slots={self.slots}, max_active={self.max_active}, "
                f"min_rows={self.min_rows}" + (", strict" if self.strict else "") + ")")

    def layer(self, ffn) -> LayerTraining:
        """The backend's state of one layer (made on first use, with the start route). It is kept in the
        layer's declared ``train_state`` slot, which only the backend writes: a plain module attribute is
        what compiled code reads without a graph break, and it goes with the layer (copies, FSDP2)."""
        st = ffn.train_state
        if st is None or st.owner is not self:
            st = ffn.train_state = LayerTraining(route=self.start, why=f"start route {self.start}, activity not "
                                                 "measured yet", owner=self)
        return st

    def set_hot(self, ffn, hot: Optional[torch.Tensor]) -> None:
        """Give a layer's sparse training calls their hot neurons (:func:`twell.reference.training.choose_hot`;
        None or an empty set: none). The set changes no result, only which neurons go pair by pair; its values
        are checked here (one host read), and the op does not read them again."""
        from twell.reference.training import check_hot, check_hot_values

        H = ffn.intermediate_size
        if hot is not None:
            check_hot(hot, H, ffn.gate_proj.weight.device)
            check_hot_values(hot, H)
            if hot.numel() == 0:
                hot = None
        self.layer(ffn).hot = hot

    def set_route(self, ffn, route: str, why: str, hot: Optional[torch.Tensor] = None) -> None:
        """Fix a layer's route from timings on its own input (twell.train.calibration.time_layer): "dense",
        "sparse" or "hot" (sparse with ``hot`` as its hot neurons). The activity no longer moves it; a later
        call sets it again."""
        if route not in ROUTES + ("hot",):
            raise ValueError(f"route must be dense, sparse or hot, got {route!r}")
        if route == "hot" and (hot is None or hot.numel() == 0):
            raise ValueError("route hot needs a non-empty hot set")
        self.set_hot(ffn, hot if route == "hot" else None)
        st = self.layer(ffn)
        st.route = "dense" if route == "dense" else "sparse"
        st.why, st.timed = why, True

    def untime(self, ffn) -> None:
        """Hand a layer whose route was timed back to its activity (its inputs changed, e.g. neurons revived):
        the hot set goes, and the next :meth:`update` sets the route by the threshold."""
        st = self.layer(ffn)
        st.timed, st.hot = False, None

    def route(self, ffn) -> str:
        """The route this layer's next training calls ask for: "dense" or "sparse"."""
        return self.layer(ffn).route

    def _why(self, st: LayerTraining) -> str:
        rel = "<=" if st.activity <= self.max_active else ">"
        src = "" if self.threshold_source == "set" else f" ({self.threshold_source})"
        return (f"{pct(st.activity)} active per token {rel} {pct(self.max_active)}{src} when the route was set"
                + (f" (within the band up to {pct(self.keep_max)}: kept)" if st.route == "sparse" and rel == ">"
                   else ""))

    def plan(self, ffn, x: torch.Tensor) -> Route:
        """The Route of one training call of ``ffn`` on x (pure: changes nothing)."""
        st = self.layer(ffn)
        n = rows(x)
        sparse = st.route == "sparse"
        why = COMPILED_WHY if torch.compiler.is_compiling() else st.why
        if sparse and n < self.min_rows:
            sparse, why = False, f"{n} rows per forward < min_rows {self.min_rows}; {why}"
        return plan_training(ffn.train_layer_state(), x, sparse=sparse, impl=self.impl,
                             strict="train.sparse_kernels=always" if self.strict else None,
                             autocast_dtype=autocast_dtype(x), why=why, slots=self.slots)

    def __call__(self, ffn, x: torch.Tensor) -> torch.Tensor:
        return ffn.run(self.plan(ffn, x), x)

    def update(self, ffns: Sequence, active_mean: Sequence[float]) -> Optional[list[str]]:
        """Set each layer's route from its mean active neurons per token (one value per layer, e.g.
        the sparsity tracker's ``active_mean`` of the last step), smoothed over the calls
        (``layer(ffn).activity`` holds the smoothed fraction). Returns the new routes when any changed,
        else None."""
        if len(active_mean) != len(ffns):
            raise ValueError(f"{len(ffns)} layers but {len(active_mean)} activity values")
        changed = False
        for ffn, a in zip(ffns, active_mean):
            st = self.layer(ffn)
            first = st.activity is None
            frac = float(a) / ffn.intermediate_size
            frac = frac if first else self.smoothing * st.activity + (1 - self.smoothing) * frac
            st.activity = frac
            if st.timed:  # set from timings on the layer's own input: kept until timed again
                continue
            new = "sparse" if frac <= self.max_active else ("dense" if frac > self.keep_max else st.route)
            if new != st.route or first:
                changed = changed or new != st.route
                st.route = new
                st.why = self._why(st)
        return [self.route(f) for f in ffns] if changed else None

    def route_events(self, ffns: Sequence) -> Optional[dict]:
        """``{"routes", "ran", "why"}`` (one entry per layer: the route asked for the next calls, the path
        the last training call ran, its Route's reason; plus ``hot_neurons``, each layer's hot set size, when
        any layer has one) when any of them changed since the last report, else None. Call it after
        :meth:`update`, between steps."""
        now = []
        for f in ffns:
            r = f.last_route
            ran = ((r.path, r.reason.replace(COMPILED_WHY, self.layer(f).why)) if r is not None and r.training
                   else (None, ""))
            hot = self.layer(f).hot
            now.append((self.route(f), *ran, 0 if hot is None else int(hot.numel())))
        changed = False
        for f, rec in zip(ffns, now):
            st = self.layer(f)
            changed = changed or st.reported != rec
            st.reported = rec
        if not changed:
            return None
        out = {"routes": [r[0] for r in now], "ran": [r[1] for r in now], "why": [r[2] for r in now]}
        if any(r[3] for r in now):
            out["hot_neurons"] = [r[3] for r in now]
        return out


def use_sparse_training(model: torch.nn.Module, backend: Optional[SparseTraining] = None) -> SparseTraining:
    """Plug ``backend`` (default: a new :class:`SparseTraining`) into every SparseFFN of the model."""
    from twell.nn.ffn import SparseFFN

    backend = backend or SparseTraining()
    ffns = [m for m in model.modules() if isinstance(m, SparseFFN)]
    if not ffns:
        raise ValueError("the model has no SparseFFN layers")
    for f in ffns:
        f.train_backend = backend
    return backend
