# Sourced by the one-call GPU kernel scripts (gpu_train_kernels.sh, gpu_decode.sh) after `cd` to the
# repository root: $OUT (default gpu_check_out/) created, src/ on PYTHONPATH, $PY, and stage NAME CMD...,
# which runs CMD with its output in $OUT/NAME.log and adds its status and seconds to $summary
# (print it last: printf '%s\n' "${summary[@]}").
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
summary=()
stage() {  # name, command...
    local name=$1; shift
    local t0=$SECONDS
    "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-8s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
}
