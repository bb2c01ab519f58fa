"""The training FFN (forward + backward + L1 term) against dense PyTorch by row count and activity
(D 2048, H 5632): where the training op pays, to set SparseTraining's row floor from measurements.

Per case (calibrated generator rows at nnz active per row, tail 0.1, repeated past 16384 rows):
dense (twell.bench.ffn.dense_train_ffn) and twell.kernels.training.train_gated_ffn, each a forward
and torch.autograd.grad of (out, l1), alternating (CUDA events, L2 flushed, median of 20). JSON to
$OUT/train_grid.json; the table prints last.
Usage (GPU machine): PYTHONPATH=src python scripts/probes/train_grid.py [rows,...] [nnz,...]
(TWELL_TRAIN_COLUMN_PARTS=N: the weight-gradient kernel in N slices of D; default from the L2 size)
"""
import json
import math
import os
import sys

import torch

from twell.bench.ffn import L1_COEF, dense_train_ffn
from twell.bench.generator import calibrated_ffn_inputs
from twell.bench.timing import time_alternating
from twell.kernels import training as ktrain
from twell.kernels.training import train_gated_ffn

# the weight-gradient kernel's slices of D (0: from the L2 size), for a sweep
ktrain.COLUMN_PARTS = int(os.environ.get("TWELL_TRAIN_COLUMN_PARTS", "0"))

D, H, BASE = 2048, 5632, 16384


def kernel_fn(x, wg, wu, wd):
    out, l1, _, _ = train_gated_ffn(x, wg, wu, wd)
    return out, l1


def main(rows=(2048, 4096, 8192, 16384, 32768), nnzs=(8, 16, 29, 48, 64)):
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    results = []
    for nnz in nnzs:
        inp = calibrated_ffn_inputs(BASE, D, H, nnz, 0.1, seed=0, device="cuda")
        ws = [t.detach().clone().requires_grad_(True) for t in (inp.w_gate, inp.w_up, inp.w_down)]
        for m in rows:
            x = (inp.x[:m] if m <= BASE else inp.x.repeat(m // BASE, 1)).detach().clone().requires_grad_(True)
            leaves = [x, *ws]
            g = torch.Generator(device="cpu").manual_seed(1)
            grad_out = torch.randn(m, D, generator=g).div_(math.sqrt(m * D)).to(torch.bfloat16).cuda()
            l1_grad = torch.tensor(L1_COEF, dtype=torch.float32, device="cuda")

            def step(fn):
                out, l1 = fn(*leaves)
                return torch.autograd.grad((out, l1), leaves, (grad_out, l1_grad.to(l1.dtype)))

            t = time_alternating({"dense": lambda: step(dense_train_ffn), "kernel": lambda: step(kernel_fn)},
                                 "cuda", reps=20, warmup=3)
            row = {"nnz": nnz, "rows": m, "dense_ms": t["dense"].median_ms, "kernel_ms": t["kernel"].median_ms}
            row["speedup"] = row["dense_ms"] / row["kernel_ms"]
            results.append(row)
            print(json.dumps(row), flush=True)
        del inp, ws
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "train_grid.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "D": D, "H": H, "tail": 0.1,
                   "column_parts": ktrain.COLUMN_PARTS, "results": results}, fh,
                  indent=1)
    print(f"{'nnz':>5} {'rows':>6} {'dense ms':>9} {'kernel ms':>9} {'speed-up':>8}")
    for r in results:
        print(f"{r['nnz']:>5} {r['rows']:>6} {r['dense_ms']:>9.3f} {r['kernel_ms']:>9.3f} {r['speedup']:>8.2f}")


if __name__ == "__main__":
    args = [tuple(int(v) for v in a.split(",")) for a in sys.argv[1:3]]
    main(*args)
