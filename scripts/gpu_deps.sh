# Sourced by scripts/gpu_check.sh and scripts/gpu_pipeline.sh (repository root as the working directory,
# $PY the interpreter): installs the wheels that scripts/gpu_wheels.sh fetched, when they were carried.
#   .whl/     lm-eval and its needs, absent from the GPU image: into /tmp/site, appended to PYTHONPATH.
#             PYTHONPATH comes before site-packages: the carried datasets/dill/multiprocess replace any
#             image copy.
#   .whl-nb/  papermill and a Jupyter kernel, into the image's own environment with pip resolving
#             against it, so only what is missing is added and torch, numpy, pandas and matplotlib stay
#             the image's. (A venv with --system-site-packages would not see them: the image's python3
#             is itself a venv.)
# Returns 1 when an install failed (each is attempted).
install_carried_wheels() {
    local rc=0
    if compgen -G ".whl/*.whl" >/dev/null; then
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
            export PYTHONPATH="$PYTHONPATH:/tmp/site"
        else
            echo "!!! installing .whl/ failed"; rc=1
        fi
    fi
    if compgen -G ".whl-nb/*.whl" >/dev/null && ! "$PY" -c "import papermill, ipykernel" 2>/dev/null; then
        "$PY" -m pip install -q --no-index --no-cache-dir --find-links .whl-nb papermill ipykernel \
            || { echo "!!! installing .whl-nb/ failed"; rc=1; }
    fi
    return $rc
}
