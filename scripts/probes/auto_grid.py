"""What "auto" costs and picks against dense, by row count and activity (D 2048, H 5632).

For each case (calibrated generator rows at nnz active neurons per row, repeated past 16384 rows) it
times, alternating in one process (CUDA events, L2 flushed, median of 30): dense PyTorch on the
weights (F.linear), the one-op sparse kernel (sparse_gated_ffn), and SparseFFN modules with
path="dense" and path="auto" on the same weights. It records the path auto ran. JSON and CSV go to
$OUT (default /tmp/out); the table prints last.
Usage (GPU machine): PYTHONPATH=src python scripts/probes/auto_grid.py [rows,...] [nnz,...]
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

from twell import kernels
from twell.bench.generator import calibrated_ffn_inputs
from twell.bench.timing import time_alternating
from twell.nn.ffn import SparseFFN

D, H, BASE = 2048, 5632, 16384


def module(inp, path):
    f = SparseFFN(D, H, path=path).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        f.gate_proj.weight.copy_(inp.w_gate)
        f.up_proj.weight.copy_(inp.w_up)
        f.down_proj.weight.copy_(inp.w_down)
    return f.requires_grad_(False)


def main(rows=(64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536), nnzs=(8, 29, 64, 100, 160, 1500)):
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    results = []
    for nnz in nnzs:
        inp = calibrated_ffn_inputs(BASE, D, H, nnz, 0.0, seed=0, device="cuda")
        wdt = inp.w_down.t().contiguous()
        dense_m, auto_m = module(inp, "dense"), module(inp, "auto")
        for m in rows:
            x = inp.x[:m] if m <= BASE else inp.x.repeat(m // BASE, 1)
            auto_m.reset_auto()  # each row count measures its own first call
            with torch.inference_mode():
                fns = {
                    "dense": lambda: F.linear(F.relu(F.linear(x, inp.w_gate)) * F.linear(x, inp.w_up), inp.w_down),
                    "kernel": lambda: kernels.sparse_gated_ffn(x, inp.w_gate, inp.w_up, wdt, 256, 16),
                    "ffn_dense": lambda: dense_m(x),
                    "ffn_auto": lambda: auto_m(x),
                }
                t = time_alternating(fns, "cuda", reps=30, warmup=3)
            row = {"nnz": nnz, "rows": m, "auto_ran": auto_m.last_path, "auto_note": auto_m.auto_note,
                   **{f"{k}_ms": v.median_ms for k, v in t.items()}}
            row["kernel_speedup"] = row["dense_ms"] / row["kernel_ms"]
            row["auto_over_ffn_dense"] = row["ffn_auto_ms"] / row["ffn_dense_ms"]
            results.append(row)
            print(json.dumps(row), flush=True)
        del inp, wdt, dense_m, auto_m
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "auto_grid.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "D": D, "H": H, "results": results}, fh, indent=1)
    print(f"{'nnz':>5} {'rows':>6} {'dense ms':>9} {'kernel x':>8} {'auto ran':>13} {'auto/dense':>10}")
    for r in results:
        print(f"{r['nnz']:>5} {r['rows']:>6} {r['dense_ms']:>9.3f} {r['kernel_speedup']:>8.2f} "
              f"{r['auto_ran']:>13} {r['auto_over_ffn_dense']:>10.2f}")


if __name__ == "__main__":
    args = [tuple(int(v) for v in a.split(",")) for a in sys.argv[1:3]]
    main(*args)
