"""Shared pytest set-up: the `gpu` marker skips without CUDA and is counted in the summary."""
import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()


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
