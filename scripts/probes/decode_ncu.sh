#!/usr/bin/env bash
# Nsight Compute counters of the decoding op's kernels (scripts/probes/decode_ncu.py as the target): speed
# of light, memory workload, occupancy, launch and warp-state sections of the 4th call's gate_up and down
# (after warm-up), clocks left alone. Writes DIR/decode_ncu_M<M>.{ncu-rep,txt}.
# Usage: bash scripts/probes/decode_ncu.sh DIR [M ...]   (from the repository root, on the GPU machine)
set -u -o pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # the target imports twell
dir=${1:?output directory}; shift
mkdir -p "$dir"
for M in "${@:-1}"; do
    ncu --clock-control none --kernel-name regex:'gate_up_kernel|down_kernel' --launch-skip 6 --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats -o "$dir/decode_ncu_M$M" -f \
        python3 scripts/probes/decode_ncu.py "$M" 6 > "$dir/decode_ncu_M$M.log" 2>&1 \
        && ncu --import "$dir/decode_ncu_M$M.ncu-rep" --print-summary none > "$dir/decode_ncu_M$M.txt" 2>&1
    rc=$?
    echo "M=$M: rc=$rc"
    [ "$rc" -eq 0 ] || tail -n 25 "$dir/decode_ncu_M$M.log"
    grep -E "gate_up_kernel|down_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Compute \(SM\)" \
        "$dir/decode_ncu_M$M.txt" 2>/dev/null | head -30
done
