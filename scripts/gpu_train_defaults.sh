#!/usr/bin/env bash
# The training kernels and the trainer's defaults on one GPU machine, over one warm sequence of calls
# (runs/ is kept between them; the checkpoint never leaves the machine). Run from the repository root with
# OUT set; a short table last.
#   PHASE=kernels  build ours, start building the published kernels in the background (setsid), the GPU tests
#                  TESTS, then the weight-gradient kernel's D slices swept (TWELL_TRAIN_COLUMN_PARTS in PARTS)
#                  on scripts/probes/train_grid.py at 16384 rows
#   PHASE=bench    `python -m twell.bench train-ffn --published $PUBLISHED` (CASES, default the BENCHMARK.md cases
#                  and near-dense, at 16384 rows; nnz 29 at each of OTHER_M; energy off)
#   PHASE=hot      scripts/probes/train_hot.py: the op with hot neurons as dense columns at each of HOT_FREQS
#                  against the plain op, on the generator and, once PHASE=train has run, on its checkpoint's layers
#   PHASE=train    the 0.5B shape on the offline Python-docs corpus with python -m twell.train's defaults at the
#                  recipe's 4 x 1024 tokens per step (gpu_train_e2e.sh PHASE=train; STEPS, DEADLINE_S)
#   PHASE=captured `python -m twell.bench train-ffn --published` on that checkpoint's layers: each one's first 16384
#                  captured rows of held-out text as a training case, beside the generator's nnz 29 (after PHASE=train);
#                  ours with and without hot neurons (twell-train-kernel, twell-train-kernel-hot)
#   PHASE=model    `python -m twell.bench model` on that checkpoint, training rows compiled on both sides at each
#                  of TRAIN_BATCHES (the sparse side's threshold timed, as the trainer's default), once per entry of
#                  VARIANTS (the sparse side's extra settings; default the defaults, then routes timed per layer
#                  with hot neurons), then gpu_train_e2e.sh PHASE=resume
#                  (python -m twell.train defaults against sparse_kernels=never; RESUME=0 skips)
# Carried: .device/devdata (corpus/python311_docs.jsonl), .device/baselines/sparser-faster-llms.
# The machine's copy of the tree may record an older commit with local changes, so the benchmarks refuse it:
# BENCH_ARGS=--allow-dirty records it as such (the records' code digests name the commit: bench provenance).
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export TWELL_SHARED_DATA=${TWELL_SHARED_DATA:-$PWD/.device/devdata}
source scripts/stage_lib.sh
PUBLISHED=${PUBLISHED:-$PWD/.device/baselines/sparser-faster-llms}
mkdir -p runs
case "${PHASE:?set PHASE=kernels, bench, hot, train, captured or model}" in
kernels)
    stage build $PY -m twell.kernels.build --build
    [ -d "$PUBLISHED" ] && setsid nohup $PY -m twell.bench.published build "$PUBLISHED" > runs/published_build.log 2>&1 < /dev/null &
    stage tests $PY -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_train_kernels.py tests/test_train_calibration.py tests/test_train_sparse_run.py}
    for p in ${PARTS-1 2 4 8}; do
        stage parts$p env TWELL_TRAIN_COLUMN_PARTS=$p OUT="$OUT/parts$p" $PY scripts/probes/train_grid.py 16384 8,29,64
    done
    tail -3 "$OUT/tests.log"; grep -E "FAILED|Error" "$OUT/tests.log" | head -10
    for p in ${PARTS-1 2 4 8}; do echo "parts $p:"; tail -3 "$OUT/parts$p.log"; done
    tail -2 runs/published_build.log
    ;;
bench)
    for _ in $(seq 60); do pgrep -f "twell.bench.published build" > /dev/null || break; sleep 5; done
    cp runs/published_build.log "$OUT/" 2>/dev/null
    stage bench $PY -m twell.bench train-ffn --out "$OUT" --no-energy --published "$PUBLISHED" --quiet \
        --cases ${CASES:-nnz8 nnz29 nnz64 nnz29-heavy near-dense} ${BENCH_ARGS:-}
    for m in ${OTHER_M:-4096 65536}; do
        stage bench$m $PY -m twell.bench train-ffn --out "$OUT" --no-energy --published "$PUBLISHED" --quiet \
            --cases nnz29 --train-M "$m" --tag "M$m" ${BENCH_ARGS:-}
    done
    grep -hE "^\| " "$OUT"/bench*.log | head -40
    ;;
hot)
    RUN=runs/train_e2e_0p5b
    if [ -f "$RUN/summary.json" ]; then
        export CKPT=$RUN/final
        TOKENS=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['data']['prepared_dir'])" "$RUN/summary.json")
        export TOKENS
    fi
    stage hot$([ -n "${CKPT:-}" ] && echo -captured) env GENERATOR=$([ -n "${CKPT:-}" ] && echo 0 || echo 1) $PY scripts/probes/train_hot.py "${HOT_FREQS:-0.01,0.02,0.04}"
    tail -14 "$OUT"/hot*.log
    ;;
captured)
    RUN=runs/train_e2e_0p5b
    prepared=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['data']['prepared_dir'])" "$RUN/summary.json")
    stage captured $PY -m twell.bench train-ffn --out "$OUT" --no-energy --published "$PUBLISHED" --quiet --cases nnz29 \
        --checkpoint "$RUN/final" --tokens "$prepared" --real-M "${REAL_M:-32768}" --tag captured \
        --train-impl twell-train-kernel twell-train-kernel-hot ${BENCH_ARGS:-}
    grep -hE "^\| " "$OUT"/captured.log | head -40
    ;;
train)
    PHASE=train STEPS=${STEPS:-4000} DEADLINE_S=${DEADLINE_S:-400} OUT=$OUT bash scripts/gpu_train_e2e.sh
    ;;
model)
    RUN=runs/train_e2e_0p5b
    prepared=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['data']['prepared_dir'])" "$RUN/summary.json")
    # VARIANTS: "name:extra args" entries separated by ';' (the sparse side's settings); "base:" is the defaults
    IFS=";" read -r -a variants <<< "${VARIANTS:-base:;timed:--train-routes timed --train-hot 0.01}"
    for b in ${TRAIN_BATCHES:-8 16}; do
        for v in "${variants[@]}"; do
            name=${v%%:*}; read -r -a extra <<< "${v#*:}"
            stage model$b-$name $PY -m twell.bench model "$RUN/final" --label "0.5B (python docs)" \
                --tokens "$prepared" --seq 1024 --no-static-decode --no-graph-decode --no-energy --no-token-check \
                --train-steps 10 --prefill-batch 8 --decode-batch 1 --train-batch "$b" --train-compile \
                "${extra[@]}" ${BENCH_ARGS:-} --tag "train$b-compiled-$name" --out "$OUT" --quiet
        done
    done
    [ "${RESUME:-1}" = 1 ] && PHASE=resume RESUME_STEPS=${RESUME_STEPS:-200} OUT=$OUT bash scripts/gpu_train_e2e.sh
    tar -czf "$OUT/bench_train_rows.tar.gz" -C "$OUT" $(cd "$OUT" && ls model-*-train*.json model-*-train*.md 2>/dev/null) \
        && rm -f "$OUT"/model-*-train*.json "$OUT"/model-*-train*.md
    grep -hE "^\| (dense|sparse|training)" "$OUT"/model*.log | sort -u
    grep -h "threshold\|compiled:\|hot neurons" "$OUT"/model*.log | sort -u | cut -c1-300
    ;;
esac
# the device tool brings back a handful of files: everything of this phase in one archive as well
(cd "$OUT" && tar -czf "all_$PHASE.tar.gz" --exclude='*.tar.gz' .)
printf '%s\n' "${summary[@]}"
