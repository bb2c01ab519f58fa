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

setup: $(STAMP)

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
