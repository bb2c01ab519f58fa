"""Does the fused kernel's weight footprint (w_up + w_down_t = 46 MB, about the H100's L2) set its
speed? Same TwELL, M = 65536: the gated fused op (two 4 KB rows per entry from two 23 MB tables)
against the non-gated one (one 4 KB row per entry, one 23 MB table), per-kernel GPU time from
torch.profiler. If one table moves its rows much faster per byte, splitting the fused op into an up
pass and a down pass (each with one table) would pay.
Usage (on the H100): PYTHONPATH=src python scripts/probes/footprint.py
"""
from twell import kernels
from probe_cases import benchmark_inputs  # sibling probes
from union_ratio import kernel_times

for nnz, tail, inp, wdt in benchmark_inputs(names=("nnz8", "nnz29", "nnz64")):
    gate = kernels.twell_gate(inp.x, inp.w_gate)
    g = kernel_times(lambda: kernels.twell_gated_ffn(inp.x, gate, inp.w_up, wdt), reps=10)
    u = kernel_times(lambda: kernels.twell_ffn(gate, wdt), reps=10)
    print(f"nnz {nnz}: gated {g} | non-gated {u}", flush=True)
