"""The fused up/down kernel with the block-union path off, at its default rule and always on
(csrc/twell_union.cu; TWELL_UNION_RATIO), on the calibrated generator and on generator inputs where a
share of the neurons never fires (as in trained models: `small` has 84% / 55% dead neurons in its two
layers). Timing protocol of the bench (alternating calls, CUDA events, L2 flushed, median of 30).

Prints CSV: case, measured nnz, union blocks at each ratio, mean |U|, kernel times per ratio, the
relative difference of each output from the per-row kernel's.
Usage (on the H100): PYTHONPATH=src python scripts/probes/union_ratio.py [M] [ratios...]
"""
import sys

import torch

from twell import kernels
from twell.bench.generator import calibrated_ffn_inputs
from twell.bench.timing import time_alternating
from twell.paths import environ_set

CASES = [(8, 0.1, 0.0), (29, 0.1, 0.0), (64, 0.1, 0.0), (29, 0.35, 0.0), (6, 0.1, 0.84), (44, 0.1, 0.55),
         (29, 0.1, 0.5)]


def with_ratio(ratio, fn):
    """fn run with TWELL_UNION_RATIO = ratio (read by the extension on every call; 0: path off)."""
    def call():
        with environ_set({"TWELL_UNION_RATIO": str(ratio)}):
            return fn()
    return call


def kernel_times(fn, reps=5) -> str:
    """GPU time per kernel name (mean over reps, ms) from torch.profiler: which kernel of the op costs."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    tot = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = e.name.split("(")[0].split("<")[0].replace("void ", "").replace("twell::", "")
            tot[name] = tot.get(name, 0.0) + e.device_time / 1000 / reps
    return " ".join(f"{k}={v:.3f}" for k, v in sorted(tot.items(), key=lambda kv: -kv[1]) if v >= 0.002)


def main(M=65536, ratios=(0.0, 0.5, 0.75, 1.0, 1e9), D=2048, H=5632):
    print("case,nnz_mean," + ",".join(f"blocks@{r:g}" for r in ratios) + ",mean_U@1e9,"
          + ",".join(f"ffn_ms@{r:g}" for r in ratios) + "," + ",".join(f"diff@{r:g}" for r in ratios[1:]))
    for nnz, tail, dead in CASES:
        # Ask the generator for nnz / (1 - dead), then silence a random `dead` share of the neurons.
        inp = calibrated_ffn_inputs(M, D, H, nnz / (1 - dead), tail, seed=0, device="cuda")
        x, wg, wu, wd = inp.x, inp.w_gate.clone(), inp.w_up, inp.w_down
        if dead:
            g = torch.Generator().manual_seed(1)
            wg[torch.randperm(H, generator=g)[:int(dead * H)].cuda(), 0] = -1e4
        wdt = wd.t().contiguous()
        gate = kernels.twell_gate(x, wg)
        plans = [kernels.union_plan(x, gate, wu, wdt, ratio=r) for r in ratios]
        sizes = plans[-1]["union_sizes"].float()
        fns = {f"r{r:g}": with_ratio(r, lambda: kernels.twell_gated_ffn(x, gate, wu, wdt)) for r in ratios}
        t = time_alternating(fns, "cuda", reps=30)
        outs = [fns[f"r{r:g}"]().float() for r in ratios]
        base = outs[0]
        diffs = [((o - base).norm() / base.norm()).item() for o in outs[1:]]
        name = f"nnz{nnz}-tail{tail}" + (f"-dead{dead}" if dead else "")
        print(f"{name},{gate.nnz_per_row().float().mean().item():.1f},"
              + ",".join(str(p["union_blocks"]) for p in plans)
              + f",{sizes.mean().item() if sizes.numel() else 0:.0f},"
              + ",".join(f"{t[f'r{r:g}'].median_ms:.3f}" for r in ratios) + ","
              + ",".join(f"{d:.2e}" for d in diffs), flush=True)
        print(f"  kernels@{ratios[-1]:g}: " + kernel_times(fns[f"r{ratios[-1]:g}"]), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 65536, tuple(float(a) for a in args[1:]) or (0.0, 0.5, 0.75, 1.0, 1e9))
