# One entry point. `make run` = set-up + the papermill pipeline (default profile cpu-smoke);
# `make test` = set-up + the test suite (what .ci/run calls).
PYTHON ?= python3
PROFILE ?= cpu-smoke
STAMP := .setup.stamp

.PHONY: setup run test kernels-check clean-reports

$(STAMP): pyproject.toml scripts/ensure_torch.py
	$(PYTHON) scripts/ensure_torch.py
	$(PYTHON) -m pip install -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(PYTHON) -m twell.pipeline --profile $(PROFILE)

test: setup
	$(PYTHON) -m pytest -v

clean-reports:
	rm -rf reports/notebooks/* reports/figures/* reports/tables/*
