#!/usr/bin/env bash
# The sparse training kernels on the GPU machine in one call: build, their tests, the per-stage
# probe, and `python -m twell.bench train-ffn` (BENCHMARK.md protocol). Logs and JSON under $OUT,
# a short table last. Run from the repository root: OUT=/some/dir bash scripts/gpu_train_kernels.sh
#   TESTS     pytest targets (default: the training-kernel tests, the short training runs, FSDP2 on two GPUs
#             where there are two)
#   BENCH_ARGS extra args of train-ffn (default: --no-energy); SKIP_TESTS=1 SKIP_PROBE=1 SKIP_BENCH=1
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
source scripts/stage_lib.sh
stage build $PY -m twell.kernels.build --build
[ "${SKIP_TESTS:-0}" = 1 ] || stage tests $PY -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_train_kernels.py tests/test_train_sparse_run.py tests/test_sparse_training_fsdp.py}
[ "${SKIP_PROBE:-0}" = 1 ] || stage probe $PY scripts/probes/train_breakdown.py
[ "${SKIP_BENCH:-0}" = 1 ] || stage bench $PY -m twell.bench train-ffn --out "$OUT" ${BENCH_ARGS:---no-energy}
tail -4 "$OUT/tests.log" 2>/dev/null
tail -6 "$OUT/probe.log" 2>/dev/null
grep -E "^\| nnz|^\| case" "$OUT/bench.log" 2>/dev/null | head -12
printf '%s\n' "${summary[@]}"
