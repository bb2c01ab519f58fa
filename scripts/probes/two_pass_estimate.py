"""Would an up pass and a down pass beat the fused kernel? An estimate from existing ops, before any
kernel is written. The fused kernel gathers both weight tables per pair (46 MB: more than the L2
holds); two passes would each gather one 23 MB table. The non-gated kernel (`twell_ffn`) is a down
pass exactly; called with w_up as its table it has the traffic of an up pass (a 4 KB row of x read
per token instead of a 4 KB output row written). So, on the gate's TwELL at compression 16:
- fused: twell_gated_ffn(x, gate, w_up, w_down_t)
- two passes: twell_ffn(gate, w_up) then twell_ffn(gate, w_down_t)
each after its own gate kernel (two ops: no overlap with the gate's last wave in either), against
dense PyTorch, alternating, L2 flushed, median of 30; then J per call over a 2 s loop (NVML).
Usage (on the H100): PYTHONPATH=src python scripts/probes/two_pass_estimate.py
"""
from twell import kernels, reference
from twell.reference.ffn import SPARSE_FFN_COMPRESSION as C
from twell.bench.energy import EnergyMeter
from twell.bench.timing import time_alternating

from probe_cases import benchmark_inputs

meter = EnergyMeter("cuda")
print("case,dense_ms,fused_ms,two_pass_ms,fused_x,two_pass_x,gain_pct,"
      "J_fused,J_two_pass,fused_only_ms,passes_only_ms")
for nnz, tail, inp, wdt in benchmark_inputs():
    x, wg, wu = inp.x, inp.w_gate, inp.w_up

    def fused():
        return kernels.twell_gated_ffn(x, kernels.twell_gate(x, wg, compression=C), wu, wdt)

    def two_pass():
        g = kernels.twell_gate(x, wg, compression=C)
        kernels.twell_ffn(g, wu)
        return kernels.twell_ffn(g, wdt)

    g = kernels.twell_gate(x, wg, compression=C)
    t = time_alternating({"dense": lambda: reference.dense_gated_ffn(x, wg, wu, inp.w_down),
                          "fused": fused, "two": two_pass,
                          "fused_only": lambda: kernels.twell_gated_ffn(x, g, wu, wdt),
                          "passes_only": lambda: (kernels.twell_ffn(g, wu), kernels.twell_ffn(g, wdt))},
                         "cuda", reps=30)
    d, f, w = t["dense"].median_ms, t["fused"].median_ms, t["two"].median_ms
    jf = meter.measure(fused, 2.0)
    jw = meter.measure(two_pass, 2.0)
    print(f"nnz{nnz}/{tail},{d:.3f},{f:.3f},{w:.3f},{d / f:.3f},{d / w:.3f},{100 * (f - w) / f:.2f},"
          f"{jf.joules / jf.calls:.3f},{jw.joules / jw.calls:.3f},"
          f"{t['fused_only'].median_ms:.3f},{t['passes_only'].median_ms:.3f}", flush=True)
