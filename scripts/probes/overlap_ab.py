"""A/B in one process (docs/kernels.md §6): the one-op sparse FFN (the fused kernel overlaps the gate kernel's last
wave) against the same kernels as two ops (gate, then fused: a memset between them, no overlap)
and dense PyTorch, M = 65536, BENCHMARK.md cases, alternating, L2 flushed, median of 30.
Usage (on the H100): PYTHONPATH=src python scripts/probes/overlap_ab.py [reps]
"""
import sys

import torch

from twell import kernels, reference
from twell.bench.timing import time_alternating

from probe_cases import benchmark_inputs

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
print("case,dense_ms,one_op_ms,two_ops_ms,one_op_x,two_ops_x,gain_pct,bit_equal")
for nnz, tail, inp, wdt in benchmark_inputs():
    x, wg, wu = inp.x, inp.w_gate, inp.w_up
    one = lambda: kernels.sparse_gated_ffn(x, wg, wu, wdt)  # noqa: E731
    two = lambda: kernels.twell_gated_ffn(x, kernels.twell_gate(x, wg), wu, wdt)  # noqa: E731
    dense = lambda: reference.dense_gated_ffn(x, wg, wu, inp.w_down)  # noqa: E731
    same = torch.equal(one(), two())
    t = time_alternating({"dense": dense, "one": one, "two": two}, "cuda", reps=reps)
    d, o, w = t["dense"].median_ms, t["one"].median_ms, t["two"].median_ms
    print(f"nnz{nnz}/{tail},{d:.3f},{o:.3f},{w:.3f},{d / o:.3f},{d / w:.3f},{100 * (w - o) / w:.2f},{same}", flush=True)
