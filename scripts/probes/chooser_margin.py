"""How close is the timed decision that tests/test_kernels.py::test_choose_union_paths_per_layer asserts?

Builds that test's layer a (same seed and shape), then, in this process, runs choose_union_paths
ROUNDS times for each REPS given and prints per round: per-row ms, union ms, their ratio, and the
decision. The first round is the one a test sees when it is the first timed call in a fresh process.
Then ffn_times with 10 / 30 / 100 repetitions (an earlier chooser timed the fused op alone,
fused_times; older JSON files of this probe hold those).
Usage (on the H100): [M=4096] PYTHONPATH=src:tests python scripts/probes/chooser_margin.py [ROUNDS] [OUT_JSON] [REPS ...]
(REPS default: 10 30; M: tokens of the layer, the test's 4096 by default)
"""
import json
import os
import sys
import time

import torch

from test_kernels import inputs, module_with  # the test's own helpers: same inputs
from twell.model import choose_union_paths
from twell.model.union_paths import ffn_times
from twell.reference.ffn import UNION_RULE


def main(rounds=10, out_json=None, reps_list=(10, 30)):
    M, D, H = int(os.environ.get("M", 4096)), 1024, 2048
    x, wg, wu, wd = inputs(M, D, H, nnz=40, dead=0.95, seed=1)
    f = module_with(wg, wu, wd)
    f.path = "kernel"
    rows = []
    for reps in reps_list:
        for i in range(rounds):
            t0 = time.perf_counter()
            r = choose_union_paths(f, x, reps=reps)[0]
            wall = time.perf_counter() - t0
            ratio = r["union_ms"] / r["per_row_ms"] if r["union_ms"] is not None else None
            rows.append({"reps": reps, "round": i, "per_row_ms": r["per_row_ms"], "union_ms": r["union_ms"],
                         "ratio": ratio, "chosen": r["union"] == UNION_RULE, "share": r["share"], "wall_s": wall})
            timing = (f"per-row {r['per_row_ms']:.4f} ms, union {r['union_ms']:.4f} ms, ratio {ratio:.3f}"
                      if ratio is not None else "not timed")
            print(f"reps {reps} round {i}: {timing}, rule {'ON' if rows[-1]['chosen'] else 'off'} "
                  f"(share {r['share']:.2f}, {wall:.2f} s)", flush=True)
        ratios = [r["ratio"] for r in rows if r["reps"] == reps and r["ratio"] is not None]
        if ratios:
            print(f"reps {reps}: ratio {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} rounds", flush=True)
    long = []
    for reps in (10, 30, 100):
        p, u = ffn_times(f, x, UNION_RULE, reps)
        long.append({"reps": reps, "per_row_ms": p, "union_ms": u, "ratio": u / p})
        print(f"ffn_times reps={reps}: per-row {p:.4f}, union {u:.4f}, ratio {u / p:.3f}", flush=True)
    if out_json:
        with open(out_json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "M": M, "D": D, "H": H,
                       "warmup": "ffn_times' (see twell.model.union_paths)", "rounds": rows,
                       "ffn_times": long}, fh, indent=1)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]) if a else 10, a[1] if len(a) > 1 else None, tuple(int(v) for v in a[2:]) or (10, 30))
