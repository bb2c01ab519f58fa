#!/usr/bin/env bash
# The routing checked on the GPU machine in one call: build, the GPU tests of the paths SparseFFN can take,
# the benchmarks of record (bench train-ffn at M 16384, bench ffn at M 65536, bench decode), then the
# probes scripts/probes/train_grid.py and auto_grid.py (the training op and the one-op FFN against dense
# by row count and activity). Each stage gets what is left of BUDGET seconds (default 560), so a slow
# stage cannot push the call past the machine's limit. Run from the repository root:
#   OUT=/some/dir bash scripts/gpu_routing.sh
#   TESTS       pytest targets (default: the planner's GPU test, the module, compiled, graph and row-rule
#               tests of the kernels, the training backend and runs)
#   BENCH_ARGS  extra args of every bench (e.g. --allow-dirty); SKIP_TESTS=1 SKIP_BENCH=1 SKIP_GRID=1
# Logs, JSON and MD under $OUT; a short table last.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
source scripts/stage_lib.sh
BUDGET=${BUDGET:-560}
left() { echo $((BUDGET - SECONDS > 5 ? BUDGET - SECONDS : 5)); }
stage build timeout "$(left)" $PY -m twell.kernels.build --build
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    stage tests timeout "$(left)" $PY -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/test_routing_gpu.py \
        tests/test_kernels.py::test_module_uses_kernels_on_gpu \
        tests/test_kernels.py::test_auto_leaves_the_kernels_on_a_layer_that_is_not_sparse \
        tests/test_kernels.py::test_module_runs_in_a_cuda_graph \
        tests/test_kernels.py::test_compiled_module_matches_eager \
        tests/test_kernels.py::test_compiled_module_is_one_graph_and_sees_weight_updates \
        tests/test_decode_kernels.py tests/test_sparse_training.py tests/test_train_sparse_run.py}
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
    stage train timeout "$(left)" $PY -m twell.bench train-ffn --out "$OUT" --no-energy --quiet ${BENCH_ARGS:-}
    stage ffn timeout "$(left)" $PY -m twell.bench ffn --shapes inference --M 65536 --out "$OUT" --no-energy \
        --quiet ${BENCH_ARGS:-}
    stage decode timeout "$(left)" $PY -m twell.bench decode --out "$OUT" --quiet ${BENCH_ARGS:-}
fi
if [ "${SKIP_GRID:-0}" != 1 ]; then
    stage train_grid timeout "$(left)" $PY scripts/probes/train_grid.py
    stage grid timeout "$(left)" $PY scripts/probes/auto_grid.py
fi
grep -E "passed|failed|error" "$OUT/tests.log" 2>/dev/null | tail -5
grep -E "^FAILED|^ERROR" "$OUT/tests.log" 2>/dev/null | head -20
for f in "$OUT"/*.md; do [ -e "$f" ] && { echo "== $f"; grep -E "^\| " "$f" | head -24; }; done
tail -27 "$OUT/train_grid.log" 2>/dev/null
tail -56 "$OUT/grid.log" 2>/dev/null | grep -E "^ +[0-9]|nnz"
printf '%s\n' "${summary[@]}"
