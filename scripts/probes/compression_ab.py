"""TwELL compression 8 against 16 (and 4) in the one-op sparse FFN, alternating with dense in one
process (M = 65536, the four BENCHMARK.md cases, median of 30). C = 16 halves the TwELL words the gate
kernel writes and the fused kernel reads (15 slots per 256-column tile instead of 31; fuller tiles
spill, exactly). Prints times, speedups, the outputs' difference from C = 8 and the spilled rows.
Usage (on the H100): PYTHONPATH=src python scripts/probes/compression_ab.py [C ...]   (default 8 16 4)
"""
import torch

from twell import kernels, reference
from twell.bench.timing import time_alternating

from probe_cases import benchmark_inputs

import sys

CS = tuple(int(c) for c in sys.argv[1:]) or (8, 16, 4)  # timed in this order each repetition
for nnz, tail, inp, wdt in benchmark_inputs():
    fns = {f"C{c}": (lambda c=c: kernels.sparse_gated_ffn(inp.x, inp.w_gate, inp.w_up, wdt, compression=c)) for c in CS}
    fns["dense"] = lambda: reference.dense_gated_ffn(inp.x, inp.w_gate, inp.w_up, inp.w_down)
    t = time_alternating(fns, "cuda", reps=30)
    ref = reference.dense_gated_ffn(inp.x, inp.w_gate, inp.w_up, inp.w_down).float()
    outs = {c: fns[f"C{c}"]().float() for c in CS}
    d = t["dense"].median_ms
    parts = []
    for c in CS:
        g = kernels.twell_gate(inp.x, inp.w_gate, compression=c)
        err = ((outs[c] - ref).norm() / ref.norm()).item()
        same = torch.equal(outs[c], outs[CS[0]])
        parts.append(f"C{c} {t[f'C{c}'].median_ms:.3f} ms {d / t[f'C{c}'].median_ms:.3f}x err {err:.2e} "
                     f"same-as-first {same} overflow-rows {g.n_overflow_rows}")
    print(f"nnz{nnz}/{tail}: dense {d:.3f} | " + " | ".join(parts), flush=True)
