"""Does the fused kernel on fewer SMs save energy, and so time, in a power-bound call? The fused kernel
keeps its speed down to ~100 SMs (overlap.py scaling: its gathers are bound by L2, not by the SMs), and
idle SMs draw less power, while the whole sparse call runs at the H100's 700 W limit (power.py). For
each cap: gate kernel then the fused kernel capped to that many SMs (two ops, C16), against dense
PyTorch, alternating, L2 flushed, median of 30; then J per call over a 2 s loop (NVML).
Usage (on the H100): PYTHONPATH=src python scripts/probes/sm_cap_energy.py [caps...]
"""
import sys

from twell import reference
from twell.bench.energy import EnergyMeter
from twell.bench.timing import time_alternating
from twell.kernels.build import load
from twell.kernels.ops import spill_capacity

# the extension's settings, as the ops pass them: the default gate cluster, no union rule, the default dense cap
FFN_KW = dict(union_ratio=0.0, union_base=0.0, dense_cap=None)


def gate_kw(M):
    return dict(spill_cap=spill_capacity(M), cluster=2)
from twell.reference.ffn import SPARSE_FFN_COMPRESSION as C

from probe_cases import benchmark_inputs

caps = [int(a) for a in sys.argv[1:]] or [0, 120, 110, 100]
ext = load()
meter = EnergyMeter("cuda")
print("case,dense_ms," + ",".join(f"cap{c}_ms,cap{c}_x,cap{c}_J,cap{c}_fused_ms" for c in caps))
for nnz, tail, inp, wdt in benchmark_inputs(names=("nnz8", "nnz29")):
    x, wg, wu = inp.x, inp.w_gate, inp.w_up
    packed, spill = ext.gate_twell(x, wg, 256, C, **gate_kw(x.shape[0]))

    def call(cap):
        def f():
            p, s = ext.gate_twell(x, wg, 256, C, **gate_kw(x.shape[0]))
            return ext.ffn_forward(x, p, s, wg, wu, wdt, 256, C, cap, **FFN_KW)
        return f

    def fused(cap):
        return lambda: ext.ffn_forward(x, packed, spill, wg, wu, wdt, 256, C, cap, **FFN_KW)

    fns = {"dense": lambda: reference.dense_gated_ffn(x, wg, wu, inp.w_down)}
    fns.update({f"c{c}": call(c) for c in caps})
    fns.update({f"f{c}": fused(c) for c in caps})
    t = time_alternating(fns, "cuda", reps=30)
    d = t["dense"].median_ms
    cols = []
    for c in caps:
        e = meter.measure(call(c), 2.0)
        s = t[f"c{c}"].median_ms
        cols.append(f"{s:.3f},{d / s:.3f},{e.joules / e.calls:.3f},{t[f'f{c}'].median_ms:.3f}")
    print(f"nnz{nnz}/{tail},{d:.3f}," + ",".join(cols), flush=True)
