#!/usr/bin/env bash
# FATReLU / dReLU layers end to end on one GPU, in two warm calls (the checkpoint never leaves the machine):
#   PHASE=make   build; the gate variants', routing, decoding-op and format GPU tests; the decoding FFN at the
#                public shapes (scripts/gpu_gate_variants.sh's three benches); then a random-weight checkpoint of
#                SHAPE (default prosparse-7b) with every layer's FATReLU gate calibrated to ACTIVE (0.11) of its
#                neurons (python -m twell.bench synthetic), in .ckpt/ (git-ignored; kept while the machine is warm).
#   PHASE=bench  python -m twell.bench model on that checkpoint against its own dense path: prefill, greedy decoding
#                at batch 1 (eager, CUDA graphs, compiled CUDA graphs) and the greedy token checks (free running,
#                and teacher-forced on the dense path's tokens).
#   PHASE=all    both in one call, then everything under $OUT packed into all.tar.gz (a call returns few files).
# Logs, JSON and MD under $OUT; a short table last. BENCH_ARGS=--allow-dirty where the tree has local changes.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
source scripts/stage_lib.sh
SHAPE=${SHAPE:-prosparse-7b}
CK=.ckpt/synthetic-$SHAPE
if [ "${PHASE:-}" = all ]; then
    PHASE=make bash "$0"
    PHASE=bench bash "$0"
    (cd "$OUT" && tar czf all.tar.gz --exclude=all.tar.gz ./* && find . -type f ! -name all.tar.gz -delete)
    exit 0
fi
case "${PHASE:?set PHASE=make, bench or all}" in
make)
    OUT="$OUT" TESTS="${TESTS:-tests/test_gates.py tests/test_routing.py tests/test_decode_kernels.py tests/test_model_formats.py tests/test_synthetic_model.py}" \
        bash scripts/gpu_gate_variants.sh > "$OUT/variants.log" 2>&1
    cat "$OUT/variants.log"
    stage synthetic $PY -m twell.bench synthetic --shape "$SHAPE" --active "${ACTIVE:-0.11}" --out "$CK" --quiet
    tail -2 "$OUT/synthetic.log"
    ;;
bench)
    stage model $PY -m twell.bench model "$CK" --label "$SHAPE (random weights, ${ACTIVE:-0.11} active)" \
        --seq 1024 --prefill-batch 1 4 --decode-batch 1 --prompt "${PROMPT:-256}" --new-tokens "${NEW:-128}" \
        --train-batch 0 --no-static-decode --compiled-graph-decode --no-energy --out "$OUT" --quiet ${BENCH_ARGS:-}
    grep -E "^\| |Greedy|greedy tokens|failed|Error" "$OUT/model.log" | head -30
    ;;
esac
printf '%s\n' "${summary[@]}"
