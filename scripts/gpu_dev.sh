#!/usr/bin/env bash
# Kernel development loop on the H100 machine: probe, build, GPU tests, benchmark; each stage
# time-boxed so a hung kernel cannot eat the lease. Usage: scripts/gpu_dev.sh [stages...]
# stages: info probe build test bench (default: all). Env: BENCH_ARGS, TEST_ARGS.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stages=${*:-info probe build test bench}
summary=()
run() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; local rc=${PIPESTATUS[0]}
  summary+=("$name rc=$rc $((SECONDS - t0))s"); return $rc; }
for s in $stages; do case $s in
  info) run info 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv; python3 -c "import torch;print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; nvcc --version | tail -1' ;;
  probe) run probe 120 bash -c 'nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/l2_gather scripts/probes/l2_gather.cu && /tmp/l2_gather' ;;
  build) run build 400 python3 -m twell.kernels.build --build ;;
  test) run test 300 python3 -m pytest tests/test_kernels.py -x -q ${TEST_ARGS:-} ;;
  bench) run bench 420 python3 -m twell.bench ffn --out "$OUT" ${BENCH_ARGS:---shapes inference --M 65536 --no-energy} ;;
esac; done
echo "== summary"; printf '%s\n' "${summary[@]}"
