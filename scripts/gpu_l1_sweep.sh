#!/usr/bin/env bash
# Notebook 02's L1 sweep and re-initialisation ablation on the GPU machine: the same config, steps and data
# per run, JOBS runs at a time (spread round-robin over GPU_LIST; several small runs share one), metrics and
# summaries copied to $OUT/<run>/ (for reports/runs/, which notebook 02's sweep_runs / reinit_runs read).
#   CONFIG=small  COEFS="0 5e-6 1e-5 2e-5 3e-5 5e-5"  REINIT=1 (adds "reinit_off" / "reinit_on" at 2e-5)
#   STEPS (default: the config's), JOBS=3, EXTRA="--set ...", DEVICE=cuda (cpu: smoke test)
#   GPU_LIST="2 3"         GPU indices the runs go to (default: every GPU nvidia-smi lists)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/offline_env.sh
CONFIG=${CONFIG:-small}
DEVICE=${DEVICE:-cuda}
JOBS=${JOBS:-3}
if [ -z "${GPU_LIST:-}" ]; then
    GPU_LIST=$( [ "$DEVICE" = cuda ] && seq -s ' ' 0 $(( $(nvidia-smi -L | wc -l) - 1 )) || echo 0 )
fi
read -r -a GPU_IDS <<< "$GPU_LIST"
declare -a NAMES=() SETS=()
for c in ${COEFS:-0 5e-6 1e-5 2e-5 3e-5 5e-5}; do NAMES+=("l1_$c"); SETS+=("--set sparsity.l1_coef=$c"); done
if [ "${REINIT:-1}" = 1 ]; then
    NAMES+=(reinit_off reinit_on)
    SETS+=("--set sparsity.reinit_dead=false" "--set sparsity.reinit_dead=true")
fi
# prepare the tokens once, before the parallel runs read them
python3 -m twell.data --config "$CONFIG" > "$OUT/prepare.log" 2>&1 || true
i=0
for k in "${!NAMES[@]}"; do
    name=${CONFIG}_${NAMES[$k]}
    (
        CUDA_VISIBLE_DEVICES=${GPU_IDS[i % ${#GPU_IDS[@]}]} python3 -m twell.train --config "$CONFIG" --out "runs/sweep/$name" \
            --overwrite --set train.device="$DEVICE" --set train.progress=false --set train.export_dtype=null \
            ${STEPS:+--set train.steps=$STEPS} ${SETS[$k]} ${EXTRA:-} > "$OUT/$name.log" 2>&1 \
            || echo "run $name failed (see $OUT/$name.log)"
        mkdir -p "$OUT/$name"
        cp "runs/sweep/$name/metrics.jsonl" "runs/sweep/$name/summary.json" "$OUT/$name/" 2>/dev/null || true
    ) &
    i=$((i + 1))
    if (( i % JOBS == 0 )); then wait; fi
done
wait
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("*/summary.json")):
    s = json.loads(p.read_text()); f = s["final"]
    print(f"{p.parent.name:28s} L1 {s['l1_coef']:<8g} steps {s['steps_done']:6d} active {100 * (f['active_frac_mean'] or 0):6.2f}% "
          f"val CE {f.get('val_ce', float('nan')):.4f}")
PY
