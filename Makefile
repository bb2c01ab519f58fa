# One entry point. `make run` = set-up + the papermill pipeline (default profile cpu-smoke);
# `make test` = set-up + the test suite (what .ci/run calls).
#
# Set-up creates a virtual environment in .venv/ (with $(BASE_PYTHON)) and installs into it with the
# exact versions of $(LOCK), so a fresh clone (as in CI) builds a fresh environment and a missing
# install step fails there. `make test PYTHON=/path/to/python` uses that interpreter as it is instead
# of .venv/ (e.g. a GPU machine's python with its CUDA build of torch, which set-up never replaces);
# `LOCK=` installs without the lock. `make lock` regenerates the lock (see scripts/lock.py).
BASE_PYTHON ?= python3
VENV ?= .venv
LOCK ?= requirements/cpu-py311.lock
PROFILE ?= cpu-smoke
ONLY ?=

# Only a PYTHON given on the command line (passed on to sub-makes) leaves the venv out.
ifeq ($(origin PYTHON),command line)
STAMP := .setup.stamp
VENV_PYTHON :=
else
PYTHON := $(VENV)/bin/python
# Inside the venv: a deleted or recreated venv has no stamp.
STAMP := $(VENV)/twell-setup.stamp
VENV_PYTHON := $(PYTHON)
endif
PIP_LOCK := $(if $(LOCK),-c $(LOCK))

.PHONY: setup run test bench gpu-check clean-reports lock browser-setup browser-check

$(VENV)/bin/python:
	$(BASE_PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml scripts/ensure_torch.py $(LOCK) | $(VENV_PYTHON)
	$(PYTHON) scripts/ensure_torch.py $(PIP_LOCK)
	$(PYTHON) -m pip install $(PIP_LOCK) -e ".[dev]"
	touch $(STAMP)

# The stamp says set-up ran for this interpreter; the import check also catches an interpreter that
# lost the package (stamp present, package absent).
setup: | $(VENV_PYTHON)
	@$(PYTHON) -c "import twell, pytest, hypothesis" 2>/dev/null || rm -f $(STAMP)
	@$(MAKE) --no-print-directory $(STAMP)

run: setup
	$(PYTHON) -m twell.pipeline --profile $(PROFILE) $(if $(ONLY),--only $(ONLY))

test: setup
	$(PYTHON) -m pytest -v

# The browser check (tests/test_browser.py): Debian's chromium when absent (never fails: without apt-get
# or root it says why, and the check skips), then the check alone, keeping the first-page screenshots.
browser-setup:
	bash scripts/install_chromium.sh

browser-check: setup browser-setup
	TWELL_SCREENSHOTS=reports/screenshots $(PYTHON) -m pytest -v -m browser tests/test_browser.py

# Regenerate the lock in a temporary fresh venv (then review the diff and commit it).
lock:
	$(BASE_PYTHON) scripts/lock.py $(LOCK)

clean-reports:
	rm -rf reports/smoke

bench: setup
	$(PYTHON) -m twell.bench ffn

# On an H100 machine (builds the kernels, runs the GPU tests and the benchmark).
gpu-check:
	bash scripts/gpu_check.sh
