#!/usr/bin/env bash
# Train the `small` config (or its dense twin) on one H100 within one 10-minute command, and put the
# metrics, the summary and the final checkpoint under $OUT.
#
#   scripts/train_small_gpu.sh both       # sparse and dense side by side on the one GPU (how
#                                         # reports/runs/small and small_dense were made; ~7 min)
#   scripts/train_small_gpu.sh sparse     # configs/small.yaml        (ReLU + L1 2e-5)
#   scripts/train_small_gpu.sh dense      # configs/small_dense.yaml  (ReLU, L1 0)
#   scripts/train_small_gpu.sh calibrate  # ~150 steps of `small`: prints the STEPS that fill TRAIN_SECONDS
#
# Environment (all optional):
#   DATA           prepared data dir or corpus .jsonl (default .device/data/python311_docs-bpe8192, else
#                  .device/data/python311_docs.jsonl, which is tokenised here first, ~10 s)
#   STEPS          optimizer steps (default: the config's; use the same value for sparse and dense)
#   BUDGET_S       seconds from script start after which training stops cleanly (default 540), leaving time
#                  for the final validation, the checkpoint and the export inside a 600 s command
#   TRAIN_SECONDS  calibrate: training seconds to fill (default 480)
#   COMPILE        1: torch.compile each decoder layer (default 0)
#   EXTRA          more `--set key=value` arguments for twell.train (same for sparse and dense)
#   OUT            output root (default ./runs/gpu_out); files land in $OUT/<run>/ (one level, at most 8 files)
#
# No network, no pip: needs python3 with torch (CUDA), transformers, tokenizers, safetensors, numpy, yaml.
set -euo pipefail
T0=$(date +%s)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=true

MODE="${1:-}"
if [[ "$MODE" == both ]]; then
  # The small model at 2k-token steps leaves the GPU mostly idle (launch-bound): two runs share it.
  "$0" sparse > >(sed 's/^/[sparse] /') 2>&1 &
  P1=$!
  "$0" dense > >(sed 's/^/[dense] /') 2>&1 &
  P2=$!
  RC=0
  wait $P1 || RC=$?
  wait $P2 || RC=$?
  exit $RC
fi
case "$MODE" in
  sparse) CONFIG=small ;;
  dense) CONFIG=small_dense ;;
  calibrate) CONFIG=small ;;
  *) echo "usage: $0 both|sparse|dense|calibrate" >&2; exit 2 ;;
esac

if [[ -z "${DATA:-}" ]]; then
  if [[ -f .device/data/python311_docs-bpe8192/meta.json ]]; then DATA=.device/data/python311_docs-bpe8192
  elif [[ -f .device/data/python311_docs.jsonl ]]; then DATA=.device/data/python311_docs.jsonl
  else echo "no data: set DATA or put the prepared dir / jsonl under .device/data/" >&2; exit 2; fi
fi
if [[ ! -e "$DATA" ]]; then echo "DATA=$DATA does not exist" >&2; exit 2; fi
OUT="${OUT:-$PWD/runs/gpu_out}"
STEPS_FLAG=${STEPS:+--set train.steps=$STEPS}
BUDGET_S="${BUDGET_S:-540}"
COMPILE="${COMPILE:-0}"
COMPILE_FLAG=$([[ "$COMPILE" == 1 ]] && echo true || echo false)
WORK="$(mktemp -d /tmp/twell_small.XXXXXX)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"

if [[ "$MODE" == calibrate ]]; then
  python3 -m twell.train --config "$CONFIG" --data "$DATA" --out "$WORK/calib" --overwrite \
    --set train.steps=150 --set train.eval_every=1000 --set train.ckpt_every=1000 --set train.progress=false \
    --set train.compile="$COMPILE_FLAG" --set train.export_dtype=bf16
  python3 - "$WORK/calib/metrics.jsonl" "${TRAIN_SECONDS:-480}" <<'EOF'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"kind": "train"' in l]
step_s = statistics.median(r["step_s"] for r in recs if r["step"] > 50)
target = float(sys.argv[2])
# validation every 250 steps (~140k tokens, forward only) costs about as much as 3-4 training steps
steps = int(target / (step_s * (1 + 4 / 250)))
print(f"median step time after warm-up: {step_s * 1000:.1f} ms ({recs[-1]['tok_s']:.0f} tok/s)")
print(f"STEPS={steps}   # fills ~{target:.0f} s of training")
EOF
  exit 0
fi

RUN_OUT="$OUT/$CONFIG"
mkdir -p "$RUN_OUT"
STOP_AT=$((T0 + BUDGET_S))
set +e
python3 -m twell.train --config "$CONFIG" --data "$DATA" --out "$WORK/$CONFIG" --overwrite \
  $STEPS_FLAG --set train.stop_at_unix="$STOP_AT" --set train.wall_reserve_s=15 \
  --set train.compile="$COMPILE_FLAG" --set train.progress=false ${EXTRA:-}
RC=$?
set -e
# Bring back at most 8 files, one folder level: metrics, summary, and the Hugging Face checkpoint
# (config, safetensors shards of <= 15 MB + index, tokenizer). generation_config.json is left behind.
cp "$WORK/$CONFIG/metrics.jsonl" "$RUN_OUT/" 2>/dev/null || true
cp "$WORK/$CONFIG/summary.json" "$RUN_OUT/" 2>/dev/null || true
# The checkpoint only comes back when it fits the device tool's limits (<= 60 MB in all).
CKPT_MB=$(du -sm "$WORK/$CONFIG/final" 2>/dev/null | cut -f1 || echo 0)
if [[ -d "$WORK/$CONFIG/final" ]] && (( CKPT_MB <= 60 )); then
  for f in config.json model.safetensors model.safetensors.index.json model-0000*-of-0000*.safetensors \
           tokenizer.json tokenizer_config.json; do
    for g in "$WORK/$CONFIG/final"/$f; do [[ -f "$g" ]] && cp "$g" "$RUN_OUT/"; done
  done
fi
[[ -d "$WORK/$CONFIG/final" ]] && (( CKPT_MB > 60 )) && echo "checkpoint ($CKPT_MB MB) left on the device: too large to return"
ls -la "$RUN_OUT"
N=$(ls "$RUN_OUT" | wc -l)
if (( N > 8 )); then echo "WARNING: $N files in $RUN_OUT (limit 8)" >&2; fi
python3 - "$RUN_OUT/summary.json" <<'EOF' || true
import json, sys
s = json.load(open(sys.argv[1]))
f = s["final"]
print(json.dumps({k: s[k] for k in ("name", "steps_done", "steps_planned", "stopped_early", "epochs", "train_seconds",
                                    "tok_s_mean", "device")}, indent=1))
print(json.dumps({"val_ce": f.get("val_ce"), "best_val": s.get("best_val"), "train_ce_tail_mean": f["train_ce_tail_mean"],
                  "active_frac_mean": f["active_frac_mean"],
                  "active_per_layer": [round(a, 2) for a in f["active_mean_per_layer"]],
                  "dead_frac_per_layer": f["dead_frac_per_layer"]}, indent=1))
EOF
echo "elapsed $(( $(date +%s) - T0 )) s, exit $RC"
exit $RC
