"""Per-kernel GPU time of the default sparse FFN (gate kernel, light and heavy fused kernels), from
torch.profiler, for the BENCHMARK.md cases at M = 65536: back-to-back calls, no L2 flush, mean of 10.
Usage (on the H100): PYTHONPATH=src python scripts/probes/kernel_split.py
"""
import torch
from torch.profiler import profile, ProfilerActivity
from twell import kernels
from twell.bench.generator import calibrated_ffn_inputs
for nnz, tail in [(8, 0.1), (29, 0.1), (64, 0.1), (29, 0.35)]:
    inp = calibrated_ffn_inputs(65536, 2048, 5632, nnz, tail, seed=0, device="cuda")
    wdt = inp.w_down.t().contiguous()
    gate = kernels.twell_gate(inp.x, inp.w_gate)
    for _ in range(3): kernels.twell_gated_ffn(inp.x, gate, inp.w_up, wdt)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            kernels.twell_gate(inp.x, inp.w_gate)
            kernels.twell_gated_ffn(inp.x, gate, inp.w_up, wdt)
        torch.cuda.synchronize()
    agg = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            k = e.name.split("(")[0][-40:]
            agg[k] = agg.get(k, 0) + e.device_time / 10 / 1000
    print(f"nnz {nnz} tail {tail}: unspilled overflow rows {gate.n_overflow_rows}, spilled tiles {gate.n_spilled_tiles}; " + "; ".join(f"{k} {v:.3f} ms" for k, v in sorted(agg.items(), key=lambda x: -x[1]) if v > 0.001), flush=True)
