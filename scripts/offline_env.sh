# Sourced by the GPU-machine scripts that train or benchmark offline (repository root as the working
# directory): the package from src/, no hub access, the shared data from a carried .devdata/ when
# there is one, and the output folder $OUT (default runs/gpu_out), created.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ -d .devdata ]; then export TWELL_SHARED_DATA=${TWELL_SHARED_DATA:-$PWD/.devdata}; fi
OUT=${OUT:-$PWD/runs/gpu_out}
mkdir -p "$OUT"
