#!/usr/bin/env bash
# The 0.5B sparse model and its dense twin, plus notebook 02's L1 sweep, on one 4-GPU machine in two calls
# (checkpoints never leave it: call 2 measures what call 1 left under runs/).
#
#   PHASE=train  (~8.5 min) all four GPUs at once:
#       GPU 0: SCALE (0p5b) on the offline corpus, STEPS fixed steps; GPU 1: its dense twin, the same steps
#       and data, side by side; GPUs 2-3: scripts/gpu_l1_sweep.sh (SWEEP_CONFIG, 8 runs, SWEEP_STEPS each).
#       Before them, in parallel: the kernel build and the tokens of both configs. Every run stops at the
#       same wall-clock deadline (train.stop_at_unix, TRAIN_WALL_S after this script starts) if its steps
#       are not done by then; the summary records the steps of each and the script warns when the twin's
#       differ from the sparse run's.
#       $OUT: train_pair.tar.gz (logs, metrics.jsonl, summary.json, config.yaml of both runs),
#             sweep.tar.gz (the sweep's $OUT: <run>/metrics.jsonl + summary.json, logs), train_summary.json.
#   PHASE=bench  (~5-8 min) on runs/eff_<SCALE> and runs/eff_<SCALE>_dense, four independent steps at once:
#       GPU 0: `python -m twell.bench model` (sparse against the twin); GPU 1: `python -m twell.bench activity`
#       (active neurons per layer and position, both models, held-out tokens); GPUs 2 / 3: `python -m
#       twell.eval run` of the sparse / dense model on EVAL_TASKS, then `python -m twell.eval compare`.
#       A failing step does not stop the others. $OUT: bench_phase.json (each step's status, time, log tail),
#       bench_<SCALE>.tar.gz (model benchmark JSON/MD and every log), activity_<SCALE>.json,
#       eval_<SCALE>.tar.gz (EvalRun JSONs with per-document scores, table CSV/MD, chart).
# Exit status: 0 when every step succeeded (train: and the twin ran the sparse run's steps).
#
# Both phases:
#   PHASE=train|bench      required
#   SCALE=0p5b             sparse config (its twin: <SCALE>_dense); runs in runs/eff_<SCALE>[_dense]
#   DEVICE=cuda            cpu: a smoke test of this script
#   DATA=shared:corpus/python311_docs.jsonl   corpus of the pair (TWELL_SHARED_DATA, or a carried .devdata/)
# PHASE=train:
#   STEPS=5000 SEQ=1024 BATCH=4 MICRO=$BATCH WARMUP=200   the pair's steps and batch (BATCH sequences of SEQ
#                          tokens per optimizer step: many small steps, the L1 term acts per step)
#   LOG_EVERY=10 ACT_CKPT=false SPARSE_KERNELS=auto   L1= (the sparse run's coefficient; default the config's)
#   TRAIN_WALL_S=500       wall-clock budget from the script's start: the deadline of every run
#   RESERVE_S=60           seconds a pair run keeps before the deadline for its evaluation, checkpoint, export
#   PAIR_GPUS="0 1"        GPUs of the sparse run and of its twin
#   EXTRA="--set ..."      more overrides for both pair runs
#   SWEEP=1 SWEEP_CONFIG=small SWEEP_STEPS=3000 SWEEP_GPUS="2 3" SWEEP_JOBS=8 SWEEP_RESERVE_S=40
#   SWEEP_EXTRA="--set ..."   the sweep (COEFS and REINIT pass through to gpu_l1_sweep.sh)
#   BUILD=1                build the CUDA kernels first (DEVICE=cuda); if that fails, every run trains without
#                          them (train.sparse_kernels=never) instead of each trying the build again
# The kernel build and the prepared tokens live under runs/ (TWELL_BUILD_DIR=runs/twell_build,
# TWELL_CACHE=runs/twell_cache unless set), which stays on the machine between the two calls.
# PHASE=bench:
#   BENCH_GPU=0 ACTIVITY_GPU=1 EVAL_GPUS="2 3"   GPUs of the steps (eval: sparse, dense)
#   BENCH_SEQ              prefill/training sequence of the model benchmark (default: the run's seq_len)
#   BENCH_ARGS="..."       more arguments of `twell.bench model`; ACTIVITY_ARGS: of `twell.bench activity`
#   EVAL_TASKS="arc_easy ... commonsense_qa" (default: the paper's seven)   EVAL_LIMIT= (documents per task; empty: all)   EVAL_SPARSE_PATH=auto
#   EVAL_BATCH=auto        lm-eval batch size
#   STEP_LIMIT_S=420       time limit of each bench step (it is stopped after that; what it wrote stays)
#   EVAL=1                 0: no downstream evaluation (no eval steps, no comparison)
#   SERIAL=0               1: the model benchmark runs first, alone on the machine, then the other steps (one GPU:
#                          BENCH_GPU=0 ACTIVITY_GPU=0 EVAL_GPUS="0 0"; nothing else disturbs its timing)
# Both phases, optional: SIDE_CMD="..." SIDE_GPU=3   one more command (bash -c) on that GPU: in the train phase
#   beside the runs, in the bench phase from the start (after the activity step when on that step's GPU, the
#   default); it inherits this script's environment (SCALE, STEPS, BENCH_ARGS, ...: set what it reads in
#   SIDE_CMD itself) and sees only its GPU (CUDA_VISIBLE_DEVICES); it writes into
#   $SIDE_OUT (packed with the pair / the model benchmark), its log is logs/side.log
set -u -o pipefail
cd "$(dirname "$0")/.."
source scripts/offline_env.sh
source scripts/run_lib.sh
T0=$(date +%s)
PHASE=${PHASE:?set PHASE=train or PHASE=bench}
SCALE=${SCALE:-0p5b}
DEVICE=${DEVICE:-cuda}
DATA=${DATA:-shared:corpus/python311_docs.jsonl}
export TWELL_BUILD_DIR=${TWELL_BUILD_DIR:-$PWD/runs/twell_build}  # runs/ stays on the machine between calls
export TWELL_CACHE=${TWELL_CACHE:-$PWD/runs/twell_cache}
SPARSE_RUN=runs/eff_$SCALE
DENSE_RUN=runs/eff_${SCALE}_dense
STAGE=runs/scale_stage/$PHASE  # what gets packed; replaced on every call
rm -rf "$STAGE"
mkdir -p "$STAGE/logs"
FAILED=0
declare -A PIDS=() STARTED=() GPU_OF=()

# start NAME GPU LIMIT_S COMMAND...: run in the background, output in $STAGE/logs/NAME.log (LIMIT_S 0: no limit)
start() {
    local name=$1 gpu=$2 limit=$3; shift 3
    STARTED[$name]=$(date +%s)
    GPU_OF[$name]=$gpu
    if [ "$limit" -gt 0 ]; then
        CUDA_VISIBLE_DEVICES=$gpu timeout --kill-after=20 "$limit" "$@" > "$STAGE/logs/$name.log" 2>&1 &
    else
        CUDA_VISIBLE_DEVICES=$gpu "$@" > "$STAGE/logs/$name.log" 2>&1 &
    fi
    PIDS[$name]=$!
    echo "[$(( $(date +%s) - T0 )) s] started $name (GPU $gpu): $*"
}
# finish NAME: wait for it; its status and seconds go to $STAGE/steps.tsv
finish() {
    local name=$1 rc=0
    wait "${PIDS[$name]}" || rc=$?
    local secs=$(( $(date +%s) - ${STARTED[$name]} ))
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "${GPU_OF[$name]}" >> "$STAGE/steps.tsv"
    echo "[$(( $(date +%s) - T0 )) s] $name: rc=$rc after $secs s"
    if [ "$rc" -ne 0 ]; then
        FAILED=1
        case $rc in 124|137) echo "!!! $name stopped by its time limit (rc=$rc); its log ends with:" ;;
                    *) echo "!!! $name failed (rc=$rc); its log ends with:" ;; esac
        tail -n 15 "$STAGE/logs/$name.log" | sed 's/^/    /'
    fi
}
train_phase() {
    local STEPS=${STEPS:-5000} SEQ=${SEQ:-1024} BATCH=${BATCH:-4} WARMUP=${WARMUP:-200}
    local MICRO=${MICRO:-$BATCH} DEADLINE=$(( T0 + ${TRAIN_WALL_S:-500} ))
    read -r -a pair_gpus <<< "${PAIR_GPUS:-0 1}"
    # 1. set-up, in parallel: the kernels (the sparse runs would each wait for the build), the pair's tokens,
    #    the sweep's tokens (gpu_l1_sweep.sh prepares them too; then they are in the cache)
    if [ "$DEVICE" = cuda ] && [ "${BUILD:-1}" = 1 ]; then start build "${pair_gpus[0]}" 0 python3 -m twell.kernels.build --build; fi
    start prepare_pair "" 0 python3 -m twell.data --config "$SCALE" --data "$DATA" "${CORPUS_DATA_SETS[@]}"
    if [ "${SWEEP:-1}" = 1 ]; then start prepare_sweep "" 0 python3 -m twell.data --config "${SWEEP_CONFIG:-small}"; fi
    for s in build prepare_pair prepare_sweep; do [ -n "${PIDS[$s]:-}" ] && finish "$s"; done
    local kernels=${SPARSE_KERNELS:-auto} sweep_kernels=""
    if [ -n "${PIDS[build]:-}" ] && ! grep -q $'^build\t0\t' "$STAGE/steps.tsv"; then
        kernels=never
        echo "the kernel build failed: every run trains without the sparse kernels" | tee -a "$STAGE/notes.txt"
    fi
    [ "$kernels" = auto ] || sweep_kernels="--set train.sparse_kernels=$kernels"
    echo "[$(( $(date +%s) - T0 )) s] set-up done; every run stops by $(( DEADLINE - T0 )) s after the start"

    # 2. the runs, all at once
    corpus_args "$DEVICE" "$DATA"
    local pair=("${CORPUS_ARGS[@]}" --set train.steps="$STEPS" --set train.seq_len="$SEQ"
                --set train.global_batch="$BATCH" --set train.micro_batch="$MICRO" --set optim.warmup_steps="$WARMUP"
                --set train.eval_every="$STEPS" --set train.log_every="${LOG_EVERY:-10}"
                --set train.activation_checkpointing="${ACT_CKPT:-false}" --set train.stop_at_unix="$DEADLINE"
                --set train.wall_reserve_s="${RESERVE_S:-60}" --set train.sparse_kernels="$kernels"
                ${EXTRA:-})
    start "train_$SCALE" "${pair_gpus[0]}" 0 python3 -m twell.train --config "$SCALE" --out "$SPARSE_RUN" "${pair[@]}" \
        ${L1:+--set sparsity.l1_coef=$L1}
    start "train_${SCALE}_dense" "${pair_gpus[1]}" 0 python3 -m twell.train --config "${SCALE}_dense" --out "$DENSE_RUN" \
        "${pair[@]}"
    if [ "${SWEEP:-1}" = 1 ]; then
        start sweep "" 0 env OUT="$PWD/$STAGE/sweep" CONFIG="${SWEEP_CONFIG:-small}" STEPS="${SWEEP_STEPS:-3000}" \
            JOBS="${SWEEP_JOBS:-8}" GPU_LIST="${SWEEP_GPUS:-2 3}" DEVICE="$DEVICE" \
            EXTRA="--set train.stop_at_unix=$DEADLINE --set train.wall_reserve_s=${SWEEP_RESERVE_S:-40} --set train.ckpt_every=100000 $sweep_kernels ${SWEEP_EXTRA:-}" \
            bash scripts/gpu_l1_sweep.sh
    fi
    if [ -n "${SIDE_CMD:-}" ]; then
        mkdir -p "$STAGE/pair/side"
        start side "${SIDE_GPU:-3}" 0 env SIDE_OUT="$PWD/$STAGE/pair/side" bash -c "$SIDE_CMD"
    fi
    for s in "train_$SCALE" "train_${SCALE}_dense" sweep side; do [ -n "${PIDS[$s]:-}" ] && finish "$s"; done

    # 3. pack: the pair's files and logs, the sweep's folder, one summary
    for run in "$SPARSE_RUN" "$DENSE_RUN"; do
        mkdir -p "$STAGE/pair/$(basename "$run")"
        cp "$run"/{metrics.jsonl,summary.json,config.yaml} "$STAGE/pair/$(basename "$run")/" 2>/dev/null
    done
    cp -r "$STAGE/logs" "$STAGE/pair/logs"
    tar -czf "$OUT/train_pair.tar.gz" -C "$STAGE" pair
    if [ -d "$STAGE/sweep" ]; then
        cp "$STAGE/logs/sweep.log" "$STAGE/sweep/sweep_driver.log" 2>/dev/null
        tar -czf "$OUT/sweep.tar.gz" -C "$STAGE" sweep
    fi
    python3 - "$STAGE" "$OUT/train_summary.json" "$SPARSE_RUN" "$DENSE_RUN" "${SWEEP_STEPS:-3000}" "$T0" <<'PY'
import json, pathlib, sys, time
stage, out, sparse, dense, sweep_steps, t0 = sys.argv[1:]
stage = pathlib.Path(stage)
steps = [{"step": n, "rc": int(rc), "seconds": int(secs), "gpu": gpu}
         for n, rc, secs, gpu in (l.split("\t") for l in (stage / "steps.tsv").read_text().splitlines())]
def run(path):
    p = pathlib.Path(path) / "summary.json"
    if not p.is_file():
        return None
    s = json.loads(p.read_text()); f = s["final"]
    return {"name": s["name"], "l1_coef": s["l1_coef"], "steps_planned": s["steps_planned"], "steps_done": s["steps_done"],
            "stopped_early": s["stopped_early"], "stop_reason": s["stop_reason"], "tokens_per_step": s["tokens_per_step"],
            "epochs": s["epochs"], "train_seconds": s["train_seconds"], "tok_s_mean": s["tok_s_mean"],
            "active_frac_mean": f.get("active_frac_mean"), "active_frac_per_layer": f.get("active_frac_per_layer"),
            "val_ce": f.get("val_ce"), "val_active_frac": f.get("val_active_frac"), "device": s["device"],
            "sparse_training_kernels": s["config"]["train"]["sparse_kernels"]}
pair = {"sparse": run(sparse), "dense": run(dense)}
sweep = {p.parent.name: run(p.parent) for p in sorted((stage / "sweep").glob("*/summary.json"))}
warnings = []
if pair["sparse"] and pair["dense"]:
    a, b = pair["sparse"]["steps_done"], pair["dense"]["steps_done"]
    if a != b:
        warnings.append(f"the dense twin ran {b} steps, the sparse run {a}: not the same training (a wall-clock stop; "
                        "lower STEPS or raise TRAIN_WALL_S)")
else:
    warnings.append("a pair run left no summary.json (see its log in train_pair.tar.gz)")
short = [k for k, r in sweep.items() if r and r["steps_done"] != int(sweep_steps)]
if short:
    warnings.append(f"sweep runs stopped before {sweep_steps} steps: {short}")
notes = (stage / "notes.txt").read_text().splitlines() if (stage / "notes.txt").is_file() else []
summary = {"phase": "train", "wall_seconds": time.time() - float(t0), "steps": steps, "notes": notes, "pair": pair,
           "pair_steps_match": bool(pair["sparse"] and pair["dense"]
                                    and pair["sparse"]["steps_done"] == pair["dense"]["steps_done"]),
           "sweep_steps": int(sweep_steps), "sweep": sweep, "warnings": warnings}
pathlib.Path(out).write_text(json.dumps(summary, indent=1))
pct = lambda v: "-" if v is None else f"{100 * v:.2f}%"
num = lambda v, f: "-" if v is None else format(v, f)
print(f"\n{'run':32s} {'L1':>8s} {'steps':>11s} {'train s':>8s} {'tok/s':>8s} {'active':>8s} {'val CE':>7s}")
for label, r in [*[(f"pair {k}", v) for k, v in pair.items()], *sweep.items()]:
    if r is None:
        print(f"{label:32s} no summary.json"); continue
    print(f"{label:32s} {r['l1_coef']:8g} {r['steps_done']:5d}/{r['steps_planned']:<5d} {r['train_seconds']:8.0f} "
          f"{num(r['tok_s_mean'], '.0f'):>8s} {pct(r['active_frac_mean']):>8s} {num(r['val_ce'], '.4f'):>7s}"
          + ("  (stopped early)" if r["stopped_early"] else ""))
for w in warnings:
    print(f"WARNING: {w}")
sys.exit(1 if warnings else 0)
PY
    [ $? -eq 0 ] || FAILED=1
}

bench_phase() {
    local prepared seq steps
    for run in "$SPARSE_RUN" "$DENSE_RUN"; do
        if [ ! -f "$run/final/config.json" ]; then
            echo "error: no checkpoint at $run/final: run PHASE=train first, on this machine (runs/ must persist)"
            exit 1
        fi
    done
    prepared=$(json_get "$SPARSE_RUN/summary.json" data.prepared_dir || true)
    seq=${BENCH_SEQ:-$(json_get "$SPARSE_RUN/summary.json" config.train.seq_len || echo 1024)}
    steps=$(json_get "$SPARSE_RUN/summary.json" steps_done || echo "?")
    local limit=${STEP_LIMIT_S:-420}
    read -r -a eval_gpus <<< "${EVAL_GPUS:-2 3}"
    # lm-eval and its needs are not in the GPU image: the carried .whl/ (scripts/gpu_wheels.sh)
    if ! python3 -c "import lm_eval" 2>/dev/null; then
        PY=python3
        source scripts/gpu_deps.sh
        install_carried_wheels || echo "!!! lm-eval could not be installed from .whl/: the eval steps will fail"
    fi
    mkdir -p "$STAGE/bench" "$STAGE/eval"
    start bench "${BENCH_GPU:-0}" "$limit" bash -c 'source scripts/run_lib.sh && bench_model_pair "$@"' _ \
        "$SPARSE_RUN" "$DENSE_RUN" \
        "$SCALE ($steps steps)" "$STAGE/bench" "$DEVICE" --seq "$seq" ${BENCH_ARGS:-}
    if [ "${SERIAL:-0}" = 1 ]; then finish bench; unset 'PIDS[bench]'; fi
    start activity "${ACTIVITY_GPU:-1}" "$limit" python3 -m twell.bench activity "$SPARSE_RUN/final" \
        --dense-checkpoint "$DENSE_RUN/final" ${prepared:+--tokens "$prepared"} --seq "$seq" --label "$SCALE" \
        --device "$DEVICE" --out "$STAGE/activity_$SCALE.json" ${ACTIVITY_ARGS:-}
    local tasks=(${EVAL_TASKS:-arc_easy arc_challenge hellaswag openbookqa piqa winogrande commonsense_qa})
    if [ "${EVAL:-1}" = 1 ]; then
        start eval_sparse "${eval_gpus[0]}" "$limit" python3 -m twell.eval run "$SPARSE_RUN/final" --name sparse \
            --ffn-path "${EVAL_SPARSE_PATH:-auto}" --tasks "${tasks[@]}" --limit "${EVAL_LIMIT:-none}" --device "$DEVICE" \
            --batch-size "${EVAL_BATCH:-auto}" --out "$STAGE/eval/sparse.json"
        start eval_dense "${eval_gpus[1]}" "$limit" python3 -m twell.eval run "$DENSE_RUN/final" --name dense \
            --ffn-path dense --tasks "${tasks[@]}" --limit "${EVAL_LIMIT:-none}" --device "$DEVICE" \
            --batch-size "${EVAL_BATCH:-auto}" --out "$STAGE/eval/dense.json"
    fi
    local side_gpu=${SIDE_GPU:-${ACTIVITY_GPU:-1}}
    start_side() {
        mkdir -p "$STAGE/bench/side"
        start side "$side_gpu" "$limit" env SIDE_OUT="$PWD/$STAGE/bench/side" bash -c "$SIDE_CMD"
    }
    # on another GPU than the activity step's it starts now (beside whatever else runs there), on that
    # step's GPU after the step
    [ -n "${SIDE_CMD:-}" ] && [ "$side_gpu" != "${ACTIVITY_GPU:-1}" ] && start_side
    finish activity
    [ -n "${SIDE_CMD:-}" ] && [ -z "${PIDS[side]:-}" ] && start_side
    for s in bench eval_sparse eval_dense side; do [ -n "${PIDS[$s]:-}" ] && finish "$s"; done
    if [ -f "$STAGE/eval/sparse.json" ] && [ -f "$STAGE/eval/dense.json" ]; then
        start eval_compare "" 60 python3 -m twell.eval compare "$STAGE/eval/dense.json" "$STAGE/eval/sparse.json" \
            --out "$STAGE/eval" --stem "downstream_eval_$SCALE"
        finish eval_compare
    elif [ "${EVAL:-1}" = 1 ]; then
        echo "!!! no comparison: an evaluation wrote no result"; FAILED=1
    fi

    # pack: 4 files
    cp -r "$STAGE/logs" "$STAGE/bench/logs"
    tar -czf "$OUT/bench_$SCALE.tar.gz" -C "$STAGE" bench
    cp "$STAGE/activity_$SCALE.json" "$OUT/" 2>/dev/null
    cp "$STAGE/logs"/eval_*.log "$STAGE/eval/" 2>/dev/null
    tar -czf "$OUT/eval_$SCALE.tar.gz" -C "$STAGE" eval
    python3 - "$STAGE" "$OUT/bench_phase.json" "$T0" "$SCALE" <<'PY'
import json, pathlib, sys, time
stage, out, t0, scale = pathlib.Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]
steps = []
for line in (stage / "steps.tsv").read_text().splitlines():
    name, rc, secs, gpu = line.split("\t")
    log = stage / "logs" / f"{name}.log"
    tail = log.read_text(errors="replace").splitlines()[-30:] if log.is_file() else []
    steps.append({"step": name, "rc": int(rc), "seconds": int(secs), "gpu": gpu, "log_tail": tail})
res = {"phase": "bench", "scale": scale, "wall_seconds": time.time() - t0, "steps": steps,
       "ok": all(s["rc"] == 0 for s in steps)}
lines = []
bench = sorted((stage / "bench").glob("model-*.json"))
if bench:
    b = json.loads(bench[-1].read_text())
    res["model_bench"] = {"file": bench[-1].name, "rows": [{k: r[k] for k in ("measure", "batch", "speedup")} for r in b["rows"]],
                          "activity": {k: {"active_frac": v["active_frac"], "ce": v["ce"]} for k, v in b["model"]["activity"].items()}}
    lines += [f"model bench {r['measure']:9s} batch {r['batch']:3d}: sparse/dense {r['speedup']:.3f}x" for r in b["rows"]]
act = stage / f"activity_{scale}.json"
if act.is_file():
    a = json.loads(act.read_text())
    res["activity"] = {k: {"active_frac_per_layer": m["active_frac_per_layer"], "active_frac_mean": m["active_frac_mean"],
                           "ce": m["ce"], "tokens": m["tokens"]} for k, m in a["models"].items()}
    for k, m in a["models"].items():
        lines.append(f"activity {k:6s} ({m['tokens']} held-out tokens): active {100 * m['active_frac_mean']:.2f}% of H, per layer "
                     + " ".join(f"{100 * v:.2f}" for v in m["active_frac_per_layer"]) + f"; CE {m['ce']:.4f}")
for side in ("dense", "sparse"):
    p = stage / "eval" / f"{side}.json"
    if p.is_file():
        r = json.loads(p.read_text())
        res.setdefault("eval", {})[side] = {t: {"status": v["status"], "n": v["n"],
                                                **{m: x["value"] for m, x in v["metrics"].items()}} for t, v in r["tasks"].items()}
        res["eval"][side]["ffn_paths_observed"] = r["ffn_paths_observed"]
        lines.append(f"eval {side:6s} " + ", ".join(f"{t} acc {v['metrics'].get('acc', {}).get('value', float('nan')):.4f}"
                                                    f" (n {v['n']})" for t, v in r["tasks"].items() if v["status"] == "ok")
                     + f"; FFN paths {r['ffn_paths_observed']}")
pathlib.Path(out).write_text(json.dumps(res, indent=1))
print()
for s in steps:
    print(f"{s['step']:14s} rc={s['rc']:<4d} {s['seconds']:5d} s  GPU {s['gpu']}")
print(*lines, sep="\n")
PY
}

case "$PHASE" in
    train) train_phase ;;
    bench) bench_phase ;;
    *) echo "error: PHASE must be train or bench, got $PHASE"; exit 2 ;;
esac
echo "[$(( $(date +%s) - T0 )) s] PHASE=$PHASE done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
[ "$FAILED" -eq 0 ] && echo "all steps succeeded" || echo "NOT ALL SUCCEEDED: see the failures and warnings above"
exit "$FAILED"
