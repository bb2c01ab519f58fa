"""Notebook 01's helpers: verify the TwELL ops, find benchmark results, tabulate and plot speedups.

- :func:`verify_ops` runs the three TwELL ops of ``twell.kernels`` (CUDA) or ``twell.reference``
  (pure PyTorch; both have the same signatures) on calibrated inputs with heavy rows and compares
  each with an fp64 reference: an op passes when its relative error is within a small multiple of
  the error dense bf16 PyTorch makes on the same inputs (the rule of tests/test_kernels.py).
- :func:`find_bench_json` / :func:`earlier_bench` pick the newest GPU result of
  ``python -m twell.bench ffn`` (``ffn-*.json``) by its recorded timestamp; :class:`BenchRun`
  carries a result with where and when it was measured, and whether that was in this run.
- :func:`speedup_table` and :func:`plot_speedup` turn a result into the table and figure of
  notebook 01, with the project's speed targets and the published kernels' numbers for context;
  :func:`impl_names` lists a result's implementations (the figure adds the others' real layers).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
from pathlib import Path
from types import ModuleType
from typing import Iterable, Sequence

import pandas as pd
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from twell.bench.ffn import Poison, run_deviations
from twell.bench.generator import calibrated_ffn_inputs, sparsity_stats
from twell import paths

# The project's speed targets, "speed bar" (H100, M = 65536, D = 2048, H = 5632; ratio vs dense PyTorch in
# the same run; docs/kernels.md §14).
SPEED_BAR: dict[str, float] = {"nnz8": 2.8, "nnz29": 2.2, "nnz64": 1.5, "nnz29-heavy": 1.8}
BAR_M = 65536
# The paper's published kernels on an H100 SXM with BENCHMARK.md (shared/KERNEL_NOTES.md):
# case -> (their measured mean nnz, dense ms, published kernels ms). On the heavy tail they are wrong.
PUBLISHED_MS: dict[str, tuple[float, float, float]] = {
    "nnz8": (8, 7.13, 3.16), "nnz29": (28, 7.16, 4.64), "nnz64": (63, 7.22, 7.19)}
PUBLISHED_HEAVY = "wrong results (rel. error 0.28-0.51)"
HEAVY_CASE = "nnz29-heavy"
OPS = ("gate -> TwELL", "fused gated up/down", "non-gated down")


def published_speedup(case: str) -> float | None:
    """Published kernels' speedup for a BENCHMARK.md case (None: no number; heavy tail: wrong results)."""
    entry = PUBLISHED_MS.get(case)
    return entry[1] / entry[2] if entry else None


# ------------------------------------------------------------------ correctness
@dataclasses.dataclass(frozen=True)
class VerifyShape:
    """One verification input: M tokens, D hidden, H intermediate, target mean nnz, tail."""

    M: int
    D: int
    H: int
    nnz: float
    tail: float

    @classmethod
    def parse(cls, item) -> "VerifyShape":
        """From ``[M, D, H, nnz, tail]`` (a profile entry); raises ValueError naming what was expected."""
        if isinstance(item, VerifyShape):
            return item
        if not isinstance(item, (list, tuple)) or len(item) != 5:
            raise ValueError(f"expected a verification shape [M, D, H, nnz, tail], got {item!r}")
        M, D, H, nnz, tail = item
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (M, D, H)):
            raise ValueError(f"expected positive ints M, D, H in [M, D, H, nnz, tail], got {item!r}")
        if not (0 < float(nnz) < H) or not float(tail) >= 0:
            raise ValueError(f"expected 0 < nnz < H and tail >= 0 in [M, D, H, nnz, tail], got {item!r}")
        return cls(M, D, H, float(nnz), float(tail))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (inf when out holds a NaN/inf)."""
    if out.numel() == 0:
        return 0.0
    num = (out.double() - ref).norm().item()
    den = ref.norm().item()
    if not math.isfinite(num):
        return math.inf
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def heavy_inputs(shape: VerifyShape, heavy_rows: int, seed: int, device, scale: float = 4.0):
    """Calibrated inputs (BENCHMARK.md generator) with ``min(heavy_rows, M // 2)`` rows of x scaled by
    ``scale`` (so some rows always stay light).

    Scaling x[r, 1:] (column 0 carries the gate offsets) turns a row into one with hundreds to
    thousands of active neurons, which overflows TwELL tiles. Returns (inputs, heavy row indices).
    """
    if not isinstance(heavy_rows, int) or heavy_rows < 0:
        raise ValueError(f"expected heavy_rows a non-negative int, got {heavy_rows!r}")
    inp = calibrated_ffn_inputs(shape.M, shape.D, shape.H, shape.nnz, shape.tail, seed=seed, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    n = min(heavy_rows, shape.M // 2)
    rows = torch.randperm(shape.M, generator=g)[:n].sort().values.to(inp.x.device)
    inp.x[rows, 1:] *= scale
    return inp, rows


def verify_ops(ops: ModuleType, shapes: Iterable, device="cpu", seed: int = 0, heavy_rows: int = 4,
               factor: float = 3.0, reference: ModuleType | None = None, progress: bool = True,
               heavy_scale: float = 4.0) -> pd.DataFrame:
    """Check ``ops.twell_gate``, ``ops.twell_gated_ffn`` and ``ops.twell_ffn`` against fp64.

    ``ops`` is ``twell.kernels`` or ``twell.reference`` (same signatures). For every shape
    ``[M, D, H, nnz, tail]`` (fresh calibrated inputs, seed + index, ``heavy_rows`` rows made heavy by
    scaling x by ``heavy_scale``, see :func:`heavy_inputs`),
    each op's output is compared with an fp64 reference separately on the heavy rows and on the
    other rows (the heavy rows dominate the norm and would hide errors elsewhere). Passes when
    ``err <= factor * dense_bf16_err + 1e-4`` and the output is finite. When ``reference`` is given
    (the kernels' run), ``vs reference`` is the relative difference to ``twell.reference``.
    One row per (shape, op, row group).
    """
    from twell.progress import progress_bar
    from twell.reference import dense_gated_ffn

    shapes = [VerifyShape.parse(s) for s in shapes]
    if not shapes:
        raise ValueError("expected at least one verification shape [M, D, H, nnz, tail]")
    for name in ("twell_gate", "twell_gated_ffn", "twell_ffn"):
        if not callable(getattr(ops, name, None)):
            raise TypeError(f"ops must provide {name} (twell.kernels or twell.reference), got {ops!r}")
    device = torch.device(device)
    rows_out = []
    for i, shape in enumerate(progress_bar(shapes, progress=progress, desc="verify", unit="shape")):
        inp, heavy = heavy_inputs(shape, heavy_rows, seed + i, device, scale=heavy_scale)
        x, wg, wu, wd = inp.x, inp.w_gate, inp.w_up, inp.w_down
        wdt = wd.t().contiguous()
        stats = sparsity_stats(F.relu(F.linear(x, wg)))
        # fp64 references and the dense bf16 baselines of the same (bf16) inputs.
        x64 = x.double()
        h64 = F.relu(x64 @ wg.double().t())
        refs = {OPS[0]: h64, OPS[1]: (h64 * (x64 @ wu.double().t())) @ wd.double().t(), OPS[2]: h64 @ wd.double().t()}
        del x64
        dense = {OPS[0]: F.relu(F.linear(x, wg)), OPS[1]: dense_gated_ffn(x, wg, wu, wd),
                 OPS[2]: F.linear(F.relu(F.linear(x, wg)), wd)}
        gate = ops.twell_gate(x, wg)
        gate.validate()
        poison = Poison(device, shape.M * shape.D * 2)
        gated = ops.twell_gated_ffn(x, gate, wu, wdt)
        poisoned = poison.hit(gated)
        outs = {OPS[0]: gate.unpack(), OPS[1]: gated, OPS[2]: ops.twell_ffn(gate, wdt)}
        if reference is not None:
            rgate = reference.twell_gate(x, wg)
            theirs = {OPS[0]: rgate.unpack(), OPS[1]: reference.twell_gated_ffn(x, rgate, wu, wdt),
                      OPS[2]: reference.twell_ffn(rgate, wdt)}
        mask = torch.zeros(shape.M, dtype=torch.bool, device=x.device)
        mask[heavy] = True
        groups = [(f"heavy ({int(mask.sum())})", mask), ("other", ~mask)] if heavy.numel() else [("all", ~mask)]
        for op in OPS:
            for label, sel in groups:
                if not bool(sel.any()):
                    continue
                out, ref = outs[op][sel], refs[op][sel]
                err, base = _rel(out, ref), _rel(dense[op][sel], ref)
                finite = bool(torch.isfinite(out).all())
                rows_out.append({
                    "M": shape.M, "D": shape.D, "H": shape.H, "target nnz": shape.nnz, "tail": shape.tail,
                    "nnz mean": stats["mean_active"], "nnz max": stats["max_active"],
                    "overflow tile rows": gate.n_overflow_tiles, "op": op, "rows": label,
                    "rel. error vs fp64": err, "dense bf16 error": base,
                    "ratio": err / base if base > 0 else (0.0 if err == 0 else math.inf),
                    "vs reference": _rel(out, theirs[op][sel].double()) if reference is not None else math.nan,
                    "output poisoned": "n/a" if poisoned is None or op != OPS[1] else ("yes" if poisoned else "no"),
                    "ok": "yes" if finite and err <= factor * base + 1e-4 else "NO",
                })
        del refs, dense, outs, gate
        if reference is not None:
            del theirs, rgate
    return pd.DataFrame(rows_out)


def assert_verified(table: pd.DataFrame) -> None:
    """Raise AssertionError naming every failing (shape, op, rows) of a :func:`verify_ops` table."""
    if table.empty:
        raise AssertionError("the verification table is empty: nothing was checked")
    bad = table[table["ok"] != "yes"]
    if len(bad):
        lines = [f"M={r['M']} D={r['D']} H={r['H']} nnz={r['target nnz']:g} tail={r['tail']:g}: {r['op']} "
                 f"({r['rows']} rows): rel. error {r['rel. error vs fp64']:.3g} vs dense bf16 {r['dense bf16 error']:.3g}"
                 for _, r in bad.iterrows()]
        raise AssertionError("TwELL ops outside tolerance:\n  " + "\n  ".join(lines))


# ------------------------------------------------------------------ benchmark results
@dataclasses.dataclass
class BenchRun:
    """A result of ``twell.bench.ffn`` (the dict of write_outputs' JSON), its file and provenance."""

    result: dict
    path: Path | None
    this_run: bool

    @property
    def device_name(self) -> str:
        return self.result["meta"]["device_name"]

    @property
    def timestamp(self) -> str:
        return self.result["meta"]["timestamp"]

    def banner(self, sep: str = " ") -> str:
        """Where and when the numbers were measured (loud when not in this run); ``sep="\n"``: two lines."""
        name = self.path.name if self.path is not None else "not saved"
        partial = "" if self.result.get("complete", True) else " (PARTIAL: the run did not finish)"
        below = run_deviations(self.result["meta"])
        if below:
            partial += " (BELOW THE BENCHMARK.md PROTOCOL: " + "; ".join(below) + ")"
        if self.this_run:
            return f"measured in this run on {self.device_name} at {self.timestamp}{sep}({name}){partial}"
        return (f"MEASURED EARLIER on {self.device_name} at {self.timestamp}, NOT IN THIS RUN{sep}"
                f"(loaded from {name}){partial}")


def _timestamp(result: dict) -> _dt.datetime:
    t = _dt.datetime.fromisoformat(result["meta"]["timestamp"])
    return t if t.tzinfo is not None else t.replace(tzinfo=_dt.timezone.utc)  # written by hand: read as UTC


def load_bench(path: str | Path, require_gpu: bool = True) -> dict:
    """Read a benchmark JSON; raises with the expected layout when it is not one (or, with
    ``require_gpu``, when it was measured on a CPU: tiny shapes with perf_counter, not the protocol)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"benchmark JSON not found: {path} (expected an ffn-*.json of python -m twell.bench ffn)")
    try:
        result = json.loads(path.read_text())
        meta = result["meta"]
        _timestamp(result)
        meta["device"], meta["device_name"], result["cases"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} is not a result of python -m twell.bench ffn (expected 'meta' with device, "
                         f"device_name and an ISO timestamp, and 'cases'): {type(exc).__name__}: {exc}") from exc
    if require_gpu and not str(meta["device"]).startswith("cuda"):
        raise ValueError(f"{path} was measured on {meta['device']!r} ({meta.get('clock')}), not on a GPU: "
                         f"its timings are not the benchmark protocol; give a JSON from a GPU run")
    return result


def bench_out_dir(reports_dir: str | Path | None = None) -> Path:
    """``<reports_dir>/bench``, or reports/bench (``$TWELL_REPORTS`` respected) when None."""
    if reports_dir is None:
        return paths.reports_dir("bench", create=False)
    return Path(reports_dir).expanduser() / "bench"


def bench_dirs(reports_dir: str | Path | None = None) -> list[Path]:
    """Where benchmark JSONs are looked for: :func:`bench_out_dir` and the repository's reports/bench
    (so a run writing to a scratch reports dir still finds the committed GPU results)."""
    unique: list[Path] = []
    for d in (bench_out_dir(reports_dir), paths.repo_root() / "reports" / "bench"):
        if all(d.resolve() != u.resolve() for u in unique):
            unique.append(d)
    return unique


def find_bench_json(dirs: Sequence[str | Path], pattern: str = "ffn-*.json") -> Path | None:
    """The GPU benchmark JSON with the newest ``meta.timestamp`` in ``dirs`` (not file times; files
    that are not benchmark results, were measured on a CPU, ran below the BENCHMARK.md protocol (fewer
    than 30 reps, ...), or hold no generator inference case, such as a run of a checkpoint's real
    layers alone, are skipped); None when there is none."""
    best, best_key = None, None
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            continue
        for path in sorted(d.glob(pattern)):
            try:
                result = load_bench(path)
            except (ValueError, OSError):
                continue
            if not any(r["case"]["kind"] in ("inference", "odd") for r in result["cases"]):
                continue
            if run_deviations(result["meta"]):
                continue
            key = (_timestamp(result), path.name)
            if best_key is None or key > best_key:
                best, best_key = path, key
    return best


def earlier_bench(bench_json: str | Path | None = None, reports_dir: str | Path | None = None) -> BenchRun | None:
    """The result to show when none is measured in this run: ``bench_json`` when given (must exist),
    else the newest GPU ``ffn-*.json`` in :func:`bench_dirs`; None when there is none."""
    path = Path(bench_json).expanduser() if bench_json is not None else find_bench_json(bench_dirs(reports_dir))
    if path is None:
        return None
    return BenchRun(load_bench(path), path, this_run=False)


def impl_names(result: dict) -> list[str]:
    """The sparse implementations a result holds, the default one (what :func:`speedup_table` shows
    without ``impl``: twell-kernel when present) first, the others in the order the run used them."""
    names = list(dict.fromkeys(n for r in result["cases"] if r["case"]["kind"] != "train"
                               for n in r.get("impls", {})))  # training implementations have no speedup row
    if "twell-kernel" in names:
        names.remove("twell-kernel")
        names.insert(0, "twell-kernel")
    return names


def _impl_name(result: dict, impl: str | None) -> str | None:
    names = impl_names(result)
    if impl is not None:
        if impl not in names:
            raise ValueError(f"implementation {impl!r} not in the result (it has: {sorted(names) or 'none'})")
        return impl
    return names[0] if names else None


def speedup_table(run: BenchRun, impl: str | None = None) -> pd.DataFrame:
    """One row per inference, odd and real (checkpoint layer) case of the result: measured nnz,
    times, speedup, error, ceiling, the speed bar and the published kernels' speedup (both defined
    at M = 65536 only), whether the bar is met (speedup >= bar and correct), and where/when it was
    measured."""
    result = run.result
    name = _impl_name(result, impl)
    rows = []
    for r in result["cases"]:
        c, s = r["case"], r["sparsity"]
        if c["kind"] == "train":
            continue
        v = r.get("impls", {}).get(name, {}) if name else {}
        dense_ms = r["dense"].get("timing", {}).get("median_ms", math.nan)
        sparse_ms = v.get("timing", {}).get("median_ms", math.nan)
        at_bar_shape = c["kind"] == "inference" and c["M"] == BAR_M and c["D"] == 2048 and c["H"] == 5632
        bar = SPEED_BAR.get(c["sparsity"]) if at_bar_shape else None
        pub = published_speedup(c["sparsity"]) if at_bar_shape else None
        speedup = v.get("speedup", math.nan)
        if bar is None:
            meets = "n/a"
        elif not v.get("ok"):
            meets = "no (wrong or failed)"
        else:
            meets = "yes" if speedup >= bar else "no"
            if meets == "no" and float(f"{speedup:.4g}") >= bar:  # the table's 4 digits would show the bar itself
                meets = f"no ({math.floor(speedup * 1e5) / 1e5:.5f}x)"  # truncated: never rounds up to the bar
        rows.append({
            "case": c["sparsity"], "shape": c["kind"], "M": c["M"], "H": c["H"],
            "nnz mean": s["mean_active"], "nnz max": s["max_active"],
            "dense ms": dense_ms, "gate GEMM ms": r.get("gate", {}).get("timing", {}).get("median_ms", math.nan),
            "sparse ms": sparse_ms, "speedup": speedup, "rel. error": v.get("rel_err", math.nan),
            "correct": "yes" if v.get("ok") else ("no" if v else "not run"),
            "ceiling": r.get("ceiling", math.nan),
            "bar": bar if bar is not None else math.nan,
            "published": (pub if pub is not None else (PUBLISHED_HEAVY if at_bar_shape and c["sparsity"] == HEAVY_CASE
                                                        else "")),
            "meets bar": meets, "impl": name or "-", "device": run.device_name, "measured at": run.timestamp,
            "in this run": "yes" if run.this_run else "NO (earlier run)",
        })
    return pd.DataFrame(rows)


def summary_lines(table: pd.DataFrame) -> list[str]:
    """Plain-text lines with this table's numbers, for the paragraph under the figure."""
    if table.empty:
        return ["no inference cases in this result"]
    lines = [f"{table['device'].iloc[0]}, {table['measured at'].iloc[0]}, in this run: {table['in this run'].iloc[0]}"]
    for _, r in table.iterrows():
        pub = r["published"]
        extra = ""
        if not math.isnan(r["bar"]):
            pub_txt = f"{pub:.2f}x" if isinstance(pub, float) else (pub or "-")
            extra = f"; bar {r['bar']:.1f}x met: {r['meets bar']}; published kernels {pub_txt}"
        lines.append(f"  {r['shape']:>9} M={r['M']:<6} {r['case']:<11} nnz {r['nnz mean']:5.1f} (max {r['nnz max']:4d}): "
                     f"{r['speedup']:.3f}x ({r['dense ms']:.3f} -> {r['sparse ms']:.3f} ms), ceiling "
                     f"{r['ceiling']:.2f}x, rel. error {r['rel. error']:.2e}, correct: {r['correct']}{extra}")
    barred = table[~table["bar"].isna()]
    if len(barred):
        lines.append(f"speed bar met in {int((barred['meets bar'] == 'yes').sum())} of {len(barred)} cases at M={BAR_M}; "
                     f"correct in {int((table['correct'] == 'yes').sum())} of {len(table)} cases overall")
    return lines


SECTIONS = {"inference": "inference FFN", "odd": "inference FFN, odd shape", "train": "training FFN",
            "real": "checkpoint layers"}


def report_summary(run: BenchRun) -> pd.DataFrame:
    """A benchmark result in a few rows, for a notebook that links the whole report: per section (inference,
    odd shape, training, checkpoint layers), its cases, the row counts M, the implementations timed, their
    speed-up range over dense and how many results were correct."""
    groups: dict[str, list[dict]] = {}
    for r in run.result["cases"]:
        kind = "real" if r["case"].get("layer") is not None else r["case"]["kind"]
        groups.setdefault(kind, []).append(r)
    rows = []
    for kind, cases in groups.items():
        impls = sorted({name for r in cases for name in r.get("impls", {})})
        timed = [v for r in cases for v in r.get("impls", {}).values() if "speedup" in v]
        speed = [v["speedup"] for v in timed]
        rows.append({
            "section": SECTIONS.get(kind, kind), "cases": len(cases),
            "M": ", ".join(str(m) for m in sorted({r["case"]["M"] for r in cases})),
            "implementations": ", ".join(impls) if impls else "dense only (no sparse implementation in this run)",
            "speed-up over dense": f"{min(speed):.2f}x to {max(speed):.2f}x" if speed else "",
            "correct": f"{sum(bool(v.get('ok')) for v in timed)} of {len(timed)}" if timed else "",
        })
    return pd.DataFrame(rows)


def speedup_view(tables: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Rows of :func:`speedup_table` for several implementations of one run, side by side: one row per case
    and M with the measured nnz, each implementation's speed-up (x) and the bar, the published kernels and
    whether the first implementation meets the bar. Device and time are the same in every row: left out."""
    first = tables[0]
    view = first[["shape", "case", "M", "nnz mean", "nnz max"]].copy()
    view["nnz mean"] = view["nnz mean"].round(1)
    for t in tables:
        view[f"{t['impl'].iloc[0]} (x)"] = t["speedup"].round(2).to_numpy()
    view["bar (x)"] = first["bar"]
    view["published (x)"] = first["published"].map(
        lambda v: f"{v:.2f}" if isinstance(v, float) else ("wrong results" if v == PUBLISHED_HEAVY else v))
    view[f"{first['impl'].iloc[0]} meets bar"] = first["meets bar"].replace("n/a", "")
    view["correct"] = ["yes" if all(t["correct"].iloc[i] == "yes" for t in tables) else "no"
                       for i in range(len(first))]
    return view


# ------------------------------------------------------------------ figure
WRONG_LABEL = "WRONG (rel. error >= tol), or failed: no timing, drawn at 0"


def plot_wrong(ax, table: pd.DataFrame) -> bool:
    """Red crosses at the rows of ``table`` that are not correct; True when there were any. A case that
    failed has no speedup (NaN), so its cross goes on the axis (y = 0) instead of vanishing."""
    wrong = table[table["correct"] != "yes"]
    ax.plot(wrong["nnz mean"], wrong["speedup"].fillna(0.0), "x", color="red", ms=14, mew=2.5, ls="none")
    return len(wrong) > 0


_M_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:cyan")


def _plot_real(ax, grp: pd.DataFrame, col: str, label: str, hollow: bool = False) -> list:
    """A checkpoint's layers as diamonds, each with its speedup: filled for the implementation in the
    title (labelled with the layer), hollow for another implementation (below the filled label).
    Returns the value labels with their placing priority (see _place_labels)."""
    style = {"mfc": "white", "mew": 1.5} if hollow else {"mec": "black", "mew": 0.8}
    ax.plot(grp["nnz mean"], grp["speedup"], "D", color=col, ms=8, ls="none", label=label, **style)
    return [(2 if hollow else 1,
             _value_label(ax, f"{r['speedup']:.2f}x" if hollow else f"{r['case']}: {r['speedup']:.2f}x",
                          (r["nnz mean"], r["speedup"]), (7, -10) if hollow else (7, 4), col))
            for _, r in grp.iterrows() if not math.isnan(r["speedup"])]


def _value_label(ax, text: str, xy, offset, color: str, ha: str = "left"):
    """A speedup label beside its point (offset in points), left out of the layout so that moving it
    later (_place_labels) cannot resize the axes."""
    ann = ax.annotate(text, xy, xytext=offset, textcoords="offset points", fontsize=8, color=color, ha=ha)
    ann.set_in_layout(False)
    return ann


def _marker_boxes(ax) -> list:
    """Display boxes of every drawn marker (data points, bar ticks): places labels must not cover."""
    from matplotlib.transforms import Bbox

    boxes, px = [], ax.figure.dpi / 72.0
    for line in ax.lines:
        if line.get_marker() in (None, "None", "", " ") or not len(line.get_xdata()):
            continue
        w = h = line.get_markersize() * px
        if line.get_marker() == "_":  # a tick (the bars): as thick as its edge
            h = max(line.get_markeredgewidth() * px, 1.0)
        elif line.get_marker() == "|":
            w = max(line.get_markeredgewidth() * px, 1.0)
        for x, y in ax.transData.transform(list(zip(line.get_xdata(), line.get_ydata()))):
            boxes.append(Bbox([[x - w / 2, y - h / 2], [x + w / 2, y + h / 2]]))
    return boxes


def _place_labels(fig: Figure, labels: list[tuple[int, object]], step_px: float = 2.0, reach_px: float = 120.0,
                  flip_cost_px: float = 12.0) -> None:
    """Moves value labels off each other, the markers, the other texts and the legend, and keeps them
    inside the axes. Curves of different M often share a speedup to two decimals, and real layers sit
    close together, so labels at their usual offsets collide. In order of ``labels``' priorities (lower first: the generator's curve before the real
    layers), from the highest point down, each label takes the nearest free position: up to
    ``reach_px`` above or below its usual one, on its usual side of the point or, at a cost of
    ``flip_cost_px``, mirrored to the other side. Where none is free it keeps the one that overlaps least."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not labels:
        return
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    fig.draw_without_rendering()  # final axes position (constrained layout)
    renderer = canvas.get_renderer()
    to_points = 72.0 / fig.dpi
    ax = labels[0][1].axes
    ours = {id(a) for _, a in labels}
    taken = _marker_boxes(ax) + [t.get_window_extent(renderer) for t in ax.texts if id(t) not in ours]
    if ax.get_legend() is not None:
        taken.append(ax.get_legend().get_window_extent(renderer))
    frame = ax.get_window_extent(renderer)

    def common(a, b) -> float:
        return max(0.0, min(a.x1, b.x1) - max(a.x0, b.x0)) * max(0.0, min(a.y1, b.y1) - max(a.y0, b.y0))

    def overlap(box) -> float:  # area on other things, plus area outside the axes
        return sum(common(box, b) for b in taken) + box.width * box.height - common(box, frame)

    n = int(reach_px / step_px)
    shifts = [0.0] + [sign * k * step_px for k in range(1, n + 1) for sign in (-1, 1)]
    for _, ann in sorted(labels, key=lambda pa: (pa[0], -pa[1].axes.transData.transform(pa[1].xy)[1])):
        box = ann.get_window_extent(renderer)
        anchor_x = ann.axes.transData.transform(ann.xy)[0]
        mirror_dx = 2 * (anchor_x - (box.x0 + box.x1) / 2)  # the same box on the point's other side
        options = [(box.translated(mirror_dx if flip else 0.0, dy), dy, flip) for flip in (False, True) for dy in shifts]

        def cost(option):
            area = overlap(option[0])
            return area > 0, area, abs(option[1]) + (flip_cost_px if option[2] else 0.0)

        placed, dy, flip = min(options, key=cost)
        dx0, dy0 = ann.xyann
        if flip:
            ann.set_horizontalalignment({"left": "right", "right": "left"}.get(ann.get_horizontalalignment(), "center"))
        ann.xyann = (-dx0 if flip else dx0, dy0 + dy * to_points)
        taken.append(placed)


def plot_speedup(table: pd.DataFrame, run: BenchRun, others: Sequence[pd.DataFrame] = ()) -> Figure:
    """Speedup vs measured mean active neurons per row: one point per case and M (heavy tail as a
    star, colour = M), the gate-GEMM ceiling and 1x as lines, the speed bar and the published
    kernels' speedups as markers; the title says where and when the numbers were measured.
    ``others``: speedup tables of the run's other implementations; their real (checkpoint layer)
    rows are drawn as hollow diamonds, so that the block-union rule a trained model's layers may run
    stands beside the default path (their generator rows stay in the table only)."""
    if table.empty:
        raise ValueError("expected a non-empty speedup table (see speedup_table)")
    fig = Figure(figsize=(11, 6.2), layout="constrained")
    ax = fig.subplots()
    keys = sorted({(r["shape"], int(r["M"])) for _, r in table.iterrows()}, key=lambda k: (k[0] != "inference", k[1]))
    color = {k: _M_COLORS[i % len(_M_COLORS)] for i, k in enumerate(keys)}
    values = []  # value labels, moved apart once the axes are final
    # Curves of different M lie on top of each other: with the bar's M in the run only its curve carries
    # values (the saved table has them all), so that each label sits beside its own point.
    only_bar_m = any(shape == "inference" and M == BAR_M for shape, M in keys)
    any_wrong = False
    for (shape, M), grp in table.groupby(["shape", "M"]):
        grp = grp.sort_values("nnz mean")
        col = color[(shape, int(M))]
        if shape == "real":  # layers of a checkpoint: separate points, not a curve over nnz
            values += _plot_real(ax, grp, col, f"real inputs (checkpoint layers), M = {M}")
        else:
            light, heavy = grp[grp["case"] != HEAVY_CASE], grp[grp["case"] == HEAVY_CASE]
            label = f"this work, M = {M}" + (f" (odd shape, H = {int(grp['H'].iloc[0])})" if shape == "odd" else "")
            with_values = not only_bar_m or (shape == "inference" and M == BAR_M)
            if only_bar_m and with_values:
                label += " (values shown)"
            ax.plot(light["nnz mean"], light["speedup"], "o-", color=col, ms=8, lw=1.5, label=label)
            ax.plot(heavy["nnz mean"], heavy["speedup"], "*", color=col, ms=17, mec="black", mew=0.8, ls="none")
            for _, r in grp.iterrows():
                if with_values and not math.isnan(r["speedup"]):
                    left = r["case"] == HEAVY_CASE  # heavy tail shares x with nnz 29: label on the other side
                    values.append((0, _value_label(ax, f"{r['speedup']:.2f}x", (r["nnz mean"], r["speedup"]),
                                                   (-10 if left else 7, -3), col, ha="right" if left else "left")))
        any_wrong |= plot_wrong(ax, grp)
    others_real = [o[o["shape"] == "real"] for o in others]  # only their real layers are drawn
    for real in others_real:
        for M, grp in real.groupby("M"):
            col = color.get(("real", int(M)), "tab:brown")
            values += _plot_real(ax, grp, col, f"real inputs, {grp['impl'].iloc[0]}, M = {M}", hollow=True)
            any_wrong |= plot_wrong(ax, grp)
    ceiling = float(table["ceiling"].median())
    lo, hi = float(table["ceiling"].min()), float(table["ceiling"].max())
    ax.axhline(ceiling, color="black", ls="--", lw=1.5)
    ax.axhline(1.0, color="grey", ls="-", lw=1.2)
    xmax = max(float(table["nnz mean"].max()), 64.0) * 1.12
    ax.text(xmax * 0.99, ceiling, f"gate-GEMM ceiling (dense / gate GEMM): {ceiling:.2f}x "
            f"(median; {lo:.2f}-{hi:.2f}x over cases)", ha="right", va="bottom", fontsize=9)
    ax.text(xmax * 0.01, 0.98, "1x = dense PyTorch (cuBLAS bf16)", ha="left", va="top", fontsize=9, color="dimgrey")
    # Context markers: the bar and the published kernels (defined at M = 65536, D = 2048, H = 5632).
    bar_x = {"nnz8": 8, "nnz29": 29, "nnz64": 64}
    ax.plot(list(bar_x.values()), [SPEED_BAR[k] for k in bar_x], "_", color="crimson", ms=26, mew=3, ls="none")
    ax.plot([29], [SPEED_BAR[HEAVY_CASE]], "_", color="darkorange", ms=26, mew=3, ls="none")
    pub = [(v[0], published_speedup(k)) for k, v in PUBLISHED_MS.items()]
    ax.plot([p[0] for p in pub], [p[1] for p in pub], "s:", color="dimgrey", mfc="white", ms=8, mew=1.5)
    ax.annotate(f"published kernels on the heavy tail:\n{PUBLISHED_HEAVY}", xy=(29, 0.25), fontsize=8.5,
                color="dimgrey", ha="left", va="bottom", xytext=(33, 0.2))
    handles, labels = ax.get_legend_handles_labels()
    handles.append(Line2D([], [], marker="*", color="grey", mec="black", ms=14, ls="none"))
    labels.append("heavy tail (nnz 29, tail 0.35)")
    if any_wrong:
        handles.append(Line2D([], [], marker="x", color="red", ms=10, mew=2.5, ls="none"))
        labels.append(WRONG_LABEL)
    handles += [Line2D([], [], marker="_", color="crimson", ms=20, mew=3, ls="none"),
                Line2D([], [], marker="_", color="darkorange", ms=20, mew=3, ls="none"),
                Line2D([], [], marker="s", ls=":", color="dimgrey", mfc="white", ms=8)]
    labels += ["speed bar, nnz 8/29/64 at M = 65536", "speed bar, heavy tail (at nnz 29)",
               "published kernels (KERNEL_NOTES.md), M = 65536"]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    top = [float(v) for v in (table["speedup"].max(), *(r["speedup"].max() for r in others_real))
           if not math.isnan(float(v))]  # NaN where nothing was measured
    ymax = max(ceiling, hi, max(SPEED_BAR.values()), *top) * 1.12
    ax.set_xlim(0, xmax)
    ax.set_ylim(0, ymax)
    ax.set_xlabel("measured mean active neurons per row (of H)")
    ax.set_ylabel("speedup vs dense PyTorch (dense ms / sparse ms)")
    ax.grid(alpha=0.3)
    impl = table["impl"].iloc[0]
    ax.set_title(f"Sparse gated FFN ({impl}) vs dense, D = 2048, bf16", fontsize=12)
    fig.suptitle(run.banner(sep="\n"), fontsize=11, color="black" if run.this_run else "red",
                 fontweight="normal" if run.this_run else "bold")
    _place_labels(fig, values)
    return fig
