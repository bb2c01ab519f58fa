#!/usr/bin/env bash
# One-shot check on the GPU machine (H100): environment, extension build, ptxas table, GPU tests,
# FFN benchmark (BENCHMARK.md), short table last. Run from the repository root:
#
#   OUT=/some/dir bash scripts/gpu_check.sh
#
# Needs python3 with torch (CUDA), nvcc, ninja, pytest; the package is used from src/ (PYTHONPATH),
# not pip-installed. Files written to $OUT (at most 8, flat): env.txt, build.log, ptxas.txt,
# gpu_tests.log, bench.log, ffn-*.json, ffn-*.md.
#
# Environment options:
#   BENCH_ARGS   extra args of `python -m twell.bench ffn` (default: the full protocol), e.g.
#                BENCH_ARGS="--shapes inference --M 65536 --energy-seconds 2"
#   TEST_ARGS    extra args of pytest (default: none), e.g. TEST_ARGS="tests/test_kernels.py"
#   SKIP_BUILD=1 SKIP_PTXAS=1 SKIP_TESTS=1 SKIP_BENCH=1   skip a stage
#   PYTHON       interpreter (default python3); MAX_JOBS (default: nproc)
# Carry .whl (scripts/gpu_wheels.sh) for the lm-eval GPU test; without it that test fails on import.
# Carry .whl-nb too for the notebook tests (tests/test_pipeline.py, tests/test_eval_notebook.py); without
# it they are skipped (no nbformat on the GPU image).
# Exit status: 0 when every stage that ran passed, else 1 (each stage is attempted regardless).
set -u -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PYTHONUNBUFFERED=1

# Carried wheels (.whl/: lm-eval; .whl-nb/: papermill for the notebook tests); a failed install shows
# up as failing or skipped tests.
source scripts/gpu_deps.sh
install_carried_wheels || true

declare -a NAMES=() RESULTS=()
FAILED=0
record() {  # name rc seconds
    NAMES+=("$1"); RESULTS+=("$(printf 'rc=%-3s %5ss' "$2" "$3")")
    if [ "$2" -ne 0 ]; then FAILED=1; echo "!!! stage $1 FAILED (exit $2)"; fi
}
run_stage() {  # name logfile command...
    local name=$1 log=$2; shift 2
    echo; echo "=================== [$name] $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    record "$name" "$rc" $((SECONDS - t0))
    return 0
}

# ---- 1. environment
{
    echo "date: $(date -u +%FT%TZ)  host: $(hostname)  cwd: $PWD  git: $(git rev-parse --short HEAD 2>/dev/null || echo n/a)"
    nvidia-smi || echo "nvidia-smi failed"
    nvcc --version || echo "nvcc not on PATH"
    echo "ninja $(ninja --version 2>/dev/null || echo 'not on PATH')"
    "$PY" - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}  torch {torch.__version__}  CUDA {torch.version.cuda}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name}  sm_{p.major}{p.minor}  {p.total_memory / 2**30:.1f} GiB  SMs {p.multi_processor_count}  "
          f"L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB")
else:
    print("torch.cuda.is_available() is False")
try:
    import pynvml
    print("nvidia-ml-py present")
except ImportError:
    print("nvidia-ml-py missing: no energy numbers")
from twell.kernels import available
print("twell.kernels.available(build=False):", available(build=False))
EOF
} 2>&1 | tee "$OUT/env.txt"

# ---- 2. build the extension (timed)
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    run_stage build "$OUT/build.log" "$PY" -m twell.kernels.build --build --verbose
fi

# ---- 3. ptxas table (registers / spills / smem per kernel)
if [ "${SKIP_PTXAS:-0}" != 1 ]; then
    run_stage ptxas "$OUT/ptxas.txt" "$PY" -m twell.kernels.build --report
fi

# ---- 4. GPU tests
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    # shellcheck disable=SC2086
    run_stage gpu-tests "$OUT/gpu_tests.log" "$PY" -m pytest -m gpu -x -q -p no:cacheprovider ${TEST_ARGS:-}
fi

# ---- 5. benchmark
if [ "${SKIP_BENCH:-0}" != 1 ]; then
    # shellcheck disable=SC2086
    run_stage bench "$OUT/bench.log" "$PY" -m twell.bench ffn --out "$OUT" ${BENCH_ARGS:-}
fi

# ---- 6. summary (last, so it is what the tail of the log shows)
echo; echo "=================== summary"
"$PY" - "$OUT" <<'EOF' || echo "(no benchmark JSON to summarise)"
import json, sys
from pathlib import Path
files = sorted(Path(sys.argv[1]).glob("ffn-*.json"), key=lambda p: p.stat().st_mtime)
if not files:
    raise SystemExit(1)
r = json.loads(files[-1].read_text())
m = r["meta"]
print(f"{files[-1].name}: {m['device_name']}, torch {m['torch']}, CUDA {m['cuda']}, "
      f"{'complete' if r.get('complete', True) else 'PARTIAL'}")
def num(v, fmt):
    return "-" if v is None else format(v, fmt)


print(f"{'case':<30} {'nnz mean/max':>13} {'impl':<16} {'dense ms':>9} {'sparse ms':>9} {'speedup':>8} "
      f"{'rel.err':>9} {'ceiling':>8}  status")
for c in r["cases"]:
    s = c["sparsity"]
    dense = c["dense"].get("timing", {}).get("median_ms")
    for name, v in (c["impls"] or {"-": None}).items():
        v = v or {}
        status = "dense only" if name == "-" else ("ok" if v.get("ok") else "FAIL")
        nnz = f"{s['mean_active']:.1f}/{s['max_active']}"
        print(f"{c['name']:<30} {nnz:>13} {name:<16} {num(dense, '.3f'):>9} "
              f"{num(v.get('timing', {}).get('median_ms'), '.3f'):>9} {num(v.get('speedup'), '.2f'):>8} "
              f"{num(v.get('rel_err'), '.2e'):>9} {num(c.get('ceiling'), '.2f'):>8}  {status}")
for f in r["failures"]:
    print("FAIL", f)
for k, why in r["unavailable"].items():
    print(f"unavailable {k}: {why}")
EOF
echo
for i in "${!NAMES[@]}"; do printf '  %-10s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"; done
echo "files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $FAILED
