#!/usr/bin/env bash
# The decoding op's gate variants (FATReLU, dReLU) on one GPU: build, the decoding op's GPU tests, then
# `python -m twell.bench decode --gate ...` at the public checkpoints' shapes and activities (docs/models.md):
# FATReLU at D 4096 / H 11008 with 11% active, dReLU at D 4096 / H 14336 with the gate and the
# up projection each 30% positive, FATReLU at D 1536 / H 3840 with 12% active; then "auto" at the first
# shape from 1 to 65536 rows. Logs and records under $OUT; a
# short table last. BENCH_ARGS=--allow-dirty where the tree has local changes.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
source scripts/stage_lib.sh
stage build $PY -m twell.kernels.build --build
stage tests $PY -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_decode_kernels.py tests/test_gates.py}
common=(--no-energy --out "$OUT" --quiet ${BENCH_ARGS:-})
stage fatrelu4096 $PY -m twell.bench decode --gate fatrelu --threshold 0.01 --D 4096 --H 11008 --cases nnz1211 \
    --M 1 8 "${common[@]}" --tag fatrelu-4096
stage drelu4096 $PY -m twell.bench decode --gate drelu --up-active 0.3 --D 4096 --H 14336 --cases nnz4301 \
    --M 1 8 "${common[@]}" --tag drelu-4096
stage fatrelu1536 $PY -m twell.bench decode --gate fatrelu --threshold 0.03 --D 1536 --H 3840 --cases nnz461 \
    --M 1 8 "${common[@]}" --tag fatrelu-1536
# "auto" (SparseFFN's own choice) from 1 to 65536 rows at ProSparse-7B's shape and activity: the decoding op on
# the rows its activity allows, dense beyond (the bar: never below 0.98x dense)
stage auto4096 $PY -m twell.bench decode --gate fatrelu --threshold 0.01 --D 4096 --H 11008 --cases nnz1211 \
    --M 1 2 4 64 2048 65536 --impl decode-kernel auto "${common[@]}" --reps 20 --tag auto-fatrelu-4096
tail -3 "$OUT/tests.log"; grep -E "FAILED|Error" "$OUT/tests.log" | head -10
grep -hE "^\| nnz|FAIL" "$OUT"/decode-*.md
printf '%s\n' "${summary[@]}"
