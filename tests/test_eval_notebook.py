"""Notebook 03 and its pipeline profiles: every profile sets every parameter; GPU profiles never use fixtures."""
import ast
from pathlib import Path

import pytest
import yaml

# a dependency of papermill, installed by `make test`; GPU machines without it skip this module
nbformat = pytest.importorskip("nbformat", reason="nbformat (papermill's dependency) is not installed")

from twell.eval import PAPER_TASKS

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "03_downstream_eval.ipynb"
PROFILES = ROOT / "configs" / "pipeline" / "03_downstream_eval.yaml"


def _parameters() -> dict:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    return {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(cell.source).body if isinstance(n, ast.Assign)}


def _profiles() -> dict:
    return yaml.safe_load(PROFILES.read_text())["profiles"]


def test_every_profile_sets_every_parameter():
    expected = set(_parameters()) - {"profile", "reports_dir"}
    for name, params in _profiles().items():
        assert set(params) == expected, (name, set(params) ^ expected)
        assert set(params["checkpoints"]) == {"dense", "sparse"} and params["check_paths"][0] == "dense"
        assert set(params["tasks"]) <= set(PAPER_TASKS)


@pytest.mark.parametrize("profile", ["gpu-small", "gpu-full"])
def test_gpu_profiles_never_stand_in_fixtures(profile):
    params = _profiles()[profile]
    assert params["fixture_if_missing"] is False and params["fixture_data_if_missing"] is False
    assert params["limit"] is None and params["tasks"] == list(PAPER_TASKS)
    assert params["ffn_paths"]["sparse"] == "kernel" and params["check_paths"] == ["dense", "kernel"]


def test_notebook_is_thin():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert not any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for src in code for n in ast.walk(ast.parse(src)))
