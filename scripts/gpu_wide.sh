#!/usr/bin/env bash
# The kernels at D > 2048 on one GPU: build, their GPU tests, then the benchmarks at the wide shapes of
# docs/kernels.md at 0.5% active (the paper's sparsity). PART=infer: `python -m twell.bench ffn` at D 4096 /
# H 11008 (nnz 55), D 5120 / H 13824 (nnz 69), D 8192 / H 28672 (nnz 143), M 65536 plus the odd correctness
# shape; PART=train: `python -m twell.bench train-ffn` at D 4096 / H 11008, M 16384 (nnz 55), and the D 2048
# table of record's training cases (nnz 8 / 29 / 64) beside it; PART=all (default) both. Logs and records
# under $OUT; a short table last. BENCH_ARGS=--allow-dirty where the tree has local changes.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
source scripts/stage_lib.sh
part=${PART:-all}
stage build $PY -m twell.kernels.build --build
stage tests $PY -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_wide_kernels.py}
common=(--no-energy --out "$OUT" --quiet ${BENCH_ARGS:-})
if [ "$part" != train ]; then
    inf=(--shapes inference --M 65536 "${common[@]}")
    stage wide4096 $PY -m twell.bench ffn --D 4096 --H 11008 --cases nnz55 "${inf[@]}" --tag wide-4096
    stage wide5120 $PY -m twell.bench ffn --D 5120 --H 13824 --cases nnz69 "${inf[@]}" --tag wide-5120
    stage wide8192 $PY -m twell.bench ffn --D 8192 --H 28672 --cases nnz143 "${inf[@]}" --reps 10 --tag wide-8192
fi
if [ "$part" != infer ]; then
    stage train4096 $PY -m twell.bench train-ffn --D 4096 --H 11008 --train-M 16384 --cases nnz55 "${common[@]}" \
        --tag train-wide-4096
    stage train2048 $PY -m twell.bench train-ffn --cases nnz8 nnz29 nnz64 "${common[@]}" --tag train-2048
fi
tail -3 "$OUT/tests.log"; grep -E "FAILED|Error" "$OUT/tests.log" | head -10
grep -hE "^\| (nnz|odd|inference|train)|FAIL" "$OUT"/ffn-*.md 2>/dev/null | head -30
printf '%s\n' "${summary[@]}"
