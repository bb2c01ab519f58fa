"""The fused up/down kernel with the weight-stationary path off and on (csrc/twell_stationary.cu;
TWELL_STATIONARY), on the calibrated generator, next to the dense FFN and the gate GEMM of the same
run. Timing protocol of the bench (alternating calls, CUDA events, L2 flushed, median of 30).

Prints CSV: case, measured nnz, dense FFN, cuBLAS gate, our gate, fused part per-row / stationary,
the whole sparse FFN (our gate + fused) per path and its speedup over dense, the relative difference
of the stationary output from the per-row one; then the stationary path's time per kernel.
Usage (on the H100): PYTHONPATH=src python scripts/probes/stationary.py [M] [cases...]
(cases: nnz:tail, default 8:0.1 29:0.1 64:0.1 29:0.35)
"""
import sys

import torch
import torch.nn.functional as F

from twell import kernels
from twell.bench.generator import calibrated_ffn_inputs
from twell.bench.timing import time_alternating
from twell.paths import environ_set

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from union_ratio import kernel_times  # noqa: E402


def with_mode(mode, fn):
    """fn run with TWELL_STATIONARY = mode (read by the extension on every call)."""
    def call():
        with environ_set({"TWELL_STATIONARY": mode}):
            return fn()
    return call


def main(M=65536, cases=((8, 0.1), (29, 0.1), (64, 0.1), (29, 0.35)), D=2048, H=5632):
    print("case,nnz_mean,dense_ms,gate_cublas_ms,gate_ms,fused_rows_ms,fused_st_ms,total_rows_ms,total_st_ms,"
          "speedup_rows,speedup_st,diff_st_vs_rows")
    for nnz, tail in cases:
        inp = calibrated_ffn_inputs(M, D, H, nnz, tail, seed=0, device="cuda")
        x, wg, wu, wd = inp.x, inp.w_gate, inp.w_up, inp.w_down
        wdt = wd.t().contiguous()
        gate = kernels.twell_gate(x, wg)
        fused = lambda: kernels.twell_gated_ffn(x, gate, wu, wdt)  # noqa: E731
        whole = lambda: kernels.twell_gated_ffn(x, kernels.twell_gate(x, wg), wu, wdt)  # noqa: E731
        fns = {
            "dense": lambda: F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd),
            "cublas": lambda: F.linear(x, wg),
            "gate": lambda: kernels.twell_gate(x, wg),
            "rows": with_mode("0", fused),
            "st": with_mode("1", fused),
            "whole_rows": with_mode("0", whole),
            "whole_st": with_mode("1", whole),
        }
        t = {k: v.median_ms for k, v in time_alternating(fns, "cuda", reps=30).items()}
        a, b = fns["rows"]().float(), fns["st"]().float()
        diff = ((a - b).norm() / a.norm()).item()
        print(f"nnz{nnz}-tail{tail},{gate.nnz_per_row().float().mean().item():.1f},{t['dense']:.3f},"
              f"{t['cublas']:.3f},{t['gate']:.3f},{t['rows']:.3f},{t['st']:.3f},{t['whole_rows']:.3f},"
              f"{t['whole_st']:.3f},{t['dense'] / t['whole_rows']:.2f},{t['dense'] / t['whole_st']:.2f},{diff:.2e}",
              flush=True)
        print("  kernels (stationary): " + kernel_times(fns["st"]), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    M = int(args[0]) if args else 65536
    cases = tuple((int(c.split(":")[0]), float(c.split(":")[1])) for c in args[1:])
    main(M, cases or ((8, 0.1), (29, 0.1), (64, 0.1), (29, 0.35)))
