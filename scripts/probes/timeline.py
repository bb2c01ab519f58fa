"""GPU timeline of one default sparse FFN call (twell_gate + fused op) per BENCHMARK.md case at
M = 65536: every GPU op in order with its start (us after the call's first op began), its duration
and the gap before it, from torch.profiler, L2 flushed and a spin kernel queued before each
call (so the call's ops are all queued, as in the benchmark's loop), median over reps. Shows
what besides the gate and light kernels the call spends (memsets, empty tail kernels, launch gaps).
Usage (on the H100): PYTHONPATH=src python scripts/probes/timeline.py [reps]
"""
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from twell import kernels
from twell.bench.timing import L2Flusher, time_alternating

from probe_cases import benchmark_inputs

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 10


def short(name: str) -> str:
    return name.split("(")[0].replace("void ", "").replace("twell::", "")[:60]


for nnz, tail, inp, wdt in benchmark_inputs():
    call = lambda: kernels.sparse_gated_ffn(inp.x, inp.w_gate, inp.w_up, wdt)  # noqa: E731
    flush = L2Flusher(torch.device("cuda"))
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush()
            torch.cuda._sleep(3_000_000)  # ~1.5 ms: every op of the call is queued before the GPU reaches it
            call()
            torch.cuda.synchronize()
    ops = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    # Split into calls: each call starts after the spin kernel queued behind the L2 flush.
    calls, cur = [], None
    for e in ops:
        if "spin" in e.name.lower():
            cur = []
            calls.append(cur)
        elif cur is not None and "fill" not in e.name.lower():
            cur.append(e)
    names = [short(e.name) for e in calls[0]]
    rows = []
    for i, name in enumerate(names):
        starts, durs, gaps = [], [], []
        for c in calls:
            if len(c) != len(names):
                continue
            t0 = c[0].time_range.start
            starts.append(c[i].time_range.start - t0)
            durs.append(c[i].time_range.end - c[i].time_range.start)
            gaps.append(c[i].time_range.start - c[i - 1].time_range.end if i else 0)
        rows.append((name, statistics.median(starts), statistics.median(durs), statistics.median(gaps)))
    ends = [c[-1].time_range.end - c[0].time_range.start for c in calls if len(c) == len(names)]
    ev = time_alternating({"sparse": call}, "cuda", reps=30)["sparse"].median_ms
    print(f"nnz {nnz} tail {tail}: {len(names)} GPU ops, first op start to last op end {statistics.median(ends):.1f} us "
          f"(median), event-timed call {ev * 1e3:.1f} us", flush=True)
    for name, s, d, g in rows:
        print(f"  {s:8.1f} +{d:8.1f} us (gap {g:5.1f})  {name}", flush=True)
