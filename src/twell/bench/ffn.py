"""The FFN benchmark of shared/BENCHMARK.md: dense vs sparse gated FFN, correctness first.

For each case (calibrated inputs at a target nnz and tail) this measures the activation
sparsity, checks every sparse implementation against the dense bf16 baseline (outputs poisoned
with NaN first; relative Frobenius error < tol), then times dense, the gate GEMM alone (the
floor) and the sparse implementations alternately (median of >= 30 CUDA-event timings), and
records energy per token (NVML) and peak memory above the inputs. Training cases time the
forward + backward with the L1 term. Results go to JSON and a markdown table.

With a checkpoint (``BenchConfig.checkpoint`` and ``tokens``), "real" cases time the same FFNs on
the inputs each of its layers receives from real text (twell.bench.captured), which BENCHMARK.md
calls the best input of all.

With ``BenchConfig.published`` (a directory with the paper's ``custom_models/``), each case also runs
the published kernels in a child process beside dense and ours (twell.bench.published): their speed-ups
from that process, their wrong results and crashes recorded as such. Training cases also time
``dense-compiled``, the dense expression under torch.compile, a stronger baseline than eager dense.

On CPU everything runs at tiny shapes with perf_counter so the harness itself can be tested;
those timings are not the protocol and the output says so.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import inspect
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from twell.bench.activity import union_reuse
from twell.bench.captured import CapturedInputs, capture_ffn_inputs
from twell.bench.energy import EnergyMeter, EnergyUnavailable
from twell.bench.generator import FFNInputs, calibrated_ffn_inputs, gate_activation, sparsity_stats
from twell.bench.memory import peak_memory_above_baseline
from twell.bench.provenance import code_line, dirty_line, run_meta
from twell.bench import published as published_kernels
from twell.bench.registry import ImplUnavailable, Registry, default_registry, unsupported_reason
from twell.bench.timing import time_alternating
from twell.reference import dense_gated_ffn
from twell.reference.ffn import UNION_BLOCK

# Target mean active neurons per row and tail of BENCHMARK.md (29 = the paper's 1.5B average).
SPARSITY: dict[str, tuple[float, float]] = {
    "nnz8": (8, 0.1),
    "nnz29": (29, 0.1),
    "nnz64": (64, 0.1),
    "nnz29-heavy": (29, 0.35),
    # 0.5% active at the wide shapes' H (11008, 13824, 28672): the paper's sparsity at 7B, 13B and 70B width
    "nnz55": (55, 0.1),
    "nnz69": (69, 0.1),
    "nnz143": (143, 0.1),
    # most rows past the training format's 128 slots: the cliff case (not a BENCHMARK.md default)
    "near-dense": (1500, 0.1),
}
DEFAULT_CASES = ("nnz8", "nnz29", "nnz64", "nnz29-heavy")
L1_COEF = 2e-5
SHAPES = ("inference", "odd", "train", "real", "all")
REAL_SHAPES = ("inference", "real", "all")  # the ones that include the checkpoint's layers
# ... as training cases: train-ffn with a checkpoint (each layer's first train_M captured rows)
REAL_TRAIN_SHAPES = ("train",)
CPU_NOTE = ("CPU run: timings use time.perf_counter at tiny shapes to exercise the harness; they are "
            "NOT the benchmark protocol (CUDA events on an H100, shapes of BENCHMARK.md).")


@dataclass(frozen=True)
class Case:
    """One benchmark case: shape, target sparsity, and kind ("inference", "odd", "train", or "real":
    the inputs of checkpoint layer ``layer``, whose sparsity is whatever the model learnt; nnz and tail
    are then 0). A "train" case with a ``layer`` trains on that layer's captured inputs."""

    kind: str
    sparsity: str
    M: int
    D: int
    H: int
    nnz: float
    tail: float
    seed: int
    layer: int | None = None

    @property
    def name(self) -> str:
        return f"{self.kind} M={self.M} {self.sparsity}"


@dataclass
class BenchConfig:
    """What to run. Shape defaults depend on the device (protocol shapes on CUDA, tiny on CPU)."""

    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    shapes: str = "all"                        # inference | odd | train | real | all (inference and all include
                                               # odd, and real when a checkpoint is given)
    cases: tuple[str, ...] = DEFAULT_CASES
    Ms: tuple[int, ...] | None = None          # inference token counts
    D: int | None = None
    H: int | None = None
    odd_M: int | None = None
    odd_H: int | None = None
    train_M: int | None = None
    impls: tuple[str, ...] | None = None       # default: twell-kernel on CUDA, twell-reference on CPU
    train_impls: tuple[str, ...] = ()
    reps: int = 30
    warmup: int = 3
    seed: int = 0
    tol: float = 1e-2
    tile: int = 256
    energy: bool = True
    energy_seconds: float = 2.0
    memory: bool = True
    flush_l2: bool = True
    fp32_check: bool = True
    out: Path | None = None
    tag: str = ""
    checkpoint: str | None = None              # directory or hub id: adds the "real" cases
    tokens: str | None = None                  # prepared data directory (or .npy of token ids) to run it on
    tokens_split: str = "val"
    real_M: int | None = None                  # tokens per real case (default 65536 on CUDA, 256 on CPU)
    real_seq: int | None = None                # sequence length (default the model's context, at most 1024)
    real_layers: tuple[int, ...] | None = None  # SparseFFN layer indices (default all)
    dense_compile: str | None = None           # torch.compile backend of the "dense-compiled" training baseline
                                               # (default inductor on CUDA; "none" skips it, the CPU default)
    published: str | None = None               # the paper's code (directory holding custom_models/): each case
                                               # also times published-twell / published-hybrid, in a child process
    published_timeout: float = 900.0           # seconds per child process before it is killed (and recorded)

    @classmethod
    def from_dict(cls, d: dict) -> "BenchConfig":
        """The config of ``dataclasses.asdict(cfg)`` after a JSON round trip (lists back to tuples)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}
        if kw.get("out") is not None:
            kw["out"] = Path(kw["out"])
        return cls(**kw)

    def resolved(self) -> "BenchConfig":
        """A copy with every None default filled in for the device."""
        cuda = torch.device(self.device).type == "cuda"
        d = dict(
            Ms=(8192, 65536, 131072) if cuda else (256, 1024),
            D=2048 if cuda else 256, H=5632 if cuda else 768,
            # M not a multiple of 256, H not a multiple of the 256 tile (nor of 64).
            odd_M=12345 if cuda else 203, odd_H=5600 if cuda else 700,
            train_M=16384 if cuda else 256,
            impls=("twell-kernel",) if cuda else ("twell-reference",),
            real_M=65536 if cuda else 256,
            dense_compile="inductor" if cuda else "none",
        )
        changes = {k: v for k, v in d.items() if getattr(self, k) is None}
        return dataclasses.replace(self, **changes)


# What BENCHMARK.md asks of every run; a run below it is marked, and notebook 01 does not pick it as
# the newest result.
PROTOCOL_MIN_REPS = 30
PROTOCOL_MIN_ENERGY_SECONDS = 2.0


PROTOCOL_TOL = 1e-2
PROTOCOL_D, PROTOCOL_H, PROTOCOL_M = 2048, 5632, 65536


def protocol_deviations(config: dict, energy_note: str | None = None) -> list[str]:
    """Where a run's settings (``meta["config"]`` of its JSON, or ``dataclasses.asdict(cfg)``) fall
    short of BENCHMARK.md; empty when they meet it. ``energy_note``: why energy was not measured
    although asked for (the JSON's ``meta["energy_note"]``; see :func:`run_deviations`)."""
    out = []
    tol = config.get("tol")
    if tol is not None and tol > PROTOCOL_TOL:
        out.append(f"tolerance {tol:g} (protocol: {PROTOCOL_TOL:g})")
    if str(config.get("device", "")).startswith("cuda"):  # CPU runs are never protocol runs anyway
        D, H = config.get("D"), config.get("H")
        if (D is not None and D != PROTOCOL_D) or (H is not None and H != PROTOCOL_H):
            out.append(f"D x H = {D} x {H} (protocol: {PROTOCOL_D} x {PROTOCOL_H})")
        Ms = config.get("Ms")
        if config.get("shapes") in ("inference", "all") and Ms is not None and PROTOCOL_M not in Ms:
            out.append(f"no M = {PROTOCOL_M} (the protocol's inference shape)")
    reps = config.get("reps")
    if reps is not None and reps < PROTOCOL_MIN_REPS:
        out.append(f"median of {reps} reps (protocol: at least {PROTOCOL_MIN_REPS})")
    if config.get("warmup", 1) < 1:
        out.append("no warm-up call")
    if config.get("flush_l2") is False:
        out.append("L2 not flushed between calls")
    secs = config.get("energy_seconds")
    if config.get("energy") is False:
        out.append("energy not measured")
    elif energy_note and energy_note != "disabled":
        out.append(f"energy not measured ({energy_note})")
    elif secs is not None and secs < PROTOCOL_MIN_ENERGY_SECONDS:
        out.append(f"energy loops of {secs:g} s (protocol: at least {PROTOCOL_MIN_ENERGY_SECONDS:g} s)")
    if config.get("memory") is False:
        out.append("peak memory not measured")
    return out


def run_deviations(meta: dict) -> list[str]:
    """protocol_deviations of a result's ``meta``: its settings, and energy asked for but unavailable."""
    return protocol_deviations(meta.get("config", {}), meta.get("energy_note"))


def check_config(cfg: BenchConfig) -> None:
    """Errors for settings that cannot run, before anything is loaded or measured."""
    if cfg.shapes not in SHAPES:
        raise ValueError(f"shapes must be one of {', '.join(SHAPES)}, got {cfg.shapes!r}")
    unknown = [c for c in cfg.cases if c not in SPARSITY]
    if unknown:
        raise ValueError(f"unknown cases {unknown}; known: {list(SPARSITY)}")
    if (cfg.checkpoint is None) != (cfg.tokens is None):
        raise ValueError("real cases need both a checkpoint and tokens to run it on (a prepared data directory); "
                         f"got checkpoint={cfg.checkpoint!r}, tokens={cfg.tokens!r}")
    if cfg.shapes == "real" and cfg.checkpoint is None:
        raise ValueError("shapes 'real' needs a checkpoint and tokens (--checkpoint, --tokens)")
    if cfg.real_M is not None and cfg.real_M < 1:
        raise ValueError(f"real_M must be >= 1, got {cfg.real_M}")
    if cfg.published is not None:
        published_kernels.check_dir(cfg.published)  # names what is missing, before any work
    if not cfg.published_timeout > 0:
        raise ValueError(f"published_timeout must be > 0 seconds, got {cfg.published_timeout}")
    for which, H in (("H", cfg.H), ("odd_H", cfg.odd_H)):  # the generator bisects for nnz active of H
        too_dense = [c for c in cfg.cases if H is not None and SPARSITY[c][0] >= H]
        if too_dense:
            raise ValueError(f"cases {too_dense} ask for at least as many active neurons as {which}={H}")


def build_cases(cfg: BenchConfig, captured: CapturedInputs | None = None) -> list[Case]:
    """The cases of the config, in run order: inference Ms, the odd shape, the checkpoint's layers
    (given its captured inputs; they are inference cases too), then training."""
    check_config(cfg)
    if cfg.checkpoint is not None and cfg.shapes in REAL_SHAPES + REAL_TRAIN_SHAPES and captured is None:
        raise ValueError("the config has a checkpoint: pass its captured inputs (BenchRunner.capture())")
    cases = []

    def add(kind, M, H):
        for name in cfg.cases:
            nnz, tail = SPARSITY[name]
            cases.append(Case(kind, name, int(M), int(cfg.D), int(H), nnz, tail, cfg.seed))

    if cfg.shapes in ("inference", "all"):
        for M in cfg.Ms:
            add("inference", M, cfg.H)
    if cfg.shapes in ("inference", "odd", "all"):
        add("odd", cfg.odd_M, cfg.odd_H)
    if cfg.shapes in REAL_SHAPES and captured is not None:
        for layer in captured.layers:
            M, D, H = layer.shape
            cases.append(Case("real", f"layer{layer.layer}", M, D, H, 0.0, 0.0, cfg.seed, layer.layer))
    if cfg.shapes in ("train", "all"):
        add("train", cfg.train_M, cfg.H)
    if cfg.shapes in REAL_TRAIN_SHAPES and captured is not None:
        for layer in captured.layers:
            M, D, H = layer.shape
            cases.append(Case("train", f"layer{layer.layer}", min(int(M), int(cfg.train_M)), D, H, 0.0, 0.0,
                              cfg.seed, layer.layer))
    return cases


# ------------------------------------------------------------------ correctness helpers
dense_ffn = dense_gated_ffn  # the dense baseline of BENCHMARK.md


def dense_train_ffn(x, w_gate, w_up, w_down):
    """Dense training forward: (out, l1). h is the recipe's hidden activation relu(x Wg^T) * (x Wu^T)
    (the one SparseFFN and the hybrid training op penalise); l1 is BENCHMARK.md's expression,
    ``h.abs().sum(-1).float().mean()``."""
    h = F.relu(F.linear(x, w_gate)) * F.linear(x, w_up)
    return F.linear(h, w_down), h.abs().sum(-1).float().mean()


def rel_error(out: torch.Tensor, ref: torch.Tensor, chunk_rows: int = 16384) -> float:
    """||out - ref||_F / ||ref||_F in float32 (NaN when out has a non-finite element)."""
    if out.shape != ref.shape:
        raise ValueError(f"output shape {list(out.shape)} != reference shape {list(ref.shape)}")
    num = den = 0.0
    rows = out.shape[0] if out.dim() else 1
    o2, r2 = out.reshape(rows, -1), ref.reshape(rows, -1)
    for s in range(0, o2.shape[0], chunk_rows):
        o, r = o2[s:s + chunk_rows].float(), r2[s:s + chunk_rows].float()
        num += float(torch.linalg.vector_norm(o - r)) ** 2
        den += float(torch.linalg.vector_norm(r)) ** 2
    return math.sqrt(num) / math.sqrt(den) if den > 0 else (0.0 if num == 0 else math.inf)


def fp32_ffn(x, w_gate, w_up, w_down, chunk_rows: int = 16384) -> torch.Tensor:
    """The dense FFN of the same (bf16) inputs in float32 at full precision (no TF32), [M, D] fp32."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        wg, wu, wd = w_gate.float(), w_up.float(), w_down.float()
        return torch.cat([dense_ffn(x[s:s + chunk_rows].float(), wg, wu, wd)
                          for s in range(0, x.shape[0], chunk_rows)])
    finally:
        torch.set_float32_matmul_precision(prev)


class Poison:
    """Fills the allocator's free memory with 0xFF (NaN in bf16/fp32) so unwritten outputs show as NaN.

    The CUDA caching allocator hands freed blocks to the next allocations, so an implementation
    that allocates its output with torch.empty gets poisoned memory. ``hit(out)`` says whether
    the output really landed in poisoned memory. On CPU there is no such cache: n/a.

    Poisoning only ``blocks`` fresh blocks of the output's size is not enough: a fresh block may be
    carved from a larger cached segment, and once freed it merges with the unpoisoned rest of that
    segment. An implementation's first scratch tensor then takes the front of the poisoned part and
    the output the rest plus unpoisoned bytes (the likely cause, inferred from the allocator's rules, of
    the unverified outputs at M = 131072 on the H100). So every free block of the large pool that this
    stream allocates from is filled too.
    """

    def __init__(self, device: torch.device, nbytes: int, blocks: int = 4):
        self.ranges = []
        self.device = device
        if device.type != "cuda":
            return
        with torch.cuda.device(device):
            bufs = [torch.full((nbytes,), 255, dtype=torch.uint8, device=device) for _ in range(blocks)]
            # Largest first, each request the exact size of a free block: best fit then takes a block of
            # that size whole, so no request splits a block or needs new memory. Under allocator settings
            # that round requests up (roundup_power2_divisions) it would: stop rather than grow.
            mallocs = torch.cuda.memory_stats(device)["num_device_alloc"]
            for size in sorted(_free_block_sizes(device), reverse=True):
                try:
                    bufs.append(torch.full((size,), 255, dtype=torch.uint8, device=device))
                except torch.cuda.OutOfMemoryError:  # what is not poisoned shows up in hit()
                    break
                if torch.cuda.memory_stats(device)["num_device_alloc"] != mallocs:
                    break
            self.ranges = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in bufs]
            torch.cuda.synchronize(device)
        del bufs  # back to the cache, still holding 0xFF
        # Memory given back to the driver (empty_cache, or an allocation retried after freeing the cache)
        # may come back at the same addresses without the poison: hit() then cannot vouch for any range.
        self.device_frees = torch.cuda.memory_stats(device)["num_device_free"]

    def hit(self, out: torch.Tensor) -> bool | None:
        if not self.ranges:
            return None
        if self.device.type == "cuda" and torch.cuda.memory_stats(self.device)["num_device_free"] != self.device_frees:
            return False
        # The bytes the tensor can reach: a strided view (a column slice of a wider buffer) reaches past
        # numel elements from its start.
        if out.numel() == 0:
            return True
        if any(st < 0 for st in out.stride()):
            return False
        p = out.data_ptr()
        end = p + (1 + sum((n - 1) * st for n, st in zip(out.shape, out.stride()))) * out.element_size()
        # All of it, not just its start. Freed blocks that sit side by side merge in the allocator, so an
        # output may straddle two of them: what counts is the union of the poisoned ranges.
        merged: list[list[int]] = []
        for lo, hi in sorted(self.ranges):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        return any(lo <= p and end <= hi for lo, hi in merged)


def _snapshot() -> list[dict]:
    # Without the traces when this torch can (they are large when memory history is being recorded).
    if "include_traces" in inspect.signature(torch.cuda.memory_snapshot).parameters:
        return torch.cuda.memory_snapshot(include_traces=False)
    return torch.cuda.memory_snapshot()


def _free_block_sizes(device: torch.device) -> list[int]:
    """Sizes of the free blocks that an allocation of more than 1 MiB on the current stream of ``device``
    can be given: large-pool segments of the default pool (not CUDA-graph pools) of that stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(device).cuda_stream
    sizes = []
    for seg in _snapshot():
        if (seg.get("device") != index or seg.get("segment_type") != "large" or seg.get("stream") != stream
                or tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)):
            continue
        sizes += [b["size"] for b in seg.get("blocks", ()) if b.get("state") == "inactive" and b["size"] > 2**20]
    return sizes


def _nonfinite(t: torch.Tensor) -> int:
    return int((~torch.isfinite(t)).sum())


def _short(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------ runner
@dataclass
class BenchRunner:
    """Runs the cases of a config with the implementations of a registry; collects one record per case."""

    cfg: BenchConfig
    registry: Registry = field(default_factory=default_registry)
    progress: bool = True
    allow_dirty: bool = False  # a GPU run from a tree with local changes: recorded, marked (else refused)

    def __post_init__(self):
        self.cfg = self.cfg.resolved()
        check_config(self.cfg)
        self.captured: CapturedInputs | None = None
        self.device = torch.device(self.cfg.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
        # A refused tree fails here, before inputs are captured or kernels built; run() looks again.
        self.started_meta: dict = run_meta(self.device, allow_dirty=self.allow_dirty)
        self.unavailable: dict[str, str] = {}
        # Inputs to use instead of generating them (a child process gets its parent's), and the last
        # case's inputs, kept for the published kernels' child process when the config names them.
        self.preset_inputs: FFNInputs | None = None
        self.case_inputs: FFNInputs | None = None
        self.published = (published_kernels.PublishedCases(self.cfg, self.progress)
                          if self.cfg.published is not None else None)
        self._dense_compiled: Callable | None = None
        self.infer_fns = self._resolve(self.cfg.impls, "inference")
        self.train_fns = self._resolve(self.cfg.train_impls, "training")
        self.meter, self.energy_note = None, None
        if self.cfg.energy:
            try:
                self.meter = EnergyMeter(self.device)
            except EnergyUnavailable as exc:
                self.energy_note = str(exc)
        else:
            self.energy_note = "disabled"

    def _resolve(self, names, kind) -> dict[str, Callable]:
        fns = {}
        for name in names:
            try:
                fns[name] = self.registry.resolve(name, kind)
            except ImplUnavailable as exc:
                self.unavailable[name] = str(exc)
        return fns

    def capture(self) -> CapturedInputs | None:
        """The checkpoint's FFN inputs (captured once, on the bench device), or None when the config has
        no checkpoint or its shapes take no real case."""
        cfg = self.cfg
        if cfg.checkpoint is not None and cfg.shapes in REAL_SHAPES + REAL_TRAIN_SHAPES and self.captured is None:
            self.captured = capture_ffn_inputs(cfg.checkpoint, cfg.tokens, cfg.real_M, cfg.real_seq,
                                               layers=cfg.real_layers, split=cfg.tokens_split, device=self.device,
                                               progress=self.progress)
        return self.captured

    def _inputs(self, case: Case) -> FFNInputs:
        if self.preset_inputs is not None:
            return self.preset_inputs
        if case.layer is None:
            inp = calibrated_ffn_inputs(case.M, case.D, case.H, case.nnz, case.tail, seed=case.seed,
                                        device=self.device)
        else:  # a checkpoint layer's captured inputs (a training case takes its first M rows)
            (layer,) = [c for c in self.capture().layers if c.layer == case.layer]
            dev = self.device
            inp = FFNInputs(layer.x[:case.M].to(dev), layer.w_gate.to(dev), layer.w_up.to(dev),
                            layer.w_down.to(dev), bias=math.nan, nnz=0.0, tail=0.0, seed=case.seed)
        if self.published is not None:
            self.case_inputs = inp
        return inp

    # -------------------------------------------------------------- inference
    def run_inference(self, case: Case) -> dict:
        cfg, dev = self.cfg, self.device
        inp = self._inputs(case)
        rec = self._case_header(case, inp)
        x, wg, wu, wd = inp.x, inp.w_gate, inp.w_up, inp.w_down
        wdt = wd.t().contiguous()  # prepared once, outside every timed region

        def dense():
            return dense_ffn(x, wg, wu, wd)

        def gate():
            return F.linear(x, wg)

        ref = dense()
        if cfg.fp32_check:
            ref32 = fp32_ffn(x, wg, wu, wd)
            rec["dense"]["rel_err_vs_fp32"] = rel_error(ref, ref32)
        calls = {}
        for name, fn in self.infer_fns.items():
            res = rec["impls"][name] = {}
            why = unsupported_reason(fn, case.M, case.D, case.H)
            if why:  # a shape it does not run: recorded with the reason, not called, not a failure
                res["unavailable"] = why
                continue
            call = (lambda fn=fn: fn(x, wg, wu, wdt))
            poison = Poison(dev, ref.numel() * ref.element_size())
            try:
                out = call()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
            except Exception as exc:  # the table shows it; the run goes on with the other impls
                res.update(ok=False, error=_short(exc))
                continue
            res["poison_hit"] = poison.hit(out)
            if not (isinstance(out, torch.Tensor) and out.shape == ref.shape):
                got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                res.update(ok=False, error=f"expected output of shape {list(ref.shape)}, got {got}")
                continue
            res["dtype"] = str(out.dtype).replace("torch.", "")
            res["nonfinite"] = _nonfinite(out)
            res["rel_err"] = rel_error(out, ref)
            if cfg.fp32_check:
                res["rel_err_vs_fp32"] = rel_error(out, ref32)
            res["ok"] = bool(res["rel_err"] < cfg.tol) and res["nonfinite"] == 0
            if res["poison_hit"] is False:  # stale memory could hold a right answer: not verified
                res.update(ok=False, error="the output did not land in a poisoned block, so an unwritten "
                           "element would pass unseen: the correctness check is not verified")
            del out
            describe = getattr(fn, "describe", None)  # what the implementation decided on these inputs
            if describe is not None:
                try:
                    res["info"] = describe(x, wg, wu, wdt)
                except Exception as exc:  # a diagnostic only: say why, keep the measurement
                    res["info"] = {"error": _short(exc)}
            calls[name] = call
        if cfg.fp32_check:
            del ref32
        del ref
        timings = time_alternating({"dense": dense, "gate": gate, **calls}, dev, cfg.reps, cfg.warmup,
                                   cfg.flush_l2)
        rec["dense"]["timing"] = timings["dense"].as_dict()
        rec["gate"] = {"timing": timings["gate"].as_dict()}
        rec["ceiling"] = timings["dense"].median_ms / timings["gate"].median_ms
        for name in calls:
            r = rec["impls"][name]
            r["timing"] = timings[name].as_dict()
            r["speedup"] = timings["dense"].median_ms / timings[name].median_ms
        self._energy_memory(rec, {"dense": dense, **calls}, case.M)
        return rec

    # -------------------------------------------------------------- training
    def run_training(self, case: Case) -> dict:
        cfg, dev = self.cfg, self.device
        inp = self._inputs(case)
        rec = self._case_header(case, inp)
        leaves = [t.detach().clone().requires_grad_(True) for t in (inp.x, inp.w_gate, inp.w_up, inp.w_down)]
        del inp
        g = torch.Generator(device="cpu").manual_seed(case.seed + 1)
        grad_out = torch.randn(case.M, case.D, generator=g).div_(math.sqrt(case.M * case.D))
        grad_out = grad_out.to(torch.bfloat16).to(dev)
        l1_grad = torch.tensor(L1_COEF, dtype=torch.float32, device=dev)

        def step(fn):
            out, l1 = fn(*leaves)
            grads = torch.autograd.grad((out, l1), leaves, (grad_out.to(out.dtype), l1_grad.to(l1.dtype)))
            return (out.detach(), l1.detach(), *grads)

        ref = step(dense_train_ffn)
        calls = {"dense": (lambda: step(dense_train_ffn))}
        names = ("out", "l1", "grad_x", "grad_w_gate", "grad_w_up", "grad_w_down")
        if cfg.dense_compile not in (None, "none"):
            # The same dense expression, L1 term included, under torch.compile: eager dense pays for
            # unfused elementwise work that a compiled model does not, which flatters every ratio.
            comp = rec["dense_compiled"] = {"backend": cfg.dense_compile}
            try:
                if self._dense_compiled is None:
                    self._dense_compiled = torch.compile(dense_train_ffn, backend=cfg.dense_compile, dynamic=False)
                got = step(self._dense_compiled)  # compiles here, outside the timed region
                comp["rel_err_parts"] = {n: rel_error(a, b) for n, a, b in zip(names, got, ref)}
                comp["rel_err"] = max(comp["rel_err_parts"].values())
                del got
                calls["dense-compiled"] = (lambda: step(self._dense_compiled))
            except Exception as exc:  # no compiler toolchain, a graph break that fails: said, run goes on
                comp["error"] = _short(exc)
        for name, fn in self.train_fns.items():
            res = rec["impls"][name] = {}
            why = unsupported_reason(fn, case.M, case.D, case.H)
            if why:
                res["unavailable"] = why
                continue
            poison = Poison(dev, ref[0].numel() * ref[0].element_size())
            try:
                got = step(fn)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
            except Exception as exc:
                res.update(ok=False, error=_short(exc))
                continue
            res["poison_hit"] = poison.hit(got[0])
            errs = {n: rel_error(a, b) for n, a, b in zip(names, got, ref)}
            res["rel_err_parts"] = errs
            res["rel_err"] = max(errs.values())
            res["nonfinite"] = sum(_nonfinite(t) for t in got)
            # Recorded only: in a forward and backward, intermediates may take the poisoned blocks
            # before the output does, and no training run has shown whether hits happen.
            res["ok"] = bool(res["rel_err"] < cfg.tol) and res["nonfinite"] == 0
            calls[name] = (lambda fn=fn: step(fn))
            del got
            describe = getattr(fn, "describe", None)
            if describe is not None:
                try:
                    res["info"] = describe(*(t.detach() for t in leaves))
                except Exception as exc:
                    res["info"] = {"error": _short(exc)}
        del ref
        timings = time_alternating(calls, dev, cfg.reps, cfg.warmup, cfg.flush_l2)
        rec["dense"]["timing"] = timings["dense"].as_dict()
        compiled = timings.get("dense-compiled")
        if compiled is not None:
            rec["dense_compiled"]["timing"] = compiled.as_dict()
            rec["dense_compiled"]["speedup"] = timings["dense"].median_ms / compiled.median_ms
        for name in calls:
            if name in ("dense", "dense-compiled"):
                continue
            r = rec["impls"][name]
            r["timing"] = timings[name].as_dict()
            r["speedup"] = timings["dense"].median_ms / timings[name].median_ms
            if compiled is not None:
                r["speedup_vs_compiled"] = compiled.median_ms / timings[name].median_ms
        self._energy_memory(rec, {k: v for k, v in calls.items() if k != "dense-compiled"}, case.M)
        return rec

    # -------------------------------------------------------------- shared
    def _case_header(self, case: Case, inp) -> dict:
        h = gate_activation(inp)
        # At the published compression 8: the rows its format cannot hold (the published kernels err there;
        # ours spill such tiles, and the one-op FFN's own TwELL uses compression 16).
        stats = sparsity_stats(h, tile=self.cfg.tile, compression=8)
        if case.kind != "train":
            # Active pairs per distinct neuron in blocks of consecutive rows: how much the block-union
            # path can save (1 = blocks share no neuron). None when M < one block.
            stats["union_reuse_64"] = union_reuse(h != 0, (UNION_BLOCK,)).get(UNION_BLOCK)
        del h
        return {"case": dataclasses.asdict(case), "name": case.name,
                "bias": None if case.layer is not None else inp.bias, "sparsity": stats, "dense": {}, "impls": {}}

    def _energy_memory(self, rec: dict, fns: dict[str, Callable], tokens: int) -> None:
        for name, fn in fns.items():
            slot = rec["dense"] if name == "dense" else rec["impls"][name]
            if self.cfg.memory:
                slot["peak_bytes_above_inputs"] = peak_memory_above_baseline(fn, self.device)
            if self.meter is not None:
                e = self.meter.measure(fn, self.cfg.energy_seconds)
                slot["energy"] = e.as_dict()
                slot["joules_per_token"] = e.per_token(tokens)

    def run(self, on_case: Callable[[dict], None] | None = None) -> dict:
        """Every case; returns the full result (meta, cases, failures, unavailable).

        ``on_case(partial_result)`` is called after each case (e.g. to write the results so far,
        so that a run cut short still leaves its numbers); ``partial_result["complete"]`` is False.
        """
        # The tree as the run starts: later edits must not relabel its numbers.
        self.started_meta = run_meta(self.device, allow_dirty=self.allow_dirty)
        cases = build_cases(self.cfg, self.capture())
        if self.published is not None:  # built once, before the first case, in a child process
            self.published.prepare({"training" if c.kind == "train" else "inference" for c in cases})
        records = []
        bar = None
        if self.progress:
            try:
                from twell.progress import progress_bar

                bar = progress_bar(total=len(cases), desc="ffn bench", unit="case", file=sys.stderr)
            except ImportError:
                bar = None
        for i, case in enumerate(cases):
            if bar is not None:
                bar.set_postfix_str(case.name)
            elif self.progress:
                print(f"[{i + 1}/{len(cases)}] {case.name}", file=sys.stderr, flush=True)
            rec = self.run_training(case) if case.kind == "train" else self.run_inference(case)
            records.append(rec)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if self.published is not None:
                inp, self.case_inputs = self.case_inputs, None
                ours = [n for n in (self.train_fns if case.kind == "train" else self.infer_fns)]
                rec["published"] = self.published.run_case(case, inp, ours)
                del inp
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            if bar is not None:
                bar.update(1)
            if on_case is not None and i + 1 < len(cases):
                on_case(self._result(records, complete=False))
        if bar is not None:
            bar.close()
        return self._result(records, complete=True)

    def _result(self, records: list[dict], complete: bool) -> dict:
        failures = [f"{r['name']}: {n}: {_failure_text(v, self.cfg.tol)}"
                    for r in records for n, v in r["impls"].items() if not v.get("ok") and not v.get("unavailable")]
        res = {"meta": self._meta(), "complete": complete, "cases": list(records), "failures": failures,
               "unavailable": dict(self.unavailable)}
        if self.captured is not None:
            res["real_inputs"] = dict(self.captured.source)
        if self.published is not None:
            res["published"] = published_kernels.result_block(self.published, res, self.cfg.tol)
        return res

    def _meta(self) -> dict:
        dev = self.device
        cfg = dataclasses.asdict(self.cfg)
        cfg["out"] = str(cfg["out"]) if cfg["out"] is not None else None
        cfg["checkpoint"] = str(cfg["checkpoint"]) if cfg["checkpoint"] is not None else None
        cfg["tokens"] = str(cfg["tokens"]) if cfg["tokens"] is not None else None
        below = protocol_deviations(cfg, self.energy_note)
        return {
            **self.started_meta,  # versions, device, command line, start time, code and tree (run_meta)
            "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "clock": "cuda-events" if dev.type == "cuda" else "perf_counter",
            "protocol": (CPU_NOTE if dev.type != "cuda" else "below shared/BENCHMARK.md (protocol_deviations)"
                         if below else "shared/BENCHMARK.md"),
            "protocol_deviations": below,
            "config": cfg,
            # Settings the kernels read from the environment (union rule, paths, dense-row capacity).
            "twell_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TWELL_")},
            "energy_note": self.energy_note,
            "poison": ("freed allocator blocks filled with 0xFF before each correctness call; poison_hit says "
                       "whether the output landed in one" if dev.type == "cuda" else "n/a on CPU"),
        }


def _failure_text(res: dict, tol: float) -> str:
    if "error" in res:
        return res["error"]
    parts = []
    if res.get("nonfinite"):
        parts.append(f"{res['nonfinite']} non-finite output elements")
    err = res.get("rel_err")
    if err is not None and not err < tol:
        parts.append(f"rel. error {err:.3g} >= {tol:g}")
    return ", ".join(parts) or "failed"


# ------------------------------------------------------------------ reporting
def _ms(t: dict | None) -> str:
    return f"{t['median_ms']:.3f}" if t else "-"


def _mb(b) -> str:
    return f"{b / 2**20:.0f}" if isinstance(b, (int, float)) else "-"


def _jt(v) -> str:
    return f"{v * 1e6:.2f}" if isinstance(v, (int, float)) else "-"


def markdown_report(result: dict) -> str:
    """Markdown: header, failures banner, inference table, energy/memory table, training table."""
    meta, tol = result["meta"], result["meta"]["config"]["tol"]
    lines = [f"# FFN benchmark ({meta['device_name']}, {meta['timestamp']})", ""]
    if not result.get("complete", True):
        lines += [f"> PARTIAL RESULTS: {len(result['cases'])} cases done, the run did not finish.", ""]
    lines += [
             f"torch {meta['torch']}, CUDA {meta['cuda']}, clock: {meta['clock']}; "
             f"median of {meta['config']['reps']} reps; tolerance rel. error < {tol:g} vs dense bf16.", ""]
    if meta.get("code"):
        lines += [code_line(meta["code"]), ""]
    if dirty_line(meta):
        lines += [dirty_line(meta), ""]
    if meta["device"] == "cpu" or meta["device"].startswith("cpu"):
        lines += [f"> {CPU_NOTE}", ""]
    elif meta.get("protocol_deviations"):
        lines += ["> BELOW THE BENCHMARK.md PROTOCOL: " + "; ".join(meta["protocol_deviations"]) + ".", ""]
    if result["failures"]:
        lines += ["## **CORRECTNESS FAILURES**", ""] + [f"- **FAIL** {f}" for f in result["failures"]] + [""]
    for name, why in result["unavailable"].items():
        lines += [f"- implementation `{name}` unavailable: {why}"]
    if result["unavailable"]:
        lines.append("")
    infer = [r for r in result["cases"] if r["case"]["kind"] != "train"]
    train = [r for r in result["cases"] if r["case"]["kind"] == "train"]
    if infer:
        lines += ["## Inference FFN", "",
                  "| case | M | D x H | target nnz / tail | measured nnz mean / max | max per tile | overflow rows at C 8 "
                  "| impl | dense ms | sparse ms | speedup | rel. error | gate GEMM ms (floor) | ceiling | status |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in infer:
            lines += _rows(r, tol, with_gate=True)
        lines.append("")
        lines += _inference_notes(result, infer)
    if train:
        lines += ["## Training FFN (forward + backward, L1 term included)", "",
                  "| case | M | D x H | target nnz / tail | measured nnz mean / max | max per tile | overflow rows at C 8 "
                  "| impl | dense ms | sparse ms | speedup | rel. error | dense compiled ms | speedup vs compiled "
                  "| status |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in train:
            lines += _rows(r, tol, with_gate=False)
        lines.append("")
        src = result.get("real_inputs")
        if src and any(r["case"].get("layer") is not None for r in train):
            lines += [f"Training cases `train layer<i>`: the first rows of what SparseFFN layer i of "
                      f"`{src['checkpoint']}` receives on `{src['tokens']}` (captured with dense FFNs, "
                      "twell.bench.captured), at the activity the model learnt.", ""]
        lines += _compiled_notes(train)
    lines += published_kernels.markdown_section(result)
    lines += ["## Energy and memory", ""]
    measured = any(("joules_per_token" in r["dense"]) or ("peak_bytes_above_inputs" in r["dense"]
                                                           and r["dense"]["peak_bytes_above_inputs"] is not None)
                   for r in result["cases"])
    energy_state = meta["energy_note"] or f"loops of >= {meta['config']['energy_seconds']} s"
    if not measured:
        lines += [f"Not measured on this device (energy: {energy_state}; memory: CUDA allocator statistics only).", ""]
    else:
        lines += [f"Energy per token from NVML's total-energy counter ({energy_state}); peak memory above "
                  "inputs and weights (output included).", "",
                  "| case | impl | dense uJ/token | sparse uJ/token | dense peak MB | sparse peak MB |",
                  "|---|---|---|---|---|---|"]
    for r in (result["cases"] if measured else []):
        d = r["dense"]
        impls = r["impls"] or {"-": {}}
        for name, v in impls.items():
            lines.append(f"| {r['name']} | {name} | {_jt(d.get('joules_per_token'))} | {_jt(v.get('joules_per_token'))} "
                         f"| {_mb(d.get('peak_bytes_above_inputs'))} | {_mb(v.get('peak_bytes_above_inputs'))} |")
        for name, v in r.get("published", {}).items():  # beside the dense of its own (child) process
            if v.get("status") == "done":
                pd = v.get("same_process", {}).get("dense_energy_memory", {})
                lines.append(f"| {r['name']} | {name} (child process) | {_jt(pd.get('joules_per_token'))} "
                             f"| {_jt(v.get('joules_per_token'))} | {_mb(pd.get('peak_bytes_above_inputs'))} "
                             f"| {_mb(v.get('peak_bytes_above_inputs'))} |")
    if any("rel_err_vs_fp32" in r["dense"] for r in result["cases"]):
        lines += ["", "Context: rel. error of dense bf16 vs an fp32 FFN of the same inputs: " + ", ".join(
            f"{r['name']}: {r['dense']['rel_err_vs_fp32']:.2e}" for r in result["cases"] if "rel_err_vs_fp32" in r["dense"])]
    return "\n".join(lines) + "\n"


def _inference_notes(result: dict, infer: list[dict]) -> list[str]:
    """Paragraphs under the inference table: where the real cases' inputs came from, how much the
    block-union path can save on each case, and how many blocks it took."""
    lines = []
    src = result.get("real_inputs")
    if src and any(r["case"]["kind"] == "real" for r in infer):
        split = f" ({src['split']} split)" if "split" in src else ""
        lines += [f"Real cases: the inputs of SparseFFN layers {src['layers']} (of {src['n_ffn_layers']}) of "
                  f"`{src['checkpoint']}` on the first {src['n_tokens']} tokens of `{src['tokens']}`{split}, "
                  f"sequences of {src['seq']} in order, captured with dense FFNs (twell.bench.captured).", ""]
    reuse = [f"{r['name']}: {r['sparsity']['union_reuse_64']:.2f}"
             for r in infer if r["sparsity"].get("union_reuse_64") is not None]
    if reuse:
        lines += [f"Active (row, neuron) pairs per distinct neuron in blocks of {UNION_BLOCK} consecutive rows "
                  "(what the block-union path can save; 1 = nothing): " + "; ".join(reuse) + ".", ""]
    took = [f"{r['name']} ({n}): {v['info']['union_blocks']} of {v['info']['blocks']} blocks"
            for r in infer for n, v in r["impls"].items() if "union_blocks" in v.get("info", {})]
    if took:
        lines += ["Blocks that took the block-union path: " + "; ".join(took) + ".", ""]
    return lines


def _compiled_notes(train: list[dict]) -> list[str]:
    """What the compiled dense baseline gained over eager dense, or why it is missing."""
    done = [f"{r['name']}: {r['dense_compiled']['speedup']:.2f}x" for r in train
            if "speedup" in r.get("dense_compiled", {})]
    failed = [f"{r['name']}: {r['dense_compiled']['error']}" for r in train if "error" in r.get("dense_compiled", {})]
    lines = []
    if done:
        backend = train[0]["dense_compiled"]["backend"]
        lines += [f"Dense compiled (torch.compile, backend {backend}, the same expression with the L1 term) over "
                  "eager dense: " + "; ".join(done) + ". \"speedup vs compiled\" is each implementation's ratio "
                  "against it.", ""]
    if failed:
        lines += ["Dense compiled failed: " + "; ".join(failed), ""]
    return lines


def _rows(r: dict, tol: float, with_gate: bool) -> list[str]:
    c, s = r["case"], r["sparsity"]
    target = "captured" if c.get("layer") is not None else f"{c['nnz']:g} / {c['tail']:g}"
    head = (f"| {c['kind']} {c['sparsity']} | {c['M']} | {c['D']} x {c['H']} | {target} "
            f"| {s['mean_active']:.1f} / {s['max_active']} | {s['max_per_tile']} | {s['overflow_rows']} ")
    dense = r["dense"].get("timing")
    gate = f" {_ms(r.get('gate', {}).get('timing'))} | {r['ceiling']:.2f}x |" if with_gate else ""
    compiled = "" if with_gate else f" {_ms(r.get('dense_compiled', {}).get('timing'))} |"
    impls = r["impls"] or {"-": None}
    rows = []
    for name, v in impls.items():
        vs_comp = "" if with_gate else f" {_speedup(v.get('speedup_vs_compiled')) if v else '-'} |"
        if v is None:
            rows.append(f"{head}| - | {_ms(dense)} | - | - | - |{gate}{compiled}{vs_comp} no sparse impl |")
            continue
        if v.get("unavailable"):
            rows.append(f"{head}| {name} | {_ms(dense)} | - | - | - |{gate}{compiled}{vs_comp} "
                        f"n/a: {v['unavailable']} |")
            continue
        status = "ok" if v.get("ok") else f"**FAIL** ({_failure_text(v, tol)})"
        err = f"{v['rel_err']:.2e}" if v.get("rel_err") is not None else "-"
        sp = f"{v['speedup']:.2f}x" if "speedup" in v else "-"
        rows.append(f"{head}| {name} | {_ms(dense)} | {_ms(v.get('timing'))} | {sp} | {err} |{gate}{compiled}{vs_comp}"
                    f" {status} |")
    return rows


def _speedup(v) -> str:
    return f"{v:.2f}x" if isinstance(v, (int, float)) else "-"


def device_slug(device_name: str) -> str:
    """The device part of a result's file name: ffn-<device_slug>-<timestamp>[-tag].json."""
    return "".join(ch if ch.isalnum() else "-" for ch in device_name).strip("-")[:40] or "device"


def write_result(result: dict, out_dir: Path, kind: str, markdown: str, tag: str = "") -> tuple[Path, Path]:
    """<kind>-<device>-<timestamp>[-tag].json and .md (``markdown``) under out_dir; returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = result["meta"]["timestamp"].replace(":", "").replace("-", "").replace("+0000", "Z")
    stem = f"{kind}-{device_slug(result['meta']['device_name'])}-{stamp}" + (f"-{tag}" if tag else "")
    jpath, mpath = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    jpath.write_text(json.dumps(result, indent=1, default=str))
    mpath.write_text(markdown)
    return jpath, mpath


def write_outputs(result: dict, out_dir: Path, tag: str = "") -> tuple[Path, Path]:
    """ffn-<device>-<timestamp>[-tag].json and .md under out_dir; returns both paths."""
    return write_result(result, out_dir, "ffn", markdown_report(result), tag)


def exit_code(result: dict) -> int:
    """1 when an implementation failed (wrong, non-finite or raised), 2 when one was unavailable (the
    published kernels included: asked for, not built), else 0. The published kernels' own wrong results
    and crashes are findings about them, listed in ``result["published"]["failures"]``: they do not make
    a run fail."""
    if result["failures"]:
        return 1
    return 2 if result["unavailable"] or result.get("published", {}).get("unavailable") else 0
