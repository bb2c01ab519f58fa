#!/usr/bin/env bash
# The book-corpus runs on one GPU machine, over one warm sequence of calls: the 0.5B-shape pair (configs/
# 0p5b_books.yaml, sparse at L1 2e-5, and 0p5b_books_dense), the four `small` ablations (configs/
# small_books*.yaml), then the seven downstream tasks, the activity profile and the FFN timings of each.
# Checkpoints never leave the machine: everything after training runs there, in one background driver
# (setsid), which outlives the call that starts it. Calls only feed it data, run tests beside it, and wait.
#
# The prepared tokens (88 MB, tokenised here by `python -m twell.data --config 0p5b_books`) travel xz'd in
# two pieces, since a call carries at most 64 MiB with the working tree:
#   .device/books1/  train.bin.xz.part00, meta.json, tokenizer/, val.bin, SHA256SUMS, NAME (the folder name)
#   .device/books2/  train.bin.xz.part01
#   .device/evaldata/eval/   the seven tasks' local files (a copy of ../shared/data/eval)
#   .whl/                    lm-eval and its needs (scripts/gpu_wheels.sh)
#   .device/books1/tree.tar.gz  `git archive` of the commit to run (src, csrc, scripts, configs, tests,
#                    pyproject.toml) and COMMIT: the build, the driver and the tests run from that snapshot, so
#                    later calls' working trees (which replace the repository's files) cannot change a running job
# Everything is moved into $BOOKS (runs/books, kept between calls on the warm machine).
#
#   PHASE=stage  take what this call carried; BUILD=1 starts the kernel build in the background; START=1
#                starts the driver once the data is complete (the pair waits for the build)
#   PHASE=tests  the GPU tests TESTS (default: the training backend, the runs, FSDP2, the planner, the module
#                and decoding kernels), from the snapshot, beside the driver; log in $OUT/tests.log
#   PHASE=wait   wait up to WAIT_S (default 540) for the driver, printing its progress each minute
#   PHASE=pack   the driver's results into $OUT (books_results.tar.gz, books_summary.json) and a table
#   PHASE=driver (started by stage) the whole job; DEVICE=cpu with DATA_DIR and EXTRA runs it in the
#                foreground as a smoke test of this script
# Driver settings: TRAIN_WALL_S=1000 (every training run stops by then, counted from its start),
#   RESERVE_S=60, ACT_SEQ=1024 (the activity profile's sequence), PAIR_EXTRA / ABL_EXTRA / EXTRA (more --set overrides), ABLATIONS="small_books
#   small_books_dense small_books_silu small_books_relu" (empty: none), EVAL_LIMIT=none, STEP_LIMIT_S=600,
#   E2E=1 and E2E_UNTIL (unix time): the training-step benchmark of the trained pair at 4/8/16 x 1024
#   tokens, compiled, while time is left before E2E_UNTIL.
set -u -o pipefail
cd "$(dirname "$0")/.."
source scripts/offline_env.sh
PHASE=${PHASE:?set PHASE=stage, tests, wait, pack or driver}
DEVICE=${DEVICE:-cuda}
BOOKS=${BOOKS:-$PWD/runs/books}
export TWELL_BUILD_DIR=${TWELL_BUILD_DIR:-$PWD/runs/twell_build}
export TWELL_CACHE=${TWELL_CACHE:-$PWD/runs/twell_cache}
export TWELL_SHARED_DATA=${TWELL_SHARED_DATA_BOOKS:-$BOOKS/shared}
export PYTHONPATH="$PYTHONPATH:$BOOKS/site" MAX_JOBS=${MAX_JOBS:-$(nproc)}
mkdir -p "$BOOKS/logs" "$BOOKS/shared" "$BOOKS/data"
LOG=$BOOKS/logs
say() { echo "[$(date +%H:%M:%S)] $*"; }

TREE=$BOOKS/tree
# in_tree PHASE: this script's PHASE run from the snapshot (a job's own copy of the code)
in_tree() {
    [ -f "$TREE/scripts/gpu_books.sh" ] || { say "!!! no snapshot of the code in $TREE (carry .device/books1)"; return 1; }
    (cd "$TREE" && env PHASE="$1" PYTHONPATH= BOOKS="$BOOKS" IN_TREE=1 bash scripts/gpu_books.sh)
}

data_name() { cat "$BOOKS/incoming/NAME" 2>/dev/null; }
data_dir() { echo "${DATA_DIR:-$BOOKS/data/$(data_name)}"; }

unxz_stream() {  # xz -dc, or Python's lzma where the image has no xz
    if command -v xz > /dev/null; then xz -dc
    else python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)"; fi
}

stage_phase() {
    mkdir -p "$BOOKS/incoming"
    for d in .device/books1 .device/books2; do
        [ -d "$d" ] && cp -r "$d"/. "$BOOKS/incoming/" && say "took $d: $(ls "$d" | tr '\n' ' ')"
    done
    if [ -d .device/evaldata/eval ]; then
        cp -r .device/evaldata/eval "$BOOKS/shared/" && say "took the evaluation files: $(ls "$BOOKS/shared/eval" | tr '\n' ' ')"
    fi
    if compgen -G ".whl/*.whl" >/dev/null && [ ! -d "$BOOKS/site/lm_eval" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$BOOKS/site" \
            .whl/*.whl && say "installed the carried wheels into $BOOKS/site" || say "!!! installing .whl/ failed"
    fi
    if [ -f "$BOOKS/incoming/tree.tar.gz" ] && [ ! -f "$TREE/scripts/gpu_books.sh" ]; then
        mkdir -p "$TREE" && tar -xzf "$BOOKS/incoming/tree.tar.gz" -C "$TREE" \
            && say "code snapshot of commit $(cat "$BOOKS/incoming/COMMIT" 2>/dev/null) in $TREE"
    fi
    local dir name
    name=$(data_name)
    dir=$BOOKS/data/$name
    if [ -n "$name" ] && [ ! -f "$dir/.verified" ] && [ -f "$BOOKS/incoming/train.bin.xz.part00" ] \
            && [ -f "$BOOKS/incoming/train.bin.xz.part01" ]; then
        mkdir -p "$dir"
        cp -r "$BOOKS/incoming"/{meta.json,tokenizer,val.bin} "$dir/"
        cat "$BOOKS/incoming"/train.bin.xz.part0{0,1} | unxz_stream > "$dir/train.bin"
        if (cd "$dir" && sha256sum -c --quiet "$BOOKS/incoming/SHA256SUMS"); then
            touch "$dir/.verified"; say "prepared data complete and verified: $dir"
        else
            say "!!! the assembled data does not match SHA256SUMS"; rm -rf "$dir"; return 1
        fi
    fi
    if [ "${BUILD:-0}" = 1 ] && [ ! -f "$BOOKS/build.started" ]; then
        touch "$BOOKS/build.started"
        [ -f "$TREE/scripts/gpu_books.sh" ] || { say "!!! no snapshot of the code to build"; return 1; }
        (cd "$TREE" && PYTHONPATH="$TREE/src" setsid nohup bash -c \
            "python3 -m twell.kernels.build --build > '$LOG/build.log' 2>&1; echo \$? > '$BOOKS/build.rc'" \
            > /dev/null 2>&1 < /dev/null &)
        say "kernel build started (log $LOG/build.log)"
    fi
    if [ "${START:-0}" = 1 ]; then
        if [ ! -f "$(data_dir)/.verified" ]; then say "!!! not starting: the data is incomplete"; return 1; fi
        if [ -f "$BOOKS/driver.started" ]; then say "the driver runs already"; return 0; fi
        touch "$BOOKS/driver.started"
        [ -f "$TREE/scripts/gpu_books.sh" ] || { say "!!! no snapshot of the code to run"; return 1; }
        (cd "$TREE" && env PHASE=driver PYTHONPATH= BOOKS="$BOOKS" IN_TREE=1 E2E_UNTIL="${E2E_UNTIL:-0}" \
            setsid nohup bash scripts/gpu_books.sh > "$LOG/driver.log" 2>&1 < /dev/null &)
        say "driver started (log $LOG/driver.log)"
    fi
    return 0
}

# start NAME LIMIT_S COMMAND...: in the background, output in $LOG/NAME.log, status in $BOOKS/rc/NAME
declare -A PIDS=()
start() {
    local name=$1 limit=$2; shift 2
    mkdir -p "$BOOKS/rc"
    ( timeout --kill-after=20 "$limit" "$@" > "$LOG/$name.log" 2>&1; echo $? > "$BOOKS/rc/$name" ) &
    PIDS[$name]=$!
    say "started $name: $*"
}
finish() {  # wait for NAME
    wait "${PIDS[$1]}" 2>/dev/null
    say "$1: rc=$(cat "$BOOKS/rc/$1" 2>/dev/null || echo '?')"
}

driver_phase() {
    local data kernels=auto limit=${STEP_LIMIT_S:-600} runs=$BOOKS/runs
    data=$(data_dir)
    [ -f "$data/meta.json" ] || { say "!!! no prepared data at $data"; return 1; }
    mkdir -p "$runs" "$BOOKS/results"
    if [ "$DEVICE" = cuda ]; then
        while [ ! -f "$BOOKS/build.rc" ]; do sleep 2; done
        if [ "$(cat "$BOOKS/build.rc")" != 0 ]; then
            kernels=never; say "!!! the kernel build failed: every run trains without the sparse kernels"
        fi
    fi
    local deadline=$(( $(date +%s) + ${TRAIN_WALL_S:-1000} ))
    local common=(--data "$data" --overwrite --set train.device="$DEVICE" --set train.progress=false
                  --set train.stop_at_unix="$deadline" --set train.wall_reserve_s="${RESERVE_S:-60}"
                  --set train.sparse_kernels="$kernels" --set train.export_dtype=bf16 ${EXTRA:-})
    say "training until $(date -d "@$deadline" +%H:%M:%S) at the latest; kernels: $kernels"
    start train_0p5b_books 3000 python3 -m twell.train --config 0p5b_books --out "$runs/0p5b_books" "${common[@]}" \
        --set train.compile="${COMPILE:-true}" ${PAIR_EXTRA:-}
    start train_0p5b_books_dense 3000 python3 -m twell.train --config 0p5b_books_dense --out "$runs/0p5b_books_dense" \
        "${common[@]}" --set train.compile="${COMPILE:-true}" ${PAIR_EXTRA:-}
    local abl
    for abl in ${ABLATIONS-small_books small_books_dense small_books_silu small_books_relu}; do
        start "train_$abl" 3000 python3 -m twell.train --config "$abl" --out "$runs/$abl" "${common[@]}" ${ABL_EXTRA:-}
    done
    finish train_0p5b_books; finish train_0p5b_books_dense

    # the pair: seven tasks each, the activity profile; the ablations' runs go on meanwhile
    local tasks=(arc_easy arc_challenge hellaswag openbookqa piqa winogrande commonsense_qa)
    mkdir -p "$BOOKS/results/eval" "$BOOKS/results/bench"
    start eval_sparse "$limit" python3 -m twell.eval run "$runs/0p5b_books/final" --name sparse --ffn-path auto \
        --tasks "${tasks[@]}" --limit "${EVAL_LIMIT:-none}" --device "$DEVICE" --batch-size "${EVAL_BATCH:-auto}" \
        --out "$BOOKS/results/eval/sparse.json"
    start eval_dense "$limit" python3 -m twell.eval run "$runs/0p5b_books_dense/final" --name dense --ffn-path dense \
        --tasks "${tasks[@]}" --limit "${EVAL_LIMIT:-none}" --device "$DEVICE" --batch-size "${EVAL_BATCH:-auto}" \
        --out "$BOOKS/results/eval/dense.json"
    start activity "$limit" python3 -m twell.bench activity "$runs/0p5b_books/final" \
        --dense-checkpoint "$runs/0p5b_books_dense/final" --tokens "$data" --seq "${ACT_SEQ:-1024}" --label 0p5b_books \
        --device "$DEVICE" --out "$BOOKS/results/activity_0p5b_books.json"
    for abl in ${ABLATIONS-small_books small_books_dense small_books_silu small_books_relu}; do finish "train_$abl"; done
    finish activity
    # the ablations' FFN time: prefill of each model on its own path against its dense path, then SiLU against ReLU
    local bargs=(--tokens "$data" --seq 1024 --prefill-batch 8 32 --decode-batch 1 --new-tokens 8 --train-batch 0
                 --no-static-decode --no-graph-decode --no-token-check --no-energy --device "$DEVICE" --quiet
                 --allow-dirty --out "$BOOKS/results/bench" ${ABL_BENCH_ARGS:-})
    for abl in small_books small_books_relu; do
        [ -d "$runs/$abl/final" ] && start "bench_$abl" "$limit" python3 -m twell.bench model "$runs/$abl/final" \
            --label "$abl" --tag "$abl" "${bargs[@]}" && finish "bench_$abl"
    done
    if [ -d "$runs/small_books_silu/final" ] && [ -d "$runs/small_books_dense/final" ]; then
        start bench_silu_vs_relu "$limit" python3 -m twell.bench model "$runs/small_books_silu/final" \
            --dense-checkpoint "$runs/small_books_dense/final" --sparse-path auto --label small_books_silu_vs_relu \
            --tag silu_vs_relu "${bargs[@]}"
        finish bench_silu_vs_relu
    fi
    finish eval_sparse; finish eval_dense
    if [ -f "$BOOKS/results/eval/sparse.json" ] && [ -f "$BOOKS/results/eval/dense.json" ]; then
        start eval_compare 120 python3 -m twell.eval compare "$BOOKS/results/eval/dense.json" \
            "$BOOKS/results/eval/sparse.json" --out "$BOOKS/results/eval" --stem downstream_eval_0p5b_books
        finish eval_compare
    fi
    # the trained pair's training step, compiled, at 4, 8 and 16 x 1024 tokens, while time is left
    if [ "${E2E:-1}" = 1 ] && [ "$DEVICE" = cuda ]; then
        local b
        for b in 16 8 4; do
            if [ "$(date +%s)" -gt $(( ${E2E_UNTIL:-0} - 150 )) ]; then say "no time left for the training rows at $b x 1024"; break; fi
            start "e2e_train$b" 300 python3 -m twell.bench model "$runs/0p5b_books/final" --label "0p5b_books" \
                --tag "train$b" --tokens "$data" --seq 1024 --prefill-batch 8 --decode-batch 1 --new-tokens 8 \
                --train-batch "$b" --train-steps 10 --train-compile --no-static-decode --no-graph-decode \
                --no-token-check --no-energy --device cuda --quiet --allow-dirty --out "$BOOKS/results/bench/e2e"
            finish "e2e_train$b"
        done
    fi
    # the runs' records (no checkpoints) and every log
    local r
    for r in "$runs"/*/; do
        r=$(basename "$r"); mkdir -p "$BOOKS/results/runs/$r"
        cp "$runs/$r"/{metrics.jsonl,summary.json,config.yaml} "$BOOKS/results/runs/$r/" 2>/dev/null
    done
    mkdir -p "$BOOKS/results/logs"; cp "$LOG"/*.log "$BOOKS/results/logs/" 2>/dev/null
    for r in "$BOOKS"/rc/*; do echo "$(basename "$r") $(cat "$r")"; done > "$BOOKS/results/steps.txt"
    touch "$BOOKS/done"
    say "driver done"
}

progress() {  # one line per training run: its last logged step, and the driver's last lines
    local m
    for m in "$BOOKS"/runs/*/metrics.jsonl; do
        [ -f "$m" ] || continue
        python3 - "$m" <<'PY'
import json, sys
last = None
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("kind") == "train":
        last = r
name = sys.argv[1].split("/")[-2]
if last:
    print(f"  {name:20s} step {last['step']:5d}  ce {last.get('ce', float('nan')):.3f}  "
          f"active {100 * last.get('active_frac', float('nan')):.2f}%  tok/s {last.get('tok_s', 0):.0f}")
PY
    done
    tail -n 3 "$LOG/driver.log" 2>/dev/null | sed 's/^/  driver: /'
}

wait_phase() {
    local until=$(( $(date +%s) + ${WAIT_S:-540} ))
    while [ "$(date +%s)" -lt "$until" ] && [ ! -f "$BOOKS/done" ]; do
        say "waiting"; progress
        sleep $(( until - $(date +%s) < 60 ? (until - $(date +%s) > 0 ? until - $(date +%s) : 1) : 60 ))
    done
    [ -f "$BOOKS/done" ] && say "the driver is done" || say "the driver still runs"
    progress
}

tests_phase() {
    while [ "$DEVICE" = cuda ] && [ ! -f "$BOOKS/build.rc" ]; do sleep 2; done
    timeout "${TESTS_LIMIT_S:-500}" python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/test_train_sparse_run.py \
        tests/test_sparse_training.py tests/test_sparse_training_fsdp.py tests/test_routing_gpu.py \
        tests/test_kernels.py::test_module_uses_kernels_on_gpu tests/test_kernels.py::test_module_runs_in_a_cuda_graph \
        tests/test_kernels.py::test_auto_leaves_the_kernels_on_a_layer_that_is_not_sparse \
        tests/test_kernels.py::test_compiled_module_matches_eager \
        tests/test_kernels.py::test_compiled_module_is_one_graph_and_sees_weight_updates tests/test_decode_kernels.py} \
        2>&1 | tee "$OUT/tests.log" | tail -n 40
}

pack_phase() {
    [ -f "$BOOKS/done" ] || say "!!! the driver is not done: packing what there is"
    tar -czf "$OUT/books_results.tar.gz" -C "$BOOKS" results
    python3 - "$BOOKS/results" "$OUT/books_summary.json" <<'PY'
import json, pathlib, sys
res, out = pathlib.Path(sys.argv[1]), sys.argv[2]
summary = {"steps": dict(l.split() for l in (res / "steps.txt").read_text().splitlines()) if (res / "steps.txt").is_file() else {}}
print(f"{'run':20s} {'steps':>11s} {'train s':>8s} {'tok/s':>8s} {'active':>8s} {'val CE':>7s}")
for s in sorted(res.glob("runs/*/summary.json")):
    d = json.loads(s.read_text()); f = d["final"]
    summary[d["name"]] = {k: d[k] for k in ("steps_done", "steps_planned", "train_seconds", "tok_s_mean", "stopped_early")}
    summary[d["name"]].update(val_ce=f.get("val_ce"), active=f.get("active_frac_mean"))
    print(f"{d['name']:20s} {d['steps_done']:5d}/{d['steps_planned']:<5d} {d['train_seconds']:8.0f} {d['tok_s_mean']:8.0f} "
          f"{100 * (f.get('active_frac_mean') or 0):7.3f}% {f.get('val_ce') or float('nan'):7.4f}")
for side in ("dense", "sparse"):
    p = res / "eval" / f"{side}.json"
    if p.is_file():
        r = json.loads(p.read_text())
        summary[f"eval_{side}"] = {t: {m: x["value"] for m, x in v["metrics"].items()} for t, v in r["tasks"].items()}
        print(f"eval {side:6s} " + ", ".join(f"{t} {v['metrics'].get('acc_norm', v['metrics'].get('acc', {})).get('value', float('nan')):.3f}"
                                             for t, v in r["tasks"].items()))
pathlib.Path(out).write_text(json.dumps(summary, indent=1))
print(summary["steps"])
PY
}

case "$PHASE" in
    stage) stage_phase ;;
    driver) driver_phase ;;
    tests) if [ "${IN_TREE:-0}" = 1 ]; then tests_phase; else in_tree tests; fi ;;
    wait) wait_phase ;;
    pack) pack_phase ;;
    *) echo "error: PHASE must be stage, tests, wait, pack or driver, got $PHASE"; exit 2 ;;
esac
