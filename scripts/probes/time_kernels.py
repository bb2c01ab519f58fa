"""Time each TwELL kernel alone against its dense counterpart, with the bench's protocol
(twell.bench.timing.time_alternating: alternating calls, CUDA events, L2 flushed, median of 30).

Complements `python -m twell.bench ffn` (which times the whole sparse FFN): tells how much of the
sparse time is the gate GEMM and how much the fused up/down kernel.
Usage: PYTHONPATH=src python scripts/probes/time_kernels.py [M D H]
"""
import sys

import torch
import torch.nn.functional as F

from twell import kernels
from twell.bench.generator import calibrated_ffn_inputs
from twell.bench.timing import time_alternating


def main(M=65536, D=2048, H=5632):
    print("case,gate_cublas_ms,gate_twell_ms,ffn_twell_ms,up_down_dense_ms,overflow_rows,spilled_tiles")
    for nnz, tail in [(8, 0.1), (29, 0.1), (64, 0.1), (29, 0.35)]:
        inp = calibrated_ffn_inputs(M, D, H, nnz, tail, seed=0, device="cuda")
        x, wg, wu, wd = inp.x, inp.w_gate, inp.w_up, inp.w_down
        wdt = wd.t().contiguous()
        gate = kernels.twell_gate(x, wg)
        h = F.relu(F.linear(x, wg))
        t = time_alternating({
            "cublas": lambda: F.linear(x, wg),
            "gate": lambda: kernels.twell_gate(x, wg),
            "ffn": lambda: kernels.twell_gated_ffn(x, gate, wu, wdt),
            "updown": lambda: F.linear(h * F.linear(x, wu), wd),
        }, "cuda", reps=30)
        spilled = getattr(gate, "n_spilled_tiles", 0)
        print(f"nnz{nnz}-tail{tail},{t['cublas'].median_ms:.3f},{t['gate'].median_ms:.3f},{t['ffn'].median_ms:.3f},"
              f"{t['updown'].median_ms:.3f},{gate.n_overflow_rows},{spilled}", flush=True)


if __name__ == "__main__":
    main(*[int(a) for a in sys.argv[1:]])
