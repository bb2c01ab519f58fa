#!/usr/bin/env bash
# The notebook pipeline on the GPU machine, as a researcher with an H100 runs it. Two calls of
# `python -m twell.pipeline`:
#   1. profile gpu-small, notebooks 00-02 (the kernels built, verified against the reference and
#      benchmarked inside notebook 01; notebook 02 plots the committed H100 runs in reports/runs/);
#   2. profile cpu-smoke, notebooks 02-03 on device cuda: trains the tiny model and its dense twin on
#      the GPU, then evaluates both with lm-eval, the sparse one on the kernel path, and checks the kernel
#      path's log-likelihoods against the dense path (gpu-small's notebook 03 needs the `small`
#      checkpoints, which are too large to carry).
# Run from the repository root with .whl and .whl-nb carried (scripts/gpu_wheels.sh):
#
#   OUT=/some/dir bash scripts/gpu_pipeline.sh
#
# Executed notebooks, figures and tables go to $OUT/gpu-small/ and $OUT/smoke-cuda/. The device tool
# brings back at most 8 files, so at the end the script copies executed notebooks 01 and 03 and the two
# pipeline summaries to $OUT's top level and packs both folders into $OUT/reports.tgz.
# LIMIT_GPU_SMALL / LIMIT_SMOKE_CUDA (seconds, default 330 / 200) bound the two calls.
# Exit status: 0 when both calls passed.
set -u -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-$PWD/gpu_pipeline_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}

# lm-eval (.whl/) and papermill with a Jupyter kernel (.whl-nb/), as scripts/gpu_check.sh installs them.
PY=python3
source scripts/gpu_deps.sh
install_carried_wheels || exit 1
"$PY" -c "import papermill, torch; print('papermill', papermill.__version__, 'torch', torch.__version__)" || exit 1

FAILED=0
step() {  # name seconds args...: a time limit per call, so that what ran still comes back
    local name=$1 limit=$2; shift 2
    echo; echo "=================== [$name] $PY -m twell.pipeline $*"
    local t0=$SECONDS
    timeout "$limit" "$PY" -m twell.pipeline --no-progress "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "[$name] rc=$rc $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || FAILED=1
}
step gpu-small "${LIMIT_GPU_SMALL:-330}" --profile gpu-small --only 00,01,02 --reports-dir "$OUT/gpu-small"
step smoke-cuda "${LIMIT_SMOKE_CUDA:-200}" --profile cpu-smoke --only 02,03 --reports-dir "$OUT/smoke-cuda" \
    --set 02:device=cuda --set 03:device=cuda \
    --set '03:ffn_paths={dense: dense, sparse: kernel}' --set '03:check_paths=[dense, kernel]'

# What comes back: the two logs plus the executed notebook 01 and the run summaries (8 files at most).
cp "$OUT/gpu-small/notebooks/01_kernels.ipynb" "$OUT/01_kernels-gpu-small.ipynb" 2>/dev/null
cp "$OUT/smoke-cuda/notebooks/03_downstream_eval.ipynb" "$OUT/03_downstream_eval-smoke-cuda.ipynb" 2>/dev/null
cp "$OUT/gpu-small/notebooks/pipeline_run.json" "$OUT/pipeline_run-gpu-small.json" 2>/dev/null
cp "$OUT/smoke-cuda/notebooks/pipeline_run.json" "$OUT/pipeline_run-smoke-cuda.json" 2>/dev/null
(cd "$OUT" && tar czf reports.tgz gpu-small smoke-cuda && rm -rf gpu-small smoke-cuda)
ls -la "$OUT"
exit $FAILED
