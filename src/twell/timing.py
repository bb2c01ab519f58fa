"""Timing of GPU (CUDA events) and CPU (perf_counter) callables, alternating between them.

A low-level module (torch only): the benchmarks (``twell.bench``) time with it, and so do the model's
per-layer path choosers (``twell.model.union_paths``, ``twell.model.row_paths``), which sit below them.

Protocol (shared/BENCHMARK.md): warm-up first, then each repetition calls every function once in
turn (dense and sparse alternate in one process), each call bracketed by CUDA events; the median
of the repetitions is reported. Optionally an L2-sized buffer is overwritten before each timed
call (outside the events) so that no call finds the previous call's weights in L2.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch


@dataclass
class Timing:
    """Per-call milliseconds of one function over the repetitions."""

    median_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    p10_ms: float
    p90_ms: float
    reps: int
    clock: str  # "cuda-events" or "perf_counter (CPU: not the benchmark protocol)"

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_samples(cls, samples: list[float], clock: str) -> "Timing":
        if not samples:
            raise ValueError("no timing samples")
        s = sorted(samples)

        def pct(q: float) -> float:
            return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]

        return cls(statistics.median(s), statistics.fmean(s), s[0], s[-1], pct(0.1), pct(0.9), len(s), clock)


class L2Flusher:
    """Overwrites a buffer twice the size of the device's L2 (no-op on CPU or when disabled)."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.buffer = None
        if enabled and device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (50 << 20)
            self.buffer = torch.empty(2 * l2 // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.zero_()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_alternating(fns: dict[str, Callable[[], object]], device: torch.device | str, reps: int = 30,
                     warmup: int = 3, flush_l2: bool = True) -> dict[str, Timing]:
    """Median-of-``reps`` timing of every function, calling them in turn within each repetition.

    On CUDA: events around each call (results read after one synchronize at the end). On CPU:
    ``time.perf_counter`` around each call (fine for tests, not the benchmark protocol).
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"expected reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    device = torch.device(device)
    flush = L2Flusher(device, flush_l2)
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    _sync(device)
    if device.type == "cuda":
        events = {n: [] for n in names}
        # Events record on the current device's stream: make it the benchmark's device (cuda:1, ...).
        with torch.cuda.device(device):
            for _ in range(reps):
                for name in names:
                    flush()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fns[name]()
                    end.record()
                    events[name].append((start, end))
        torch.cuda.synchronize(device)
        return {n: Timing.from_samples([s.elapsed_time(e) for s, e in events[n]], "cuda-events") for n in names}
    samples = {n: [] for n in names}
    for _ in range(reps):
        for name in names:
            t0 = time.perf_counter()
            fns[name]()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return {n: Timing.from_samples(samples[n], "perf_counter (CPU: not the benchmark protocol)") for n in names}


def run_for(fn: Callable[[], object], device: torch.device | str, min_seconds: float) -> tuple[int, float]:
    """Call fn repeatedly for at least ``min_seconds`` of wall time (synchronized); (calls, seconds).

    The number of calls is estimated from one synchronized call, then run as one queued batch
    so that the GPU stays busy the whole time. The estimating call counts as one of the calls (an
    energy meter read around run_for sees it too).
    """
    device = torch.device(device)
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    one = max(time.perf_counter() - t0, 1e-6)
    calls = 1
    while True:
        batch = max(1, int((min_seconds - (time.perf_counter() - t0)) / one) + 1)
        for _ in range(batch):
            fn()
        calls += batch
        _sync(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return calls, elapsed


def graphed(fn: Callable[[], object], device: torch.device | str,
            after_warmup: Callable[[], object] | None = None) -> tuple[Callable[[], object], object]:
    """``(replay, output)`` of fn captured in a CUDA graph, after two warm-up calls on a side stream: the
    replay runs fn's kernels with one launch (launch overhead out of a timing), writing the same output.
    ``after_warmup`` runs between the warm-up calls and the capture (to undo state they changed)."""
    device = torch.device(device)
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(s)
    if after_warmup is not None:
        after_warmup()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out

