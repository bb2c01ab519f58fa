"""Shared pytest set-up: the `gpu` marker skips without CUDA and is counted in the summary."""
import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()


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
