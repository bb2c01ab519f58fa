"""The training route's activity threshold from timings: the training op against dense on this GPU.

``train.sparse_max_active: auto`` (the default) measures, before the first step, forward + backward +
L1 term of one FFN of the model's shape at the run's rows per forward, dense against the training op, on
the calibrated generator (BENCHMARK.md) at a ladder of active neurons per row. The threshold is the
largest measured activity at which the op was faster than dense *and at every lower point of the
ladder*; a layer then trains sparse only at an activity the timings measured faster (and stays sparse
within a band that ends short of the first slower point, ``keep_max``). Where no point is
faster, the threshold is 0 and every layer trains dense, with that reason. With ``train.compile`` on,
the dense side is the compiled expression, as the trainer's dense layers are compiled.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import torch

# Active neurons per row of the ladder (of the paper's 5632; scaled to the layer's H): around the
# measured break-even at 16384 rows (near 49 of 5632, docs/training_kernels.md section 3).
LADDER = (8, 16, 24, 32, 40, 48, 56, 64, 80)
REF_H = 5632
TAIL = 0.1


@dataclass
class Calibration:
    """Timings of the training op against dense at one shape, and the threshold they give.

    points: one per ladder step: ``nnz`` (target active per row), ``active`` (its fraction of H),
            ``dense_ms``, ``sparse_ms``, ``speedup`` (dense / sparse)
    max_active: the threshold (a fraction of H; 0: the op was faster nowhere)
    """

    rows: int
    D: int
    H: int
    compiled_dense: bool
    impl: str
    points: list = field(default_factory=list)
    max_active: float = 0.0
    margin: float = 1.0

    @property
    def why(self) -> str:
        ok = [p for p in self.points if p["active"] <= self.max_active]
        base = f"{self.rows} rows, D {self.D}, H {self.H}, dense {'compiled' if self.compiled_dense else 'eager'}"
        if not ok:
            best = max(self.points, key=lambda p: p["speedup"]) if self.points else None
            return (f"the training op was not faster than dense at any measured activity ({base}"
                    + (f"; best {best['speedup']:.2f}x at {best['nnz']} active" if best else "") + ")")
        top = ok[-1]
        return (f"the training op measured faster than dense up to {top['nnz']} active per row "
                f"({100 * top['active']:.2f}%, {top['speedup']:.2f}x; {base})")

    @property
    def keep_max(self) -> float:
        """The top of the band in which a sparse layer stays sparse (SparseTraining's ``keep_max``): 1.25 x
        the threshold, but short of the first ladder point above it, which measured slower: halfway there."""
        above = [p["active"] for p in self.points if p["active"] > self.max_active]
        band = 1.25 * self.max_active
        return band if not above else min(band, (self.max_active + min(above)) / 2)

    def as_dict(self) -> dict:
        return {**asdict(self), "why": self.why, "keep_max": self.keep_max}

    @classmethod
    def from_metrics(cls, path, *, rows: int, D: int, H: int, compiled_dense: bool) -> Optional["Calibration"]:
        """The last ``ffn-calibration`` event of a run's metrics.jsonl made at this shape, or None: a resumed
        run keeps the threshold it started with (a new timing could route its layers differently)."""
        from pathlib import Path

        from twell.jsonl import iter_jsonl

        path = Path(path)
        if not path.is_file():
            return None
        found = None
        for _, rec in iter_jsonl(path, partial_last_ok=True):
            if (isinstance(rec, dict) and rec.get("event") == "ffn-calibration"
                    and (rec.get("rows"), rec.get("D"), rec.get("H"), rec.get("compiled_dense")) == (rows, D, H,
                                                                                                  compiled_dense)):
                found = rec
        if found is None:
            return None
        return cls(rows=rows, D=D, H=H, compiled_dense=compiled_dense, impl=found.get("impl", "kernel"),
                   points=list(found.get("points", [])), max_active=float(found["max_active"]),
                   margin=float(found.get("margin", 1.0)))


def can_time(ffns: Sequence, rows: int, min_rows: int) -> bool:
    """Whether a run's threshold is timed: forwards of at least the row floor (smaller ones train dense
    whatever the threshold) on layers the training op can run (others train dense with their reason)."""
    return rows >= min_rows and bool(ffns) and not ffns[0]._no_train_layer()


def choose_max_active(points: Sequence[dict], margin: float = 1.0) -> float:
    """The largest ``active`` of ``points`` whose speed-up, and that of every point of lower activity,
    exceeds ``margin`` (0 when the lowest point does not): the op is used only where it was measured
    faster, never across a slower point."""
    best = 0.0
    for p in sorted(points, key=lambda p: p["active"]):
        if not p["speedup"] > margin:
            break
        best = p["active"]
    return best


def _grad_out(rows: int, D: int, device, seed: int) -> torch.Tensor:
    """The output gradient the timings feed back (bf16 [rows, D], seeded)."""
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    return torch.randn(rows, D, generator=g).div_(math.sqrt(rows * D)).to(torch.bfloat16).to(device)


def _train_op(impl: str):
    """The training op of ``impl``: "kernel" (twell.kernels.training) or "reference"."""
    if impl == "kernel":
        from twell.kernels.training import train_gated_ffn
    elif impl == "reference":
        from twell.reference.training import train_gated_ffn
    else:
        raise ValueError(f"impl must be 'kernel' or 'reference', got {impl!r}")
    return train_gated_ffn


def _time_train_calls(calls: dict, leaves: Sequence[torch.Tensor], grad_out: torch.Tensor, device, reps: int,
                      warmup: int) -> dict:
    """{name: median ms} of forward + backward (the output and the L1 term) of each ``calls[name](*leaves) ->
    (out, l1)``, called in turn (twell.timing.time_alternating)."""
    from twell.bench.ffn import L1_COEF
    from twell.timing import time_alternating

    l1_grad = torch.tensor(L1_COEF, dtype=torch.float32, device=device)

    def step(fn):
        out, l1 = fn(*leaves)
        return torch.autograd.grad((out, l1), leaves, (grad_out, l1_grad.to(l1.dtype)))

    t = time_alternating({k: (lambda fn=fn: step(fn)) for k, fn in calls.items()}, device, reps=reps, warmup=warmup)
    return {k: t[k].median_ms for k in calls}


def calibrate(D: int, H: int, rows: int, device, *, compiled_dense: bool = False, impl: str = "kernel",
              ladder: Sequence[int] = LADDER, reps: int = 10, warmup: int = 3, margin: float = 1.0, seed: int = 0,
              progress: Optional[Callable[[dict], None]] = None) -> Calibration:
    """Time dense against the training op (``impl``: "kernel" or "reference") at ``rows`` rows of a
    D x H FFN, at each active count of ``ladder`` (scaled from H 5632 to H), and choose the threshold."""
    from twell.bench.ffn import dense_train_ffn
    from twell.bench.generator import calibrated_ffn_inputs

    train_gated_ffn = _train_op(impl)
    if rows < 1 or D < 1 or H < 1:
        raise ValueError(f"expected positive rows, D and H, got {rows}, {D}, {H}")
    device = torch.device(device)
    dense = torch.compile(dense_train_ffn) if compiled_dense else dense_train_ffn

    def sparse(x, wg, wu, wd):
        out, l1, _, _ = train_gated_ffn(x, wg, wu, wd)
        return out, l1

    cal = Calibration(rows=rows, D=D, H=H, compiled_dense=compiled_dense, impl=impl, margin=margin)
    nnzs = sorted({max(1, min(H, round(n * H / REF_H))) for n in ladder})
    grad_out = _grad_out(rows, D, device, seed)
    for nnz in nnzs:
        inp = calibrated_ffn_inputs(rows, D, H, nnz, TAIL, seed=seed, device=device)
        leaves = [t.detach().clone().requires_grad_(True) for t in (inp.x, inp.w_gate, inp.w_up, inp.w_down)]
        ms = _time_train_calls({"dense": dense, "sparse": sparse}, leaves, grad_out, device, reps, warmup)
        p = {"nnz": nnz, "active": nnz / H, "dense_ms": ms["dense"], "sparse_ms": ms["sparse"]}
        p["speedup"] = p["dense_ms"] / p["sparse_ms"]
        cal.points.append(p)
        if progress is not None:
            progress(p)
        del inp, leaves
    cal.max_active = choose_max_active(cal.points, margin)
    return cal


# Routes a layer can train by: dense, the training op, the op with the layer's hot neurons as dense columns.
LAYER_ROUTES = ("dense", "sparse", "hot")
# A layer timed on its own rows takes a sparse route only where it beat dense by this factor: alone, a layer that
# measured 1.03x faster with hot neurons made a compiled 0.5B step slower, not faster (8 x 1024 tokens: 1.039x
# against 1.085x with that layer dense, one pair of runs; docs/training_kernels.md section 3); every other layer
# the timed runs put on the kernels measured 1.16x or more.
ROUTE_MARGIN = 1.10


def time_layer(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
               compiled_dense: bool = False, impl: str = "kernel", hot_min_freq: Optional[float] = None,
               reps: int = 10, warmup: int = 3, margin: float = ROUTE_MARGIN, seed: int = 0) -> dict:
    """Time one layer's training routes on its own input x [M, D] (forward + backward + L1 term, alternating):
    dense (compiled with ``compiled_dense``), the training op, and, with ``hot_min_freq``, the op with the
    layer's hot neurons (``choose_hot`` on the gate's activity over x) as dense columns. The choice is the
    fastest route, but a sparse one only where it beats dense by ``margin``. Returns ``(record, hot)``: the
    record ``{"rows", "route", "dense_ms", "sparse_ms", "hot_ms" (None without a hot set), "hot_neurons",
    "hot_pair_share", "active_mean", "margin", "why"}`` (JSON-ready) and the hot set (None without one)."""
    from twell.bench.ffn import dense_train_ffn
    from twell.reference.training import choose_hot, gate_counts

    train_gated_ffn = _train_op(impl)
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"x must be [rows >= 1, D], got shape {tuple(x.shape)}")
    M, D = x.shape
    device = x.device
    # bf16, as the trainer hands the op a layer under autocast (its weights may be fp32)
    leaves = [t.detach().to(torch.bfloat16).contiguous().requires_grad_(True) for t in (x, w_gate, w_up, w_down)]
    counts = gate_counts(leaves[0], leaves[1])
    hot = choose_hot(counts, M, hot_min_freq) if hot_min_freq is not None else None
    if hot is not None and hot.numel() == 0:
        hot = None
    calls = {"dense": torch.compile(dense_train_ffn) if compiled_dense else dense_train_ffn,
             "sparse": lambda *a: train_gated_ffn(*a)[:2]}
    if hot is not None:
        calls["hot"] = lambda *a: train_gated_ffn(*a, hot=hot)[:2]
    ms = _time_train_calls(calls, leaves, _grad_out(M, D, device, seed), device, reps, warmup)
    best = min((k for k in ms if k != "dense"), key=ms.get)
    route = best if ms["dense"] / ms[best] > margin else "dense"
    total = max(1, int(counts.sum()))
    rec = {"rows": M, "route": route, "dense_ms": ms["dense"], "sparse_ms": ms["sparse"], "hot_ms": ms.get("hot"),
           "hot_neurons": 0 if hot is None else int(hot.numel()),
           "hot_pair_share": 0.0 if hot is None else int(counts[hot].sum()) / total,
           "active_mean": int(counts.sum()) / M, "margin": margin}
    speed = {k: ms["dense"] / v for k, v in ms.items() if k != "dense"}
    rec["why"] = (f"timed on the layer's own {M} rows ({rec['active_mean']:.1f} active per row): "
                  + ", ".join(f"{k} {v:.2f}x" for k, v in speed.items()) + " of dense"
                  + f" ({'compiled' if compiled_dense else 'eager'})"
                  + ("" if route != "dense" or speed[best] <= 1.0 else f"; under the margin {margin:.2f}x"))
    return rec, hot
