#!/usr/bin/env bash
# Wheels for the GPU machine, whose image lacks lm-eval and some of its pure-Python needs (the image's
# own torch, transformers, accelerate, pandas, pyarrow, scikit-learn, sacrebleu, ... are used as they
# are). Run here, in the repository root (needs a package registry); then pass `.whl` in the device
# tool's `carry`: scripts/gpu_deps.sh (sourced by gpu_check.sh and gpu_pipeline.sh) installs them.
# The second part fills .whl-nb/ (papermill, for the notebooks and their tests).
# Versions match the local environment that the CPU tests use.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .git/info .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${PLAT[@]}" -d .whl \
    lm_eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19 \
    more_itertools==11.2.1 pytablewriter==1.2.1 dataproperty==1.1.1 mbstrdecoder==1.1.5 \
    pathvalidate==3.3.1 tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1 \
    nltk==3.10.4
# These ship only as source: build pure-Python wheels here.
python3 -m pip wheel -q --no-deps -w .whl sqlitedict==2.1.0 word2number==1.1 rouge-score==0.1.2
ls .whl && du -sh .whl

# The notebook pipeline's needs (papermill and a Jupyter kernel; the image has matplotlib and seaborn)
# go to .whl-nb/, apart from .whl/: scripts/gpu_deps.sh installs them into the image's environment with
# pip resolving against it, so pip adds only what the image lacks. numpy and pandas are left out: the
# image has them, and its copies must stay the ones its other packages were built against.
mkdir -p .whl-nb
grep -qx '/.whl-nb/' .git/info/exclude 2>/dev/null || echo '/.whl-nb/' >> .git/info/exclude
python3 -m pip download -q "${PLAT[@]}" -d .whl-nb \
    papermill==2.7.0 ipykernel==7.4.0
rm -f .whl-nb/numpy-*.whl .whl-nb/pandas-*.whl
ls .whl-nb && du -sh .whl-nb
