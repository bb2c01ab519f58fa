#!/usr/bin/env bash
# Notebook 04's GPU rows in one warm sequence: for each scale, train the sparse config for a wall-clock
# budget on the offline corpus, its dense twin for the same number of steps, then run
# `python -m twell.bench model` on the pair. Checkpoints of these sizes cannot leave the GPU machine:
# only the benchmark JSON/MD and the runs' metrics and summaries land in $OUT (flat, few files).
#
#   SCALES="0p5b"          configs to train (their dense twins: <scale>_dense)
#   NPROC=4                GPUs per run (torchrun; 1: a plain process)
#   TRAIN_S=420            wall-clock seconds of the sparse run (the twin runs the steps it reached)
#   DATA=shared:corpus/python311_docs.jsonl   corpus (TWELL_SHARED_DATA, or a carried .devdata/)
#   EXTRA="--set ..."      more overrides for both runs; BENCH_ARGS: more for the model benchmark
#   DEVICE=cuda            cpu for a smoke test of this script
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/offline_env.sh
source scripts/run_lib.sh
NPROC=${NPROC:-4}
DEVICE=${DEVICE:-cuda}
corpus_args "$DEVICE" "${DATA:-shared:corpus/python311_docs.jsonl}"
COMMON=("${CORPUS_ARGS[@]}" ${EXTRA:-})
for scale in ${SCALES:-0p5b}; do
    launch_train "$NPROC" --config "$scale" --out "runs/eff_$scale" --set train.max_wall_seconds="${TRAIN_S:-420}" \
        "${COMMON[@]}" > "$OUT/train_$scale.log" 2>&1
    steps=$(json_get "runs/eff_$scale/summary.json" steps_done)
    launch_train "$NPROC" --config "${scale}_dense" --out "runs/eff_${scale}_dense" --set train.steps="$steps" \
        "${COMMON[@]}" > "$OUT/train_${scale}_dense.log" 2>&1
    for run in "$scale" "${scale}_dense"; do
        cp "runs/eff_$run/summary.json" "$OUT/summary_$run.json"
        cp "runs/eff_$run/metrics.jsonl" "$OUT/metrics_$run.jsonl"
    done
    bench_model_pair "runs/eff_$scale" "runs/eff_${scale}_dense" "$scale ($steps steps)" "$OUT" "$DEVICE" \
        ${BENCH_ARGS:-} > "$OUT/bench_$scale.log" 2>&1
    tail -n 25 "$OUT/bench_$scale.log"
done
