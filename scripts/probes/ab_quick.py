"""Sparse FFN against dense PyTorch at M = 65536 for the four BENCHMARK.md cases (alternating,
L2 flushed, median of 30): a quick A/B of two builds, each run in its own process (the ops of two
builds cannot share one). Usage: PYTHONPATH=<tree>/src python scripts/probes/ab_quick.py [label]
"""
import sys

from twell import kernels, reference
from twell.bench.timing import time_alternating

from probe_cases import benchmark_inputs

label = sys.argv[1] if len(sys.argv) > 1 else "this tree"
row = []
for nnz, tail, inp, wdt in benchmark_inputs():
    t = time_alternating({"sparse": lambda: kernels.sparse_gated_ffn(inp.x, inp.w_gate, inp.w_up, wdt),
                          "dense": lambda: reference.dense_gated_ffn(inp.x, inp.w_gate, inp.w_up, inp.w_down)},
                         "cuda", reps=30)
    s, d = t["sparse"].median_ms, t["dense"].median_ms
    row.append(f"nnz{nnz}/{tail}: {s:.3f} / {d:.3f} ms = {d / s:.3f}x")
print(f"{label}: " + "; ".join(row), flush=True)
