"""``python -m twell.bench decode``: the gated FFN at decoding sizes, dense against sparse.

Generation runs the FFN on a few rows per step, where it is bound by reading the weights. For each
sparsity case (calibrated generator, D 2048, H 5632 by default) and each row count M, the benchmark
times, alternating in one process (shared/BENCHMARK.md), with every call replayed from a CUDA graph
so that launch overhead does not decide the comparison and with L2 overwritten before each call
(a model's other layers evict the weights between two calls of one layer):

- ``dense``: three cuBLAS GEMMs and the elementwise product, as PyTorch runs the dense layer;
- ``decode-kernel``: :func:`twell.kernels.decode_gated_ffn` (M <= 32): the gate read in full, only the
  active neurons' up and down rows;
- ``twell-kernel``: :func:`twell.kernels.sparse_gated_ffn`, the large-batch sparse path;
- ``auto``: what :class:`twell.nn.SparseFFN` with ``path="auto"`` runs at this M, when the layer
  takes the kernels (for a variant gate: dense, but for the decoding op on as few rows as its activity
  allows).

Each row records the measured active neurons per row and the union over the rows (the up and down
rows that must be read), the relative error of every output against dense (outputs poisoned with
NaN before the checked replay), and optionally NVML energy per token.

``gate``: "relu" (default), "fatrelu" or "drelu" (twell.reference.gates). FATReLU keeps each case's activity:
the gate's bias moves by ``threshold``, so that ``g > threshold`` holds about where the ReLU case had ``g > 0``.
dReLU keeps the gate's activity and biases the up projection so that ``up_active`` of its values are positive
(the active neurons are then those positive in both). The dense side computes the same variant; of the
kernels only the decoding op runs the variants (the large-batch op is skipped with the reason; ``auto`` is
the layer's own choice).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from twell.bench.generator import calibrated_ffn_inputs
from twell.bench.provenance import code_line, dirty_line, run_meta
from twell.bench.timing import graphed, time_alternating
from twell.reference.decode import DECODE_MAX_ROWS

DECODE_ROWS = (1, 4, 16, 64, 256, 2048)
DECODE_NNZ = {"nnz8": 8.0, "nnz29": 29.0, "nnz64": 64.0}  # the default cases; any "nnz<N>" names one more


def case_nnz(case: str) -> float:
    """Active neurons per row that a case name asks for: the default cases, or "nnz<N>" for N > 0."""
    if case in DECODE_NNZ:
        return DECODE_NNZ[case]
    m = re.fullmatch(r"nnz(\d+(?:\.\d+)?)", case)
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"unknown case {case!r}: {sorted(DECODE_NNZ)} or nnz<N> (N active neurons per row, N > 0)")
    return float(m.group(1))
IMPLS = ("decode-kernel", "twell-kernel", "auto")
GATES = ("relu", "fatrelu", "drelu")


@dataclass
class DecodeBenchConfig:
    rows: tuple[int, ...] = DECODE_ROWS
    cases: tuple[str, ...] = tuple(DECODE_NNZ)
    D: int = 2048
    H: int = 5632
    impls: tuple[str, ...] = IMPLS
    reps: int = 50
    warmup: int = 5
    seed: int = 0
    device: str = "cuda"
    graphs: bool = True
    flush_l2: bool = True
    energy_rows: tuple[int, ...] = (1, 16)  # energy loops only at these M (2 s per implementation each)
    energy_seconds: float = 2.0
    tol: float = 1e-2
    gate: str = "relu"
    threshold: float = 0.01  # FATReLU's (gate "fatrelu" only)
    up_active: float = 0.3   # dReLU: fraction of up values made positive (gate "drelu" only)

    def __post_init__(self):
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {self.gate!r}")
        if not (math.isfinite(self.threshold) and self.threshold > 0):
            raise ValueError(f"threshold must be finite and > 0, got {self.threshold!r}")
        if not 0 < self.up_active < 1:
            raise ValueError(f"up_active must be in (0, 1), got {self.up_active!r}")
        for c in self.cases:
            if case_nnz(c) > self.H:
                raise ValueError(f"case {c!r} asks for more active neurons than H={self.H}")
        bad = [i for i in self.impls if i not in IMPLS]
        if bad:
            raise ValueError(f"unknown implementation(s) {bad}: choose from {list(IMPLS)}")
        if not self.rows or any(int(m) < 1 for m in self.rows):
            raise ValueError(f"rows must be positive, got {self.rows}")
        if self.reps < 1 or self.warmup < 0:
            raise ValueError(f"reps must be >= 1 and warmup >= 0, got {self.reps}, {self.warmup}")
        if self.D % 64 or self.D <= 0 or self.H < 1:
            raise ValueError(f"D must be a positive multiple of 64 and H >= 1, got D={self.D}, H={self.H}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float((a - b).norm())


def gate_kwargs(cfg: DecodeBenchConfig) -> dict:
    """The ops' gate keywords of ``cfg.gate`` ({} for ReLU)."""
    return {"relu": {}, "fatrelu": {"threshold": cfg.threshold}, "drelu": {"up_relu": True}}[cfg.gate]


def gate_settings(cfg: DecodeBenchConfig) -> tuple[float, bool]:
    """(threshold, up_relu) of ``cfg.gate`` (twell.reference.gates.settings)."""
    from twell.reference.gates import settings

    return settings(cfg.gate, cfg.threshold)


def variant_inputs(cfg: DecodeBenchConfig, x, w_gate, w_up) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_gate, w_up) for ``cfg.gate`` from the ReLU case's (x[:, 0] is the generator's constant feature, whose
    weights are the biases): FATReLU's gate bias moved up by the threshold, dReLU's up bias set so that
    ``up_active`` of the up values are positive. ReLU: unchanged."""
    from twell.bench.generator import bisect_bias

    if cfg.gate == "fatrelu":
        w_gate = w_gate.clone()
        w_gate[:, 0] += cfg.threshold  # g + t > t where g > 0 (up to bf16 rounding; the row measures it)
    elif cfg.gate == "drelu":
        w_up = w_up.clone()
        w_up[:, 0] = 0
        u = F.linear(x, w_up).float()
        w_up[:, 0] = -bisect_bias(u, cfg.up_active * u.numel())
    return w_gate, w_up


def _dense_fn(cfg: DecodeBenchConfig, x, w_gate, w_up, w_down) -> Callable[[], torch.Tensor]:
    """The dense layer of ``cfg.gate`` in PyTorch, its fastest expression: FATReLU as ``F.threshold`` (one
    kernel, where twell.reference.gates' ``where`` takes two; docs/models.md has both timings). On CUDA the two
    give the same values (NaN kept, the threshold compared in bf16); the op's output is checked against this."""
    if cfg.gate == "fatrelu":
        t = cfg.threshold
        return lambda: F.linear(F.threshold(F.linear(x, w_gate), t, 0.0) * F.linear(x, w_up), w_down)
    if cfg.gate == "drelu":
        return lambda: F.linear(F.relu(F.linear(x, w_gate)) * F.relu(F.linear(x, w_up)), w_down)
    return lambda: F.linear(F.relu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def _candidates(cfg: DecodeBenchConfig, M: int, x, w_gate, w_up, w_down_t) -> tuple[dict, dict]:
    """({impl: fn}, {impl: why unavailable}) for M rows."""
    fns, skipped = {}, {}
    kw = gate_kwargs(cfg)
    on_cuda = x.is_cuda
    if on_cuda:
        from twell import kernels

        ok, why = kernels.available()
    else:
        ok, why = False, "CPU run: the kernels need a CUDA GPU"
    for name in cfg.impls:
        if name == "decode-kernel":
            if M > DECODE_MAX_ROWS:
                skipped[name] = f"takes at most {DECODE_MAX_ROWS} rows"
            elif ok:
                fns[name] = lambda: kernels.decode_gated_ffn(x, w_gate, w_up, w_down_t, **kw)
            else:
                from twell.reference import decode_gated_ffn

                fns[name + " (reference)"] = lambda: decode_gated_ffn(x, w_gate, w_up, w_down_t, **kw)
        elif name == "auto":
            fns[name] = _auto_layer(x, w_gate, w_up, w_down_t, cfg.gate, kw.get("threshold", 0.0))
        elif kw:
            skipped[name] = f"gate {cfg.gate}: only the decoding op runs it on the kernels"
        elif name == "twell-kernel":
            if ok:
                fns[name] = lambda: kernels.sparse_gated_ffn(x, w_gate, w_up, w_down_t)
            else:
                skipped[name] = why
    return fns, skipped


def _auto_layer(x, w_gate, w_up, w_down_t, gate: str = "relu", threshold: float = 0.0) -> Callable[[], torch.Tensor]:
    """A SparseFFN with this gate variant holding these weights on path "auto", called on x (it picks its path
    by M; its first call, a warm-up outside any capture, measures its activity)."""
    from twell.nn.ffn import SparseFFN

    H, D = w_gate.shape
    layer = SparseFFN(D, H, activation=gate, threshold=threshold).to(device=x.device, dtype=x.dtype)
    with torch.no_grad():
        layer.gate_proj.weight.copy_(w_gate)
        layer.up_proj.weight.copy_(w_up)
        layer.down_proj.weight.copy_(w_down_t.t())
    layer.invalidate_cache()
    layer.eval()

    def run():
        with torch.no_grad():
            return layer(x)

    run.layer = layer  # type: ignore[attr-defined]
    return run


def run_decode_bench(cfg: DecodeBenchConfig, progress: bool = True, allow_dirty: bool = False) -> dict:
    """Every case and row count of ``cfg``; a JSON-ready dict (``meta``, ``rows``, ``failures``). A GPU run from a
    tree with local changes raises :class:`twell.bench.provenance.DirtyTreeError` before measuring anything,
    unless ``allow_dirty``: then its record says so."""
    device = torch.device(cfg.device)
    started = run_meta(device, allow_dirty=allow_dirty)  # the tree as the run starts
    graphs = cfg.graphs and device.type == "cuda"
    meter, energy_note = None, None
    if cfg.energy_rows and device.type == "cuda":
        from twell.bench.energy import EnergyMeter, EnergyUnavailable

        try:
            meter = EnergyMeter(device)
        except EnergyUnavailable as exc:
            energy_note = str(exc)
    elif cfg.energy_rows:
        energy_note = "no energy on CPU"
    from twell.progress import progress_bar

    rows, failures = [], []
    work = [(c, int(m)) for c in cfg.cases for m in cfg.rows]
    bar = progress_bar(total=len(work), desc="decode bench", progress=progress)
    for case, M in work:
        inp = calibrated_ffn_inputs(M, cfg.D, cfg.H, case_nnz(case), tail=0.0, seed=cfg.seed + M, device=device)
        x, w_gate, w_up, w_down = inp.x, inp.w_gate, inp.w_up, inp.w_down
        w_gate, w_up = variant_inputs(cfg, x, w_gate, w_up)
        w_down_t = w_down.t().contiguous()
        with torch.no_grad():
            from twell.reference.gates import active as gate_active

            threshold, up_relu = gate_settings(cfg)
            g = F.linear(x, w_gate)
            g_on = gate_active(g, None, threshold)
            active = gate_active(g, F.linear(x, w_up), threshold, up_relu) if up_relu else g_on
        row = {"case": case, "M": M, "gate": cfg.gate, "nnz_target": case_nnz(case),
               "nnz_measured": float(active.sum(1).float().mean()), "union": int(active.any(0).sum()),
               "gate_union": int(g_on.any(0).sum()), "impls": {}}
        dense = _dense_fn(cfg, x, w_gate, w_up, w_down)

        fns, skipped = _candidates(cfg, M, x, w_gate, w_up, w_down_t)
        fns = {"dense": dense, **fns}
        row["skipped"] = skipped
        timed, outs = {}, {}
        for name, fn in fns.items():
            try:
                if graphs:
                    timed[name], outs[name] = graphed(fn, device)
                else:
                    timed[name], outs[name] = fn, None
            except Exception as exc:  # reported, not hidden: the row says which implementation failed
                failures.append(f"{case} M={M} {name}: {type(exc).__name__}: {exc}")
        with torch.no_grad():
            ref = dense()
            for name in list(timed):
                if outs[name] is not None:
                    outs[name].fill_(float("nan"))  # an unwritten element fails the check
                    timed[name]()
                    got = outs[name]
                else:
                    got = fns[name]()
                err = _rel(got, ref)
                row["impls"][name] = {"rel_err": err}
                if not err < cfg.tol:
                    failures.append(f"{case} M={M} {name}: relative error {err:.3e} >= {cfg.tol:g}")
                layer = getattr(fns[name], "layer", None)
                if layer is not None:
                    row["impls"][name]["ran"] = layer.last_path
                    row["impls"][name]["note"] = layer.auto_note
        times = time_alternating(timed, device, reps=cfg.reps, warmup=cfg.warmup, flush_l2=cfg.flush_l2)
        for name, t in times.items():
            row["impls"][name].update(t.as_dict())
            row["impls"][name]["speedup"] = times["dense"].median_ms / t.median_ms
        if meter is not None and M in cfg.energy_rows:
            for name, fn in timed.items():
                e = meter.measure(fn, cfg.energy_seconds)
                row["impls"][name]["uj_per_token"] = e.per_token(M) * 1e6
        rows.append(row)
        bar.update(1)
        del inp, x, w_gate, w_up, w_down, w_down_t, timed, outs, fns
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    meta = {
        **started,
        "clock": "cuda-events" if device.type == "cuda" else "perf_counter (CPU: not the benchmark protocol)",
        "graphs": graphs, "config": dataclasses.asdict(cfg), "energy_note": energy_note,
    }
    return {"meta": meta, "rows": rows, "failures": failures}


def markdown_report(result: dict) -> str:
    meta = result["meta"]
    cfg = meta["config"]
    gate = cfg.get("gate", "relu")
    variant = {"relu": "", "fatrelu": f"; gate FATReLU, threshold {cfg.get('threshold')}",
               "drelu": f"; gate dReLU, {cfg.get('up_active')} of up values positive (active/row and union: "
                        "positive in both; the up rows read are the gate's union)"}[gate]
    lines = [f"# Decoding FFN benchmark ({meta['device_name']}, {meta['timestamp']})", "",
             f"D {cfg['D']}, H {cfg['H']}{variant}; calibrated generator; median of {cfg['reps']} reps, "
             f"{'CUDA graph replays' if meta['graphs'] else 'eager calls'}, L2 "
             f"{'overwritten' if cfg['flush_l2'] else 'kept'} before each call; clock: {meta['clock']}.", ""]
    if meta.get("code"):
        lines += [code_line(meta["code"]), ""]
    if dirty_line(meta):
        lines += [dirty_line(meta), ""]
    if meta["device"].startswith("cpu"):
        lines += ["> CPU run: these are not GPU numbers.", ""]
    names = []
    for r in result["rows"]:
        for n in r["impls"]:
            if n != "dense" and n not in names:
                names.append(n)
    head = "| case | M | active/row | union | dense us | " + " | ".join(f"{n} us (x)" for n in names) + " |"
    lines += [head, "|" + "---|" * (5 + len(names))]
    for r in result["rows"]:
        d = r["impls"].get("dense", {})
        cells = [r["case"], str(r["M"]), f"{r['nnz_measured']:.1f}", str(r["union"]),
                 f"{d.get('median_ms', float('nan')) * 1e3:.1f}"]
        for n in names:
            i = r["impls"].get(n)
            if i is None or "median_ms" not in i:
                cells.append("-")
            else:
                extra = f", {i['ran']}" if i.get("ran") else ""
                cells.append(f"{i['median_ms'] * 1e3:.1f} ({i['speedup']:.2f}x{extra})")
        lines.append("| " + " | ".join(cells) + " |")
    energy = [(r, n, i) for r in result["rows"] for n, i in r["impls"].items() if "uj_per_token" in i]
    if energy:
        lines += ["", "Energy per token (uJ, NVML, loops of >= "
                  f"{cfg['energy_seconds']} s):", "", "| case | M | impl | uJ/token |", "|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['M']} | {n} | {i['uj_per_token']:.1f} |" for r, n, i in energy]
    elif meta.get("energy_note"):
        lines += ["", f"Energy not measured: {meta['energy_note']}."]
    if result["failures"]:
        lines += ["", "FAILURES:", *[f"- {f}" for f in result["failures"]]]
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out_dir: Path, tag: str = "") -> tuple[Path, Path]:
    """decode-<device>-<timestamp>[-tag].json and .md under out_dir."""
    from twell.bench.ffn import write_result

    return write_result(result, out_dir, "decode", markdown_report(result), tag)


def config_from_args(args) -> DecodeBenchConfig:
    return DecodeBenchConfig(
        rows=tuple(args.M), cases=tuple(args.cases), D=args.D, H=args.H, impls=tuple(args.impl), reps=args.reps,
        warmup=args.warmup, seed=args.seed, device=args.device, graphs=not args.no_graphs,
        flush_l2=not args.no_flush_l2, energy_rows=() if args.no_energy else tuple(args.energy_M),
        energy_seconds=args.energy_seconds, tol=args.tol, gate=args.gate, threshold=args.threshold,
        up_active=args.up_active)


def add_arguments(p) -> None:
    p.add_argument("--M", nargs="+", type=int, default=list(DECODE_ROWS), help="rows per call")
    p.add_argument("--cases", nargs="+", default=list(DECODE_NNZ),
                   help="calibrated cases: nnz8 nnz29 nnz64 (default) or nnz<N>, N active neurons per row")
    p.add_argument("--D", type=int, default=2048)
    p.add_argument("--H", type=int, default=5632)
    p.add_argument("--impl", nargs="+", choices=list(IMPLS), default=list(IMPLS),
                   help="sparse implementations besides dense")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-2)
    p.add_argument("--no-graphs", action="store_true", help="time eager calls instead of CUDA graph replays")
    p.add_argument("--no-flush-l2", action="store_true")
    p.add_argument("--no-energy", action="store_true")
    p.add_argument("--energy-M", nargs="+", type=int, default=[1, 16])
    p.add_argument("--energy-seconds", type=float, default=2.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path)
    p.add_argument("--tag", default="")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--gate", choices=GATES, default="relu", help="the gate variant (twell.reference.gates)")
    p.add_argument("--threshold", type=float, default=0.01, help="FATReLU's gate threshold (--gate fatrelu)")
    p.add_argument("--up-active", type=float, default=0.3,
                   help="dReLU: fraction of the up values made positive (--gate drelu)")
