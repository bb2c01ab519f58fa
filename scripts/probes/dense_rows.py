"""The whole sparse FFN with the dense path for heavy rows off and on (csrc/twell_dense.cu; the ops'
dense_cap: 0 off, None its rule, else the rows per round it takes), beside dense PyTorch, on
the BENCHMARK.md cases. Timing protocol of the bench (alternating calls, CUDA events, L2 flushed,
median of 30). Prints CSV (times in ms, speedups over dense in the same run, the relative difference
of the two sparse outputs) and, for the cases with heavy rows, the per-kernel split with the path on.
Usage (on the H100): PYTHONPATH=src python scripts/probes/dense_rows.py [M] [cap...]
"""
import sys

from twell import kernels, reference
from twell.bench.timing import time_alternating
from probe_cases import benchmark_inputs  # sibling probes (this directory is on sys.path when run as a script)
from union_ratio import kernel_times


def with_cap(cap, fn):
    """A call of fn(dense_cap=cap): fn passes it on to the op (None: the rule)."""
    def call():
        return fn(dense_cap=cap)
    return call


def main(M=65536, caps=(0, None)):
    names = ["off" if c == 0 else "default" if c is None else f"cap{c}" for c in caps]
    print("case,M,heavy_rows," + ",".join(f"{n}_ms" for n in names) + ",dense_ms,"
          + ",".join(f"{n}_speedup" for n in names) + ",rel_diff")
    for nnz, tail, inp, wdt in benchmark_inputs(M):
        x, wg, wu, wd = inp.x, inp.w_gate, inp.w_up, inp.w_down
        heavy = int(kernels.twell_gate(x, wg).nnz_per_row().gt(128).sum())
        fns = {n: with_cap(c, lambda dense_cap: kernels.sparse_gated_ffn(x, wg, wu, wdt, dense_cap=dense_cap))
               for n, c in zip(names, caps)}
        fns["dense"] = lambda: reference.dense_gated_ffn(x, wg, wu, wd)
        t = time_alternating(fns, "cuda", reps=30)
        outs = [fns[n]().float() for n in names]
        diff = ((outs[-1] - outs[0]).norm() / outs[0].norm()).item()
        d = t["dense"].median_ms
        print(f"nnz{nnz}-tail{tail},{M},{heavy}," + ",".join(f"{t[n].median_ms:.3f}" for n in names)
              + f",{d:.3f}," + ",".join(f"{d / t[n].median_ms:.3f}" for n in names) + f",{diff:.2e}", flush=True)
        if heavy:
            print("  kernels, default: " + kernel_times(fns[names[-1]]), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 65536,
         tuple(None if a == "default" else int(a) for a in args[1:]) or (0, None))
