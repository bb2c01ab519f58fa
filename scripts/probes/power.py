"""Energy, power and time per call of the pieces of the sparse FFN at nnz 8, M = 65536: the H100 runs
the benchmark at its power limit, so a call's energy sets its speed. For each piece: J per call and
mean W over a 2 s back-to-back loop (NVML), ms per call in that loop (wall / calls) and the event
time after a 1.5 ms rest (event_overhead.timed with its spin). Run once per build or setting in its own process;
gate_cluster 1 runs the single-CTA gate kernel.
Usage (on the H100): PYTHONPATH=src python scripts/probes/power.py [label] [gate_cluster]
"""
import sys

import torch
import torch.nn.functional as F

from twell import kernels, reference
from twell.bench.energy import EnergyMeter
from twell.bench.generator import calibrated_ffn_inputs
from twell.reference.ffn import GATE_CLUSTER
from event_overhead import spin, timed  # sibling probe (this directory is on sys.path when run as a script)

label = sys.argv[1] if len(sys.argv) > 1 else "this tree"
cluster = int(sys.argv[2]) if len(sys.argv) > 2 else GATE_CLUSTER
inp = calibrated_ffn_inputs(65536, 2048, 5632, 8, 0.1, seed=0, device="cuda")
wdt = inp.w_down.t().contiguous()
g = kernels.twell_gate(inp.x, inp.w_gate, gate_cluster=cluster)
pieces = {
    "gate (TwELL)": lambda: kernels.twell_gate(inp.x, inp.w_gate, gate_cluster=cluster),
    "F.linear gate": lambda: F.linear(inp.x, inp.w_gate),
    "fused only": lambda: kernels.twell_gated_ffn(inp.x, g, inp.w_up, wdt),
    "sparse ffn": lambda: kernels.sparse_gated_ffn(inp.x, inp.w_gate, inp.w_up, wdt, gate_cluster=cluster),
    "dense ffn": lambda: reference.dense_gated_ffn(inp.x, inp.w_gate, inp.w_up, inp.w_down),
}
meter = EnergyMeter("cuda")

for name, fn in pieces.items():
    en = meter.measure(fn, 2.0)
    print(f"{label} | {name:14s} {en.joules / en.calls:6.3f} J/call {en.joules / en.seconds:6.1f} W "
          f"loop {en.seconds / en.calls * 1e3:6.3f} ms rested {timed(fn, spin, reps=15) / 1e3:6.3f} ms", flush=True)
