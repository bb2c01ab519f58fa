#!/usr/bin/env bash
# End-to-end training speed of the sparse training kernels on one GPU, in two warm calls (the checkpoint never
# leaves the machine):
#   PHASE=train  build; TESTS (pytest targets, default none) on the built kernels; then the sparse SCALE config
#                on the offline corpus for STEPS steps of 4 x 1024 tokens (the recipe otherwise, eager, no
#                activation checkpointing; a wall-clock deadline DEADLINE_S after the start stops it earlier).
#   PHASE=bench  `python -m twell.bench model` on that checkpoint, its dense side the same weights on the dense
#                path: once with prefill rows, greedy-token check and the eager training row at the first of
#                TRAIN_BATCHES, then the training rows alone (eager and with each decoder layer compiled) at
#                every batch of TRAIN_BATCHES (sequences of 1024 tokens per optimizer step). COMPILE=0: eager only.
#                `python -m twell.bench activity` on the held-out tokens last.
#   PHASE=resume `python -m twell.train` itself: the run's training state continued RESUME_STEPS (300) more
#                steps with the kernels (train.sparse_kernels=auto) and again without (never); median tokens/s
#                past the first 20 steps in resume_throughput.json.
# Logs, JSON and MD under $OUT (the training-row runs' JSON and MD in bench_train_rows.tar.gz); a short table last. SCALE=0p5b STEPS=5000 DEADLINE_S=480 TRAIN_BATCHES="8 16"
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
source scripts/offline_env.sh
source scripts/run_lib.sh
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
T0=$(date +%s)
SCALE=${SCALE:-0p5b}
RUN=runs/train_e2e_$SCALE
case "${PHASE:?set PHASE=train, bench or resume}" in
train)
    python3 -m twell.kernels.build --build > "$OUT/build.log" 2>&1 || { echo "build failed"; tail -20 "$OUT/build.log"; exit 1; }
    if [ -n "${TESTS:-}" ]; then
        python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1
        echo "tests rc=$?"; tail -4 "$OUT/tests.log"
    fi
    corpus_args cuda shared:corpus/python311_docs.jsonl
    python3 -m twell.train --config "$SCALE" --out "$RUN" "${CORPUS_ARGS[@]}" "${E2E_RECIPE_SETS[@]}" \
        --set train.steps="${STEPS:-5000}" --set train.eval_every="${STEPS:-5000}" --set train.stop_at_unix=$(( T0 + ${DEADLINE_S:-480} )) --set train.wall_reserve_s=40 \
        > "$OUT/train.log" 2>&1
    echo "train rc=$?"
    cp "$RUN/summary.json" "$OUT/summary_$SCALE.json" 2>/dev/null
    json_get "$RUN/summary.json" steps_done | sed 's/^/steps done: /'
    json_get "$RUN/summary.json" final.active_frac_mean | sed 's/^/active fraction: /'
    ;;
bench)
    prepared=$(json_get "$RUN/summary.json" data.prepared_dir || true)
    label="$SCALE ($(json_get "$RUN/summary.json" steps_done) steps)"
    common=(--label "$label" ${prepared:+--tokens "$prepared"} --seq 1024 --no-static-decode --no-graph-decode
            --no-energy --train-steps 10 --out "$OUT" --quiet)
    read -r -a batches <<< "${TRAIN_BATCHES:-8 16}"
    python3 -m twell.bench model "$RUN/final" "${common[@]}" --prefill-batch 8 32 --decode-batch 1 \
        --train-batch "${batches[0]}" > "$OUT/bench_model.log" 2>&1
    echo "bench rc=$?"
    for b in "${batches[@]}"; do
        for mode in eager compiled; do
            [ "$mode" = eager ] && [ "$b" = "${batches[0]}" ] && continue
            [ "$mode" = compiled ] && [ "${COMPILE:-1}" = 0 ] && continue
            python3 -m twell.bench model "$RUN/final" "${common[@]}" --prefill-batch 8 --decode-batch 1 \
                --no-token-check --train-batch "$b" $([ "$mode" = compiled ] && echo --train-compile) \
                --tag "train$b-$mode" > "$OUT/bench_train$b-$mode.log" 2>&1
            echo "bench train $b $mode rc=$?"
        done
    done
    [ -n "$prepared" ] && python3 -m twell.bench activity "$RUN/final" --tokens "$prepared" --out "$OUT/activity_$SCALE.json" \
        > "$OUT/activity.log" 2>&1
    # the device tool returns a handful of files: the tagged runs' JSON and MD go back in one archive
    tar -czf "$OUT/bench_train_rows.tar.gz" -C "$OUT" $(cd "$OUT" && ls model-*-train*-*.json model-*-train*-*.md 2>/dev/null) \
        && rm -f "$OUT"/model-*-train*-*.json "$OUT"/model-*-train*-*.md
    grep -hE "^\| (dense|sparse|prefill|training)" "$OUT"/bench_*.log | sort -u
    grep -h "routes\|compiled:" "$OUT"/bench_*.log | sort -u | cut -c1-300
    tail -12 "$OUT/activity.log" 2>/dev/null
    ;;
resume)
    # python -m twell.train itself, with and without the kernels: the same training state continued for
    # RESUME_STEPS more steps (the recipe's batch: a resume keeps the data order), one after the other
    corpus_args cuda shared:corpus/python311_docs.jsonl --resume
    total=$(( $(json_get "$RUN/summary.json" steps_done) + ${RESUME_STEPS:-300} ))
    for mode in auto never; do
        rm -rf "${RUN}_$mode" && cp -r "$RUN" "${RUN}_$mode"
        python3 -m twell.train --config "$SCALE" --out "${RUN}_$mode" "${CORPUS_ARGS[@]}" "${E2E_RECIPE_SETS[@]}" \
            --set train.steps=$total --set train.eval_every=100000 --set train.eval_tokens=16384 \
            --set train.sparse_kernels=$mode > "$OUT/resume_$mode.log" 2>&1
        echo "resume $mode rc=$?"
    done
    python3 - "$RUN" "$OUT/resume_throughput.json" <<'PY'
import json, statistics, sys
run, out = sys.argv[1:]
res = {}
for mode in ("auto", "never"):
    rows = [json.loads(line) for line in open(f"{run}_{mode}/metrics.jsonl")]
    start = max(r["step"] for r in rows if r.get("event") == "resume")
    train = [r for r in rows if r.get("kind") == "train" and r["step"] > start + 20]  # past the first logged steps
    routes = [r["routes"] for r in rows if r.get("event") == "ffn-routes" and r["step"] > start]
    res[mode] = {"from_step": start, "steps": [r["step"] for r in train], "tok_s": [r["tok_s"] for r in train],
                 "median_tok_s": statistics.median(r["tok_s"] for r in train),
                 "peak_mem_mb": max(r["peak_mem_mb"] for r in train), "routes": routes[-1] if routes else None}
res["ratio"] = res["auto"]["median_tok_s"] / res["never"]["median_tok_s"]
json.dump(res, open(out, "w"), indent=1)
print(f"python -m twell.train, kernels auto / never: {res['auto']['median_tok_s']:.0f} / "
      f"{res['never']['median_tok_s']:.0f} tok/s = {res['ratio']:.3f}x; peak {res['auto']['peak_mem_mb']:.0f} / "
      f"{res['never']['peak_mem_mb']:.0f} MB; routes {res['auto']['routes']}")
PY
    ;;
esac
echo "[$(( $(date +%s) - T0 )) s] done"
