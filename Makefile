# One entry point. `make run` = set-up + the papermill pipeline (default profile cpu-smoke);
# `make test` = set-up + the test suite (what .ci/run calls).
PYTHON ?= python3
PROFILE ?= cpu-smoke
ONLY ?=
STAMP := .setup.stamp

.PHONY: setup run test bench gpu-check clean-reports

$(STAMP): pyproject.toml scripts/ensure_torch.py
	$(PYTHON) scripts/ensure_torch.py
	$(PYTHON) -m pip install -e ".[dev]"
	touch $(STAMP)

# The stamp says set-up ran in this tree; the import check catches a tree that moved to a fresh
# interpreter (stamp present, package absent).
setup:
	@$(PYTHON) -c "import twell, pytest, hypothesis" 2>/dev/null || rm -f $(STAMP)
	@$(MAKE) --no-print-directory $(STAMP) PYTHON=$(PYTHON)

run: setup
	$(PYTHON) -m twell.pipeline --profile $(PROFILE) $(if $(ONLY),--only $(ONLY))

test: setup
	$(PYTHON) -m pytest -v

clean-reports:
	rm -rf reports/smoke

bench: setup
	$(PYTHON) -m twell.bench ffn

# On an H100 machine (builds the kernels, runs the GPU tests and the benchmark).
gpu-check:
	bash scripts/gpu_check.sh
