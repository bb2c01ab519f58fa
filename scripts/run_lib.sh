# Shell pieces shared by the GPU-machine scripts that train on the offline corpus and benchmark what they
# trained (gpu_efficiency.sh, gpu_scale_runs.sh, gpu_decode_e2e.sh, gpu_train_e2e.sh). Sourced after
# scripts/offline_env.sh, with the repository root as the working directory.

# The data overrides of every offline-corpus run: 2% held-out documents, never the hub. `python -m twell.data`
# must get the same ones to prepare the folder the runs then find in the cache.
CORPUS_DATA_SETS=(--set data.val_fraction=0.02 --set data.allow_network=false)

# corpus_args DEVICE DATA [START]: the overrides every offline-corpus training run shares, into the array
# CORPUS_ARGS (bf16 export, no checkpoint before the end, no progress bar; START --overwrite, the default,
# replaces an earlier run in --out, --resume continues it).
corpus_args() {
    CORPUS_ARGS=(--data "$2" "${3:---overwrite}" --set train.device="$1" "${CORPUS_DATA_SETS[@]}"
                 --set train.export_dtype=bf16 --set train.ckpt_every=100000 --set train.progress=false)
}

# The one-GPU recipe of the end-to-end scripts (gpu_decode_e2e.sh, gpu_train_e2e.sh): 4 sequences of 1024
# tokens per step, 200 warm-up steps, a record every 10 steps, no activation checkpointing. A resumed run
# must repeat them (the batch fixes the data order).
E2E_RECIPE_SETS=(--set train.seq_len=1024 --set train.global_batch=4 --set train.micro_batch=4
                 --set optim.warmup_steps=200 --set train.log_every=10 --set train.activation_checkpointing=false)

# launch_train NPROC ARGS...: python -m twell.train, under torchrun when NPROC > 1.
launch_train() {
    local nproc=$1; shift
    if [ "$nproc" -gt 1 ]; then torchrun --standalone --nproc_per_node "$nproc" -m twell.train "$@"
    else python3 -m twell.train "$@"; fi
}

# json_get FILE KEY[.KEY...]: one value of a JSON file (nothing, status 1, when the file or key is missing).
json_get() {
    python3 - "$1" "$2" <<'PY' 2>/dev/null
import json, sys
v = json.load(open(sys.argv[1]))
for k in sys.argv[2].split("."):
    v = v[k]
print(v)
PY
}

# bench_model_pair RUN DENSE_RUN LABEL OUT_DIR DEVICE [ARGS...]: `python -m twell.bench model` on RUN/final
# against its dense twin DENSE_RUN/final, on the held-out tokens of the data RUN trained on.
bench_model_pair() {
    local run=$1 dense=$2 label=$3 out=$4 device=$5; shift 5
    local prepared
    prepared=$(json_get "$run/summary.json" data.prepared_dir || true)
    python3 -m twell.bench model "$run/final" --dense-checkpoint "$dense/final" --label "$label" --device "$device" \
        ${prepared:+--tokens "$prepared"} --out "$out" --quiet "$@"
}
