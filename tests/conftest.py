"""Shared pytest set-up: the `gpu` marker skips without CUDA and is counted in the summary; the
`seed` fixture seeds torch, random and numpy afresh per test and names the seed when the test fails."""
import os
import random

import numpy as np
import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()

SEED_ENV = "TWELL_TEST_SEED"


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test (or ``$TWELL_TEST_SEED`` to replay one), applied to torch, random and numpy.

    Random inputs find more than fixed ones, but only a failure that can be replayed is worth finding:
    the seed goes into the test's user properties and from there into its failure report."""
    fixed = os.environ.get(SEED_ENV, "").strip()
    value = int(fixed) if fixed else random.SystemRandom().randrange(2**31)
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)  # CUDA generators too
    request.node.user_properties.append(("seed", value))
    return value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seeds = [v for k, v in item.user_properties if k == "seed"]
    if report.failed and seeds:
        report.sections.append(("random seed", f"seed={seeds[0]}: re-run with {SEED_ENV}={seeds[0]}"))
    return report


@pytest.fixture(scope="module")
def kernels_ready():
    """The CUDA kernels built and loadable: a GPU machine where they are not is a failure, not a skip."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from twell import kernels

    ok, why = kernels.available()
    assert ok, f"kernels unavailable on this GPU machine: {why}"


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (kernels need an H100, sm_90)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    gpu = [r for r in terminalreporter.stats.get("skipped", []) if "needs a CUDA GPU" in str(r.longrepr)]
    terminalreporter.write_sep("-", "GPU tests")
    if _HAS_CUDA:
        terminalreporter.write_line(f"CUDA available ({torch.cuda.get_device_name()}): GPU tests ran")
    else:
        terminalreporter.write_line(f"{len(gpu)} GPU tests skipped (no CUDA on this machine)")


def put_nonfinite(where: str, value: float, n: int, x, w_gate, w_up, w_down) -> None:
    """Write ``value`` (NaN or an Inf) in place: into row 5 of x, or into neuron n's gate, up or down
    weight (column 7 of x's width; for down, output column 7)."""
    if where == "x":
        x[5, 7] = value
    elif where == "w_gate":
        w_gate[n, 7] = value
    elif where.startswith("w_up"):
        w_up[n, 7] = value
    elif where.startswith("w_down"):
        w_down[7, n] = value
    else:
        raise ValueError(f"unknown place {where!r}")
