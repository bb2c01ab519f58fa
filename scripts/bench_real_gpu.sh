#!/usr/bin/env bash
# Real-activation rows of the FFN benchmark on one H100 within one 10-minute command: retrain `small`
# (scripts/train_small_gpu.sh sparse) unless CKPT names a checkpoint, then run
#   python -m twell.bench ffn --shapes SHAPES --checkpoint CKPT --tokens DATA --impl IMPLS BENCH_ARGS
# and put the JSON and the markdown table under $OUT (the training files under $OUT/train).
#
# Environment (all optional):
#   CKPT      checkpoint directory to benchmark (default: the one this script trains)
#   LAYERS    decoder layers of the retrain (default 4: layers with few and with tens of active neurons)
#   BUDGET_S  seconds of the retrain, start to checkpoint (default 360)
#   STEPS     optimizer steps of the retrain (default: the config's 18000; set it to what BUDGET_S fits so that
#             the schedule ends)
#   TRAIN_SET more overrides of the retrain, e.g. "--set sparsity.l1_coef=1e-5"
#   DATA      prepared data directory whose val split feeds the model (default .device/data/python311_docs-bpe8192)
#   IMPLS     implementations (default "twell-kernel twell-kernel-ops twell-kernel-union")
#   TAG       suffix of the bench files (default real)
#   SHAPES    bench shapes: real (default: the checkpoint's layers only), inference (adds the generator's
#             cases and the odd shape) or all (adds the training shape too). With all, keep the run inside
#             10 minutes: BUDGET_S=185 with two IMPLS took 454 s, build included
#   BENCH_ARGS  more bench arguments, e.g. "--M 65536 --energy-seconds 2"
#   OUT       output root (default ./runs/gpu_out)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT="${OUT:-$PWD/runs/gpu_out}"
DATA="${DATA:-.device/data/python311_docs-bpe8192}"
SHAPES="${SHAPES:-real}"
case "$SHAPES" in
  real|inference|all) ;;
  *) echo "SHAPES must be real, inference or all (the odd and training shapes use no checkpoint): got '$SHAPES'" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
if [[ -z "${CKPT:-}" ]]; then
  BEFORE=$(ls -d /tmp/twell_small.* 2>/dev/null || true)  # so that an earlier run's checkpoint is not taken
  EXTRA="--set model.num_layers=${LAYERS:-4} ${TRAIN_SET:-}" BUDGET_S="${BUDGET_S:-360}" OUT="$OUT/train" DATA="$DATA" \
    bash scripts/train_small_gpu.sh sparse
  CKPT=$(comm -13 <(echo "$BEFORE" | sort) <(ls -d /tmp/twell_small.* | sort) | head -1)/small/final
  [[ -f "$CKPT/config.json" ]] || { echo "no checkpoint at $CKPT" >&2; exit 1; }
fi
echo "benchmarking $CKPT on $DATA"
python3 -m twell.bench ffn --shapes "$SHAPES" --checkpoint "$CKPT" --tokens "$DATA" --impl ${IMPLS:-twell-kernel twell-kernel-ops twell-kernel-union} \
  --out "$OUT" --tag "${TAG:-real}" --quiet ${BENCH_ARGS:-}
