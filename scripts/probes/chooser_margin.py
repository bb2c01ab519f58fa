"""How close is the timed decision that tests/test_kernels.py::test_choose_union_paths_per_layer asserts?

Builds that test's two layers (same seeds and shapes), then, in this process, runs choose_union_paths
ROUNDS times and prints per round: per-row ms, union ms, their ratio, and the decision. The first
round is the one a test sees when it is the first timed call in a fresh process. Then fused_times
with more repetitions and warm-up, for the ratio without noise.
Usage (on the H100): PYTHONPATH=src:tests python scripts/probes/chooser_margin.py [ROUNDS] [OUT_JSON]
"""
import json
import sys
import time

import torch

from test_kernels import inputs, module_with  # the test's own helpers: same inputs
from twell.model import choose_union_paths
from twell.model.union_paths import fused_times
from twell.reference.ffn import UNION_RULE


def main(rounds=10, out_json=None):
    M, D, H = 4096, 1024, 2048
    x, wg, wu, wd = inputs(M, D, H, nnz=40, dead=0.95, seed=1)
    f = module_with(wg, wu, wd)
    f.path = "kernel"
    rows = []
    for i in range(rounds):
        t0 = time.perf_counter()
        r = choose_union_paths(f, x)[0]
        wall = time.perf_counter() - t0
        ratio = r["union_ms"] / r["per_row_ms"] if r["union_ms"] else None
        rows.append({"round": i, "per_row_ms": r["per_row_ms"], "union_ms": r["union_ms"], "ratio": ratio,
                     "chosen": r["union"] == UNION_RULE, "share": r["share"], "wall_s": wall})
        print(f"round {i}: per-row {r['per_row_ms']:.4f} ms, union {r['union_ms']:.4f} ms, ratio {ratio:.3f}, "
              f"rule {'ON' if rows[-1]['chosen'] else 'off'} (share {r['share']:.2f}, {wall:.2f} s)", flush=True)
    gate = __import__("twell").kernels.twell_gate(x, wg, tile=f.tile, compression=f.compression)
    long = []
    for reps in (10, 30, 100):
        p, u = fused_times(f, x, gate, UNION_RULE, reps)
        long.append({"reps": reps, "per_row_ms": p, "union_ms": u, "ratio": u / p})
        print(f"fused_times reps={reps}: per-row {p:.4f}, union {u:.4f}, ratio {u / p:.3f}", flush=True)
    if out_json:
        with open(out_json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "M": M, "D": D, "H": H, "rounds": rows,
                       "fused_times": long}, fh, indent=1)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]) if a else 10, a[1] if len(a) > 1 else None)
