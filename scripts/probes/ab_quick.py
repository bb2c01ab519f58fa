"""Sparse FFN against dense PyTorch at M = 65536 for the four BENCHMARK.md cases (alternating,
L2 flushed, median of 30): a quick A/B of two builds, each run in its own process (the ops of two
builds cannot share one). Each case also prints a digest of the sparse output, so builds that should
agree bit for bit can be checked in the same run. scripts/probes/variants_ab.sh runs it over
compile-time variants. Usage: PYTHONPATH=<tree>/src python scripts/probes/ab_quick.py [label]
"""
import hashlib
import sys

import torch

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
    # Digest of the sparse output: builds that should agree bit for bit must print the same one.
    out = kernels.sparse_gated_ffn(inp.x, inp.w_gate, inp.w_up, wdt)
    digest = hashlib.sha1(out.view(dtype=torch.int16).cpu().numpy().tobytes()).hexdigest()[:10]
    row.append(f"nnz{nnz}/{tail}: {s:.3f} / {d:.3f} ms = {d / s:.3f}x [{digest}]")
print(f"{label}: " + "; ".join(row), flush=True)
