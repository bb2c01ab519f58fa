"""Short training runs of `small` variants on one GPU, to see which shape and batch let L1 = 2e-5 reach
high activation sparsity inside a ~10-minute budget (docs/training.md). Prints the active fraction along each run.

    PYTHONPATH=src python3 scripts/probes/sparsity_scan.py --data DIR --seconds 100 A B C

Each variant is `small` plus the overrides below; every run stops cleanly after --seconds of training.
Writes scan.json (trajectories) under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    # the committed `small` shape with 16x larger steps (262k tokens)
    "A": ["train.global_batch=256", "train.micro_batch=64", "optim.warmup_steps=100", "train.steps=2500"],
    # 4 layers of half the paper width
    "B": ["model.hidden_size=1024", "model.intermediate_size=2816", "model.num_layers=4", "model.num_heads=8",
          "model.num_kv_heads=8", "train.global_batch=128", "train.micro_batch=32", "optim.warmup_steps=100",
          "train.steps=1500"],
    # 2 layers of the paper's width (D 2048, H 5632, head dim 128)
    "C": ["model.hidden_size=2048", "model.intermediate_size=5632", "model.num_layers=2", "model.num_heads=16",
          "model.num_kv_heads=16", "train.global_batch=128", "train.micro_batch=32", "optim.warmup_steps=100",
          "train.steps=1000"],
    # C with 4k-token steps (many more optimizer steps, fewer epochs per step)
    "C4k": ["model.hidden_size=2048", "model.intermediate_size=5632", "model.num_layers=2", "model.num_heads=16",
            "model.num_kv_heads=16", "train.global_batch=4", "train.micro_batch=4", "optim.warmup_steps=200",
            "train.steps=6000"],
    # ... and lr 3e-3
    "C4k_lr3": ["model.hidden_size=2048", "model.intermediate_size=5632", "model.num_layers=2",
                "model.num_heads=16", "model.num_kv_heads=16", "train.global_batch=4", "train.micro_batch=4",
                "optim.warmup_steps=200", "train.steps=6000", "optim.lr=3e-3"],
    # diagnostic only (not the recipe): C4k with 10x the L1 coefficient
    "C4k_l1x10": ["model.hidden_size=2048", "model.intermediate_size=5632", "model.num_layers=2",
                  "model.num_heads=16", "model.num_kv_heads=16", "train.global_batch=4", "train.micro_batch=4",
                  "optim.warmup_steps=200", "train.steps=6000", "sparsity.l1_coef=2e-4"],
    # D 1024 with the paper's intermediate width (ratio 5.5), 4k-token steps
    "D4k": ["model.hidden_size=1024", "model.intermediate_size=5632", "model.num_layers=2", "model.num_heads=8",
            "model.num_kv_heads=8", "train.global_batch=4", "train.micro_batch=4", "optim.warmup_steps=200",
            "train.steps=8000"],
    # plumbing check on CPU
    "smoke": ["train.global_batch=2", "train.micro_batch=2", "train.seq_len=128", "optim.warmup_steps=5",
              "train.steps=20", "train.device=cpu", "train.eval_tokens=2048"],
    # C with the committed 16k-token steps
    "C16": ["model.hidden_size=2048", "model.intermediate_size=5632", "model.num_layers=2", "model.num_heads=16",
            "model.num_kv_heads=16", "train.global_batch=16", "train.micro_batch=16", "optim.warmup_steps=100",
            "train.steps=4000"],
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+", choices=sorted(VARIANTS))
    ap.add_argument("--data", required=True)
    ap.add_argument("--seconds", type=float, default=100.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/scan"))
    ap.add_argument("--l1", default="2e-5")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for v in args.variants:
        work = Path("/tmp/twell_scan") / v
        cmd = [sys.executable, "-m", "twell.train", "--config", "small", "--data", args.data, "--out", str(work),
               "--overwrite", "--set", f"train.max_wall_seconds={args.seconds}", "--set", "train.wall_reserve_s=0",
               "--set", "train.progress=false", "--set", "train.eval_every=100000", "--set", "train.ckpt_every=100000",
               "--set", "train.export_dtype=null", "--set", f"sparsity.l1_coef={args.l1}"]
        for o in VARIANTS[v]:
            cmd += ["--set", o]
        t0 = time.time()
        rc = subprocess.call(cmd, stdout=subprocess.DEVNULL)
        recs = [json.loads(l) for l in open(work / "metrics.jsonl")] if (work / "metrics.jsonl").exists() else []
        tr = [r for r in recs if r.get("kind") == "train"]
        val = [r for r in recs if r.get("kind") == "val"]
        traj = [{k: r[k] for k in ("step", "ce", "l1", "active_frac", "dead_frac", "tokens", "tok_s")} for r in tr]
        results[v] = {"overrides": VARIANTS[v], "rc": rc, "wall_s": time.time() - t0, "traj": traj,
                      "val": val[-1] if val else None}
        n = len(traj)
        pts = [traj[min(n - 1, int(n * f))] for f in (0.1, 0.25, 0.5, 0.75, 1.0)] if n else []
        print(f"== {v} rc={rc} wall {time.time() - t0:.0f}s tok/s {traj[-1]['tok_s'] if n else 0:.0f}", flush=True)
        for p in pts:
            print(f"   step {p['step']:5d} ce {p['ce']:.3f} l1 {p['l1']:.1f} active {100 * p['active_frac']:.2f}% "
                  f"dead {100 * sum(p['dead_frac']) / len(p['dead_frac']):.1f}%", flush=True)
        if val:
            print(f"   val_ce {val[-1]['val_ce']:.3f} val_active {100 * val[-1]['val_active_frac']:.2f}%", flush=True)
        (out / "scan.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
