#!/usr/bin/env bash
# Training throughput with the sparse training kernels against the dense path, in one call on one GPU:
# the `small` config (2 layers of the paper's width) at 16384 tokens per forward (16 x 1024, the
# training benchmark's M), the same steps and data for both runs. Metrics land in $OUT/<run>/.
#   STEPS (default 1500), WALL_S per run (default 150), CORPUS (default shared:corpus/python311_docs.jsonl,
#   with TWELL_SHARED_DATA pointing at the shared data; carry it as .devdata)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/offline_env.sh
STEPS=${STEPS:-1500}
for mode in auto never; do
    name=small_m16k_kernels_$mode
    python3 -m twell.train --config small --out "runs/$name" --overwrite \
        --set train.steps=$STEPS --set train.micro_batch=16 --set train.global_batch=16 \
        --set train.log_every=10 --set train.eval_every=$STEPS --set train.ckpt_every=100000 \
        --set train.export_dtype=null --set train.progress=false --set train.max_wall_seconds=${WALL_S:-150} \
        --set train.sparse_kernels=$mode --set optim.warmup_steps=100 > "$OUT/$name.log" 2>&1 || echo "run $name failed"
    mkdir -p "$OUT/$name"
    cp runs/$name/metrics.jsonl runs/$name/config.yaml "$OUT/$name/" 2>/dev/null || true
    cp runs/$name/summary.json "$OUT/$name/" 2>/dev/null || true
done
python3 - "$OUT" <<'PY'
import json, sys, pathlib, statistics
for mode in ("auto", "never"):
    p = pathlib.Path(sys.argv[1]) / f"small_m16k_kernels_{mode}" / "metrics.jsonl"
    if not p.exists():
        print(mode, "no metrics"); continue
    recs = [json.loads(l) for l in p.read_text().splitlines()]
    tr = [r for r in recs if r.get("kind") == "train"]
    ev = [r for r in recs if r.get("kind") == "event" and r.get("event") == "ffn-routes"]
    last = tr[-20:]
    print(f"{mode}: steps {tr[-1]['step']} tok/s(last 200 steps, median) {statistics.median(r['tok_s'] for r in last):.0f} "
          f"active {100 * tr[-1]['active_frac']:.2f}% ce {tr[-1]['ce']:.3f} peak {max(r.get('peak_mem_mb', 0) for r in last):.0f} MB "
          f"route changes {[(e['step'], e['routes']) for e in ev]}")
PY
