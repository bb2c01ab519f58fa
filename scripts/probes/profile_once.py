"""One call of each TwELL kernel per case, for a profiler (ncu) to capture.

Usage (on the H100): PYTHONPATH=src ncu --clock-control none -k regex:'light|gate_twell' \
    python scripts/probes/profile_once.py 8 29
Each case: the calibrated inputs of ../shared/BENCHMARK.md at M = 65536, tail 0.1, one warm-up call
(built and cached), then the profiled gate call and fused call.
"""
import sys

import torch

from twell import kernels
from twell.bench.generator import calibrated_ffn_inputs


def main(cases):
    for nnz in cases:
        inp = calibrated_ffn_inputs(65536, 2048, 5632, nnz, 0.1, seed=0, device="cuda")
        wdt = inp.w_down.t().contiguous()
        for _ in range(2):  # warm-up, then the call the profiler keeps (-c / --launch-skip pick it)
            gate = kernels.twell_gate(inp.x, inp.w_gate)
            kernels.twell_gated_ffn(inp.x, gate, inp.w_up, wdt)
        torch.cuda.synchronize()
        print(f"nnz {nnz}: done", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [29])
