"""Per-kernel GPU time of the default sparse FFN (gate kernel, light and heavy fused kernels), from
torch.profiler (union_ratio.kernel_times), for the BENCHMARK.md cases at M = 65536: back-to-back
calls, no L2 flush, mean of 10.
Usage (on the H100): PYTHONPATH=src python scripts/probes/kernel_split.py
"""
from twell import kernels
from twell.bench.generator import calibrated_ffn_inputs
from union_ratio import kernel_times  # sibling probe (this directory is on sys.path when run as a script)

for nnz, tail in [(8, 0.1), (29, 0.1), (64, 0.1), (29, 0.35)]:
    inp = calibrated_ffn_inputs(65536, 2048, 5632, nnz, tail, seed=0, device="cuda")
    wdt = inp.w_down.t().contiguous()
    gate = kernels.twell_gate(inp.x, inp.w_gate)

    def both():
        kernels.twell_gate(inp.x, inp.w_gate)
        kernels.twell_gated_ffn(inp.x, gate, inp.w_up, wdt)
    print(f"nnz {nnz} tail {tail}: unspilled overflow rows {gate.n_overflow_rows}, spilled tiles "
          f"{gate.n_spilled_tiles}; {kernel_times(both, reps=10)}", flush=True)
