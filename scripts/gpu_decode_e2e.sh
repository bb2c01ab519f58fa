#!/usr/bin/env bash
# End-to-end decoding on one GPU in two warm calls (the checkpoint never leaves the machine):
#   PHASE=train  build; the decoding kernel's tests; `python -m twell.bench decode` at M 1-32 (no energy);
#                then the sparse 0.5B config on the offline corpus for STEPS steps (4 x 1024 tokens per step,
#                the recipe otherwise; a wall-clock deadline DEADLINE_S after the start stops it earlier).
#                TESTS_GPU=N runs the tests and the FFN benchmark on GPU N (a physical index, another GPU
#                than the training's) beside the training (they share the build; the training waits for
#                it), on a machine with more than one GPU; CHECKS=0 skips the tests and the FFN benchmark.
#   PHASE=bench  `python -m twell.bench model` on that checkpoint, its dense side the same weights on the
#                dense path: prefill, eager and CUDA-graph greedy decoding at batch 1 and 32 (the graph rows
#                with the step eager, and compiled by inductor unless COMPILED=0), the greedy token checks
#                (BENCH_ARGS: more arguments). STATIC=1 adds transformers' compiled static-cache rows;
#                TORCH_LOGS (e.g. graph_breaks,recompiles,perf_hints) says what the compiler did.
# Logs, JSON and MD under $OUT; a short table last. STEPS=4500 DEADLINE_S=480 SCALE=0p5b
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
source scripts/offline_env.sh
source scripts/run_lib.sh
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
T0=$(date +%s)
SCALE=${SCALE:-0p5b}
RUN=runs/e2e_$SCALE
case "${PHASE:?set PHASE=train or PHASE=bench}" in
train)
    checks=(env OUT="$OUT" SKIP_PROBE="${SKIP_PROBE:-1}" TESTS="tests/test_decode_kernels.py"
            BENCH_ARGS="--M 1 4 16 32 --no-energy" bash scripts/gpu_decode.sh)
    if [ "${CHECKS:-1}" = 0 ]; then
        python3 -m twell.kernels.build --build > "$OUT/build_first.log" 2>&1
    elif [ -n "${TESTS_GPU:-}" ]; then
        python3 -m twell.kernels.build --build > "$OUT/build_first.log" 2>&1
        CUDA_VISIBLE_DEVICES=$TESTS_GPU "${checks[@]}" > "$OUT/checks.log" 2>&1 &
        checks_pid=$!
    else
        "${checks[@]}"
    fi
    corpus_args cuda shared:corpus/python311_docs.jsonl
    python3 -m twell.train --config "$SCALE" --out "$RUN" "${CORPUS_ARGS[@]}" "${E2E_RECIPE_SETS[@]}" \
        --set train.steps="${STEPS:-4500}" --set train.eval_every="${STEPS:-4500}" --set train.stop_at_unix=$(( T0 + ${DEADLINE_S:-480} )) --set train.wall_reserve_s=40 \
        > "$OUT/train.log" 2>&1
    echo "train rc=$?"
    if [ "${CHECKS:-1}" != 0 ] && [ -n "${TESTS_GPU:-}" ]; then
        wait "$checks_pid"; echo "checks rc=$?"; cat "$OUT/checks.log"
    fi
    cp "$RUN/summary.json" "$OUT/summary_$SCALE.json" 2>/dev/null
    json_get "$RUN/summary.json" steps_done | sed 's/^/steps done: /'
    json_get "$RUN/summary.json" final.active_frac_mean | sed 's/^/active fraction: /'
    ;;
bench)
    prepared=$(json_get "$RUN/summary.json" data.prepared_dir || true)
    python3 -m twell.bench model "$RUN/final" --label "$SCALE ($(json_get "$RUN/summary.json" steps_done) steps)" \
        ${prepared:+--tokens "$prepared"} --seq 1024 --prefill-batch 8 --decode-batch 1 32 --train-batch 0 \
        $([ "${STATIC:-0}" = 1 ] || echo --no-static-decode) \
        $([ "${COMPILED:-1}" = 0 ] || echo --compiled-graph-decode) --no-energy --out "$OUT" --quiet ${BENCH_ARGS:-} > "$OUT/bench_model.log" 2>&1
    echo "bench rc=$?"
    grep -E "^\| |Greedy|greedy tokens|failed" "$OUT/bench_model.log" | head -30
    ;;
esac
echo "[$(( $(date +%s) - T0 )) s] done"
