#!/usr/bin/env bash
# A/B of compile-time variants of the kernels, each in its own tree copy and process (the ops of two
# builds cannot share one): VALUES are substituted into `#define $MACRO 0` of $FILE, every copy is
# built first (in parallel), then ab_quick.py runs once per value in order and once more for the first
# value (drift check). ROUNDS=n > 1 runs n rounds of all values in turn instead (repeats, each value
# timed between the others). Run from the repository root on the GPU machine:
#   MACRO=TWELL_L2_MODE FILE=csrc/common.cuh VALUES="0 1 2" bash scripts/probes/variants_ab.sh
set -u
: "${MACRO:?}" "${FILE:?}" "${VALUES:?}"
ROOT=$PWD
PY=${PYTHON:-python3}
JOBS=$(( $(nproc) / $(echo $VALUES | wc -w) )); [ "$JOBS" -ge 1 ] || JOBS=1
for v in $VALUES; do
    d=/tmp/variant_$v; rm -rf "$d"; mkdir -p "$d"
    cp -r "$ROOT/src" "$ROOT/csrc" "$ROOT/scripts" "$d/"
    grep -q "^#define $MACRO 0$" "$d/$FILE" || { echo "no '#define $MACRO 0' in $FILE"; exit 1; }
    sed -i "s/^#define $MACRO 0$/#define $MACRO $v/" "$d/$FILE"
    (cd "$d" && MAX_JOBS=$JOBS PYTHONPATH=src "$PY" -c "from twell import kernels; kernels.load()" \
        > "/tmp/variant_$v.build.log" 2>&1 || { echo "build $v failed"; tail -30 "/tmp/variant_$v.build.log"; }) &
done
wait
first=${VALUES%% *}
ROUNDS=${ROUNDS:-1}
if [ "$ROUNDS" -gt 1 ]; then ORDER=$(for _ in $(seq "$ROUNDS"); do echo -n "$VALUES "; done); else ORDER="$VALUES $first"; fi
for v in $ORDER; do
    (cd "/tmp/variant_$v" && PYTHONPATH=src "$PY" scripts/probes/ab_quick.py "$MACRO=$v")
done
