"""Target for Nsight Compute: the decoding op's two kernels (gate_up, down) at M rows, nnz 29, with L2
overwritten before each call, so their counters describe a call that streams its weights from DRAM.
Run under ncu (scripts/probes/decode_ncu.sh), or alone for its wall times. Usage:
python scripts/probes/decode_ncu.py [M] [calls]"""
import sys

import torch

from twell import kernels
from twell.bench.generator import calibrated_ffn_inputs
from twell.bench.timing import L2Flusher


def main():
    M = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    inp = calibrated_ffn_inputs(M, 2048, 5632, 29, 0.0, seed=M, device="cuda")
    wdt = inp.w_down.t().contiguous()
    flush = L2Flusher(torch.device("cuda"))
    for _ in range(calls):
        flush()
        torch.cuda.synchronize()
        kernels.decode_gated_ffn(inp.x, inp.w_gate, inp.w_up, wdt)
        torch.cuda.synchronize()
    print(f"decode_gated_ffn: {calls} calls at M={M}, nnz 29, D 2048, H 5632")


if __name__ == "__main__":
    main()
