"""Executed notebooks read cleanly: few stderr outputs, and no progress bar printed as lines of text.

What is checked: the executed copies under reports/notebooks/ that a CPU profile made (the pipeline
regenerates those here; the others come from GPU runs), a tiny notebook executed by the pipeline
(whose kernels run with the progress bars off), and the evaluation harness, which must run lm-eval
on one bar of its own with lm-eval's bars, INFO logging and expected warnings out of sight. The
cpu-smoke runs of tests/test_pipeline.py apply :func:`reading_problems` to every notebook they execute.
"""
from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat (papermill's dependency) is not installed")

ROOT = Path(__file__).resolve().parents[1]
CPU_PROFILES = ("cpu-smoke",)
# Warnings a reader can act on (the project's own, FIXTURE notes) stay: a few per notebook at most
# (notebook 03 on cpu-smoke has 4: the FIXTURE data and the requests cut to the tiny model's context).
MAX_STDERR_OUTPUTS = 5
# tqdm's text bar: redrawn with a carriage return, moved with ANSI cursor codes, "|  6/6 [00:06<00:00".
_TEXT_BAR = re.compile(r"\r(?!\n)|\x1b\[\d*[A-Za-z]|\| *\d+/\d+ \[")
_WIDGET = "application/vnd.jupyter.widget-view+json"


def _text(output) -> str:
    text = output.get("text", "")
    return "".join(text) if isinstance(text, list) else text


def reading_problems(nb) -> list[str]:
    """What makes an executed notebook (nbformat node or JSON dict) read badly; empty when it reads cleanly."""
    streams = [(i, o) for i, cell in enumerate(nb["cells"]) for o in cell.get("outputs", [])
               if o.get("output_type") == "stream"]
    problems = []
    stderr = [(i, _text(o)) for i, o in streams if o.get("name") == "stderr"]
    if len(stderr) > MAX_STDERR_OUTPUTS:
        firsts = "; ".join(f"cell {i}: {(t.strip().splitlines() or [''])[0][:80]!r}" for i, t in stderr[:5])
        problems.append(f"{len(stderr)} stderr outputs (at most {MAX_STDERR_OUTPUTS}), first: {firsts}")
    bars = [(i, t) for i, t in ((i, _text(o)) for i, o in streams) if _TEXT_BAR.search(t)]
    if bars:
        i, t = bars[0]
        problems.append(f"{len(bars)} stream outputs hold a text progress bar, first in cell {i}: {t.strip()[:80]!r}")
    return problems


def widget_outputs(nb) -> list[str]:
    """The text of every widget (e.g. a tqdm.auto bar) shown in the notebook's outputs."""
    return [_text({"text": o["data"].get("text/plain", "")}) for cell in nb["cells"] for o in cell.get("outputs", [])
            if o.get("output_type") == "display_data" and _WIDGET in o.get("data", {})]


def test_reading_problems_spots_text_bars_and_many_stderr_outputs():
    def nb(*outputs):
        return {"cells": [{"cell_type": "code", "outputs": list(outputs)}]}

    def err(text):
        return {"output_type": "stream", "name": "stderr", "text": text}

    assert reading_problems(nb(err("UserWarning: no local data: using FIXTURE task files\n"))) == []
    assert reading_problems(nb(*[err(f"warning {i}\n") for i in range(MAX_STDERR_OUTPUTS + 1)]))
    bar = reading_problems(nb(err("\rverify:  50%|#####     | 1/2 [00:01<00:01,  1.33s/shape]")))
    assert len(bar) == 1 and "cell 0" in bar[0]
    assert reading_problems(nb(err("\n\x1b[A")))  # a nested bar moving the cursor


_COMMITTED = sorted((ROOT / "reports" / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", _COMMITTED, ids=[p.stem for p in _COMMITTED])
def test_committed_notebooks_read_cleanly(path):
    """Every committed executed notebook, whichever profile made it: reading one needs no GPU."""
    nb = json.loads(path.read_text())
    assert reading_problems(nb) == []
    assert widget_outputs(nb) == []  # the pipeline's kernels draw no bars


_ALL_NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + _COMMITTED
# The kernel the environment installs (ipykernel's own spec): a notebook naming another display name is
# rewritten, and so marked modified, by JupyterLab the moment it opens.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
_ABSOLUTE = re.compile(r"(?<![\w.])/(?:work|root|home|tmp|Users|mnt|opt)/")


@pytest.mark.parametrize("path", _ALL_NOTEBOOKS, ids=[str(p.relative_to(ROOT)) for p in _ALL_NOTEBOOKS])
def test_committed_notebooks_name_the_environment_kernel_and_no_absolute_path(path):
    """The kernelspec is the environment's; no absolute path in a source notebook, nor in what the pipeline
    writes into an executed one (its parameters and papermill metadata)."""
    nb = json.loads(path.read_text())
    assert nb["metadata"].get("kernelspec") == KERNELSPEC
    source = path.parent == ROOT / "notebooks"
    written = [json.dumps(nb["metadata"])] + [
        "".join(c["source"]) for c in nb["cells"]
        if source or "injected-parameters" in c.get("metadata", {}).get("tags", [])]
    hits = [t[:100] for t in written if _ABSOLUTE.search(t)]
    assert not hits, f"absolute paths in {path.relative_to(ROOT)}: {hits[:3]}"


def test_pipeline_writes_no_absolute_path(tmp_path, monkeypatch):
    from twell import pipeline as pl

    monkeypatch.setattr(pl, "repo_root", lambda: tmp_path)
    _tiny_notebook(tmp_path, ["from pathlib import Path\nassert Path(reports_dir).is_absolute()"])
    results = pl.run_pipeline(only="00", progress=False, notebooks_dir=tmp_path / "notebooks",
                              configs_dir=tmp_path / "configs", reports_dir=tmp_path / "reports")
    text = results[0].output.read_text()  # it ran with the absolute path; the stored copy names none
    assert str(tmp_path) not in text, [l for l in text.splitlines() if str(tmp_path) in l][:3]
    assert 'reports_dir = \\"../reports\\"' in text


def test_kernelspec_is_the_installed_one():
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    assert {"display_name": spec.display_name, "language": spec.language, "name": "python3"} == KERNELSPEC


def _tiny_notebook(folder: Path, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell("profile = 'cpu-smoke'\nreports_dir = None")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params] + [nbformat.v4.new_code_cell(src) for src in cells]
    (folder / "notebooks").mkdir(parents=True)
    nbformat.write(nb, folder / "notebooks" / "00_twell_format.ipynb")
    (folder / "configs").mkdir()
    (folder / "configs" / "00_twell_format.yaml").write_text("profiles:\n  cpu-smoke: {}\n")


def test_pipeline_kernels_draw_no_bars_and_keep_warnings(tmp_path):
    """tqdm's text bar, the project's tqdm.auto bar and a datasets bar stay out of the executed notebook;
    a warning that names its fix stays in it."""
    from twell import pipeline as pl

    _tiny_notebook(tmp_path, [
        "from tqdm import tqdm\nfor _ in tqdm(range(200), desc='text bar', mininterval=0):\n    pass",
        "from twell.progress import progress_bar\nfor _ in progress_bar(range(200), desc='project bar', mininterval=0):\n"
        "    pass",
        "from datasets.utils.tqdm import tqdm as datasets_tqdm\nfor _ in datasets_tqdm(range(50), desc='datasets bar'):\n"
        "    pass",
        "import warnings\nwarnings.warn('M = 256 is small: pass --set 00:M=8192 for stable numbers')",
    ])
    results = pl.run_pipeline(only="00", progress=False, notebooks_dir=tmp_path / "notebooks",
                              configs_dir=tmp_path / "configs", reports_dir=tmp_path / "reports")
    nb = nbformat.read(results[0].output, as_version=4)
    assert reading_problems(nb) == []
    assert widget_outputs(nb) == []
    stderr = [_text(o) for c in nb.cells for o in c.get("outputs", []) if o.get("name") == "stderr"]
    assert len(stderr) == 1 and "UserWarning: M = 256 is small: pass --set 00:M=8192" in stderr[0]


def test_harness_runs_lm_eval_on_one_bar_quietly(tmp_path, capfd, caplog):
    """evaluate_model: its bar counts every lm-eval request; lm-eval's bars, its INFO lines (even with
    lm_eval's logger at INFO) and its warnings about a model object are not shown; all is restored after."""
    import datasets.utils
    import lm_eval.api.task
    import torch
    from tqdm import tqdm

    from twell.eval.fixtures import build_fixture_model, write_fixture_task_data
    from twell.eval.harness import evaluate_model, quiet_lm_eval

    model, tok = build_fixture_model(seed=0, dtype=torch.float32)
    data = write_fixture_task_data(tmp_path / "data", n_docs=4, seed=0)
    bar = tqdm(file=io.StringIO(), mininterval=0)
    datasets_bars_before = datasets.utils.are_progress_bars_disabled()
    with caplog.at_level(logging.INFO, logger="lm_eval"):
        run = evaluate_model(model, tok, tasks=["piqa", "commonsense_qa"], data_dir=data, offline=True, limit=4,
                             progress=bar)
        assert logging.getLogger("lm_eval").level == logging.INFO  # restored
    assert {t.status for t in run.tasks.values()} == {"ok"}
    assert bar.total == bar.n == 4 * 2 + 4 * 5  # piqa: 2 choices, commonsense_qa: 5, per document
    captured = capfd.readouterr()
    assert not _TEXT_BAR.search(captured.err + captured.out), captured.err[-500:]
    assert "pretrained" not in captured.err
    lm_eval_lines = [r for r in caplog.records if r.name.startswith(("lm_eval", "datasets", "transformers"))]
    assert not lm_eval_lines, [r.getMessage()[:80] for r in lm_eval_lines]
    assert lm_eval.api.task.tqdm is tqdm
    assert datasets.utils.are_progress_bars_disabled() == datasets_bars_before

    # One note for the requests lm-eval cuts to the model's context; other lm-eval warnings are kept.
    caplog.clear()
    hf = logging.getLogger("lm_eval.models.huggingface")
    with quiet_lm_eval() as log:
        for _ in range(3):
            hf.warning("Combined length of context (33) and continuation (101) exceeds model's maximum length (128). "
                       "Truncating 7 tokens from the left.")
        hf.warning("something a reader should see")
    assert [r.getMessage() for r in caplog.records] == ["something a reader should see"]
    assert log.truncation_note(70).startswith("3 of 70 lm-eval requests were longer than the model's context of 128")


def test_nbconvert_execute_stores_the_bar_as_a_widget_without_a_frozen_text_copy(tmp_path, monkeypatch):
    """``jupyter nbconvert --execute`` (no pipeline, bars on): the project's bar is stored as a widget whose
    state the notebook keeps, and with no text copy of the bar as it was when first drawn."""
    import subprocess
    import sys

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.cells = [nbformat.v4.new_code_cell(
        "from twell.progress import progress_bar\nfor _ in progress_bar(range(6), desc='calibrated cases'):\n"
        "    pass\nprint('done')")]
    path = tmp_path / "bar.ipynb"
    nbformat.write(nb, path)
    subprocess.run([sys.executable, "-m", "nbconvert", "--to", "notebook", "--execute", "--inplace", str(path)],
                   check=True, capture_output=True, timeout=300)
    out = nbformat.read(path, as_version=4)
    outputs = out.cells[0].outputs
    widgets = [o for o in outputs if _WIDGET in o.get("data", {})]
    assert len(widgets) == 1, outputs
    assert widget_outputs(out) == [""]
    state = out.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    assert widgets[0]["data"][_WIDGET]["model_id"] in state
    assert reading_problems(out) == []
    assert not [o for o in outputs if "calibrated cases" in json.dumps(o)]
    assert [_text(o) for o in outputs if o.get("output_type") == "stream"] == ["done\n"]


# What the kernel reports on connecting; JupyterLab writes it into a notebook's metadata and marks the
# notebook modified when it differs (the version: the lock's Python, requirements/cpu-py311.lock).
LANGUAGE_INFO_KEYS = {"codemirror_mode", "file_extension", "mimetype", "name", "nbconvert_exporter",
                      "pygments_lexer", "version"}


@pytest.mark.parametrize("path", _ALL_NOTEBOOKS, ids=[str(p.relative_to(ROOT)) for p in _ALL_NOTEBOOKS])
def test_notebooks_carry_the_kernels_language_info(path):
    """A source notebook with a partial language_info is completed, and so marked modified, on opening."""
    info = json.loads(path.read_text())["metadata"].get("language_info", {})
    assert set(info) == LANGUAGE_INFO_KEYS, f"{path.relative_to(ROOT)}: language_info {info}"
    assert info["version"].startswith("3.11."), info
