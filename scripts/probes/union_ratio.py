"""The fused up/down kernel with the block-union path off, at its default rule and always on
(csrc/twell_union.cu; the ops' union=(ratio, base)), on the calibrated generator and on generator inputs where a
share of the neurons never fires (as in trained models: `small` has 84% / 55% dead neurons in its two
layers). Timing protocol of the bench (alternating calls, CUDA events, L2 flushed, median of 30).

Prints CSV: case, measured nnz, union blocks at each setting, mean |U|, fused-kernel times per setting,
whole-FFN times (kernels.sparse_gated_ffn) per setting, the relative difference of each fused output
from the per-row kernel's. A setting is a ratio, or ratio:base (union=(ratio, base); base 0 if left out).
Usage (on the H100): PYTHONPATH=src python scripts/probes/union_ratio.py [M] [settings...]
"""
import sys

import torch

from twell import kernels
from twell.bench.generator import calibrated_ffn_inputs
from twell.bench.timing import time_alternating

CASES = [(8, 0.1, 0.0), (29, 0.1, 0.0), (64, 0.1, 0.0), (29, 0.35, 0.0), (6, 0.1, 0.84), (44, 0.1, 0.55),
         (29, 0.1, 0.5)]


def with_rule(ratio, base, fn):
    """A call of fn(union=(ratio, base)): fn passes it on to the op (ratio 0: path off)."""
    def call():
        return fn(union=(ratio, base))
    return call


def with_ratio(ratio, fn):
    """fn run with the plain ratio rule (base 0)."""
    return with_rule(ratio, 0.0, fn)


def parse_setting(text):
    """'r' or 'r:b' -> (ratio, base)."""
    ratio, _, base = text.partition(":")
    return float(ratio), float(base or 0.0)


def label(ratio, base):
    return f"{ratio:g}" + (f":{base:g}" if base else "")


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


def main(M=65536, settings=((0.0, 0.0), (0.5, 0.0), (0.75, 0.0), (1.0, 0.0), (1e9, 0.0)), D=2048, H=5632):
    labels = [label(r, b) for r, b in settings]
    print("case,nnz_mean," + ",".join(f"blocks@{s}" for s in labels) + f",mean_U@{labels[-1]},"
          + ",".join(f"fused_ms@{s}" for s in labels) + "," + ",".join(f"ffn_ms@{s}" for s in labels) + ","
          + ",".join(f"diff@{s}" for s in labels[1:]))
    for nnz, tail, dead in CASES:
        # Ask the generator for nnz / (1 - dead), then silence a random `dead` share of the neurons.
        inp = calibrated_ffn_inputs(M, D, H, nnz / (1 - dead), tail, seed=0, device="cuda")
        x, wg, wu, wd = inp.x, inp.w_gate.clone(), inp.w_up, inp.w_down
        if dead:
            g = torch.Generator().manual_seed(1)
            wg[torch.randperm(H, generator=g)[:int(dead * H)].cuda(), 0] = -1e4
        wdt = wd.t().contiguous()
        gate = kernels.twell_gate(x, wg)
        plans = [kernels.union_plan(x, gate, wu, wdt, ratio=r, base=b) for r, b in settings]
        sizes = plans[-1]["union_sizes"].float()
        fns = {f"fused@{s}": with_rule(r, b, lambda union: kernels.twell_gated_ffn(x, gate, wu, wdt, union=union))
               for s, (r, b) in zip(labels, settings)}
        fns.update({f"ffn@{s}": with_rule(r, b, lambda union: kernels.sparse_gated_ffn(x, wg, wu, wdt, union=union))
                    for s, (r, b) in zip(labels, settings)})
        t = time_alternating(fns, "cuda", reps=30)
        outs = [fns[f"fused@{s}"]().float() for s in labels]
        base = outs[0]
        diffs = [((o - base).norm() / base.norm()).item() for o in outs[1:]]
        name = f"nnz{nnz}-tail{tail}" + (f"-dead{dead}" if dead else "")
        print(f"{name},{gate.nnz_per_row().float().mean().item():.1f},"
              + ",".join(str(p["union_blocks"]) for p in plans)
              + f",{sizes.mean().item() if sizes.numel() else 0:.0f},"
              + ",".join(f"{t[f'fused@{s}'].median_ms:.3f}" for s in labels) + ","
              + ",".join(f"{t[f'ffn@{s}'].median_ms:.3f}" for s in labels) + ","
              + ",".join(f"{d:.2e}" for d in diffs), flush=True)
        for s in labels:
            print(f"  kernels@{s}: " + kernel_times(fns[f"fused@{s}"]), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 65536,
         tuple(parse_setting(a) for a in args[1:]) or ((0.0, 0.0), (0.5, 0.0), (0.75, 0.0), (1.0, 0.0), (1e9, 0.0)))
