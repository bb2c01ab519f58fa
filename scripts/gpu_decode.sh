#!/usr/bin/env bash
# The decoding FFN on the GPU machine in one call: build, its tests (and the ones it could affect),
# then `python -m twell.bench decode` (CUDA graphs, BENCHMARK.md). Logs, JSON and MD under $OUT, a short
# table last. Run from the repository root: OUT=/some/dir bash scripts/gpu_decode.sh
#   TESTS       pytest targets (default: decoding kernels, training kernels, the module tests of test_kernels.py)
#   BENCH_ARGS  extra args of `twell.bench decode` (default: none); SKIP_TESTS=1 SKIP_PROBE=1 SKIP_HOST=1 SKIP_BENCH=1
# (the probe: scripts/probes/decode_breakdown.py, per-kernel times and graph replay floor at M 1 and 16;
#  host: scripts/probes/decode_host_time.py, host time per call of a SparseFFN and the op's entries at one row)
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
source scripts/stage_lib.sh
stage build $PY -m twell.kernels.build --build
[ "${SKIP_TESTS:-0}" = 1 ] || stage tests $PY -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_decode_kernels.py \
    tests/test_train_kernels.py tests/test_kernels.py -k "decode or train or module or compiled or graph"}
[ "${SKIP_PROBE:-0}" = 1 ] || stage probe $PY scripts/probes/decode_breakdown.py 1 16
[ "${SKIP_HOST:-0}" = 1 ] || stage host $PY scripts/probes/decode_host_time.py
[ "${SKIP_BENCH:-0}" = 1 ] || stage bench $PY -m twell.bench decode --out "$OUT" --quiet ${BENCH_ARGS:-}
grep -E "passed|failed|error" "$OUT/tests.log" 2>/dev/null | tail -15
grep -E "^\| " "$OUT/probe.log" 2>/dev/null
grep -E "^\| " "$OUT/host.log" 2>/dev/null
grep -E "^\| |FAIL|^- " "$OUT/bench.log" 2>/dev/null | head -40
printf '%s\n' "${summary[@]}"
