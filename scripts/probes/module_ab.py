"""A/B in one process: a SparseFFN layer as it now runs (the one op, compression 16) against
the same layer calling the gate op and the fused op (keep_gate: what every layer ran before the one
op, at compression 8, and what a layer that keeps its TwELL runs) and dense PyTorch, M = 65536,
BENCHMARK.md cases, alternating, L2 flushed, median of 30.
Usage (on the H100): PYTHONPATH=src python scripts/probes/module_ab.py [reps]
"""
import sys

import torch

from twell import reference
from twell.bench.timing import time_alternating
from twell.nn import SparseFFN

from probe_cases import benchmark_inputs


def layer(inp, compression, keep_gate):
    D, H = inp.x.shape[1], inp.w_gate.shape[0]
    f = SparseFFN(D, H, path="kernel", compression=compression).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for m, w in ((f.gate_proj, inp.w_gate), (f.up_proj, inp.w_up), (f.down_proj, inp.w_down)):
            m.weight.copy_(w)
    f.keep_gate = keep_gate
    return f


def main(reps=30):
    print("case,dense_ms,one_op_c16_ms,two_ops_c16_ms,two_ops_c8_ms,one_op_x,two_ops_c8_x,gain_vs_c8_pct,bit_equal")
    for nnz, tail, inp, _ in benchmark_inputs():
        x = inp.x
        new, kept16, old = layer(inp, 16, False), layer(inp, 16, True), layer(inp, 8, True)
        with torch.no_grad():
            outs = [f(x) for f in (new, kept16, old)]
            same = all(torch.equal(outs[0], o) for o in outs[1:])
            fns = {"dense": lambda: reference.dense_gated_ffn(x, inp.w_gate, inp.w_up, inp.w_down),
                   "new": lambda: new(x), "kept16": lambda: kept16(x), "old": lambda: old(x)}
            t = time_alternating(fns, "cuda", reps=reps)
        d, n, k, o = (t[k].median_ms for k in ("dense", "new", "kept16", "old"))
        print(f"nnz{nnz}/{tail},{d:.3f},{n:.3f},{k:.3f},{o:.3f},{d / n:.3f},{d / o:.3f},{100 * (o - n) / o:.2f},{same}",
              flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
