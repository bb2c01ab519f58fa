"""The papermill pipeline: selection, profiles, overrides, failure reporting, and notebook 00 end to end."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml

nbformat = pytest.importorskip("nbformat", reason="nbformat (papermill's dependency) is not installed")

from test_notebook_output import reading_problems
from twell import pipeline as pl

ROOT = Path(__file__).resolve().parents[1]


# -- helpers -----------------------------------------------------------------------------------------
def _write_notebook(folder: Path, name: str, cells: list[str], params: str | None = "n = 1",
                    profiles: dict | None = None) -> Path:
    """A tiny notebook (parameters cell + code cells) and its profile YAML in ``folder``."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    if params is not None:
        p = nbformat.v4.new_code_cell(f"profile = 'cpu-smoke'\nreports_dir = None\n{params}")
        p.metadata["tags"] = ["parameters"]
        nb.cells.append(p)
    nb.cells += [nbformat.v4.new_code_cell(src) for src in cells]
    path = folder / "notebooks" / f"{name}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    cfg = folder / "configs" / f"{name}.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(yaml.safe_dump({"profiles": profiles if profiles is not None else {"cpu-smoke": {"n": 2}}}))
    return path


def _dirs(tmp: Path) -> dict:
    return {"notebooks_dir": tmp / "notebooks", "configs_dir": tmp / "configs", "reports_dir": tmp / "reports"}


def _stream_text(nb_path: Path) -> str:
    nb = nbformat.read(nb_path, as_version=4)
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


# -- pure functions ------------------------------------------------------------------------------------
def test_select_notebooks_by_number_and_name():
    assert pl.select_notebooks(None) == list(pl.NOTEBOOK_ORDER)
    assert pl.select_notebooks("02,00") == ["00_twell_format", "02_sparse_training"]  # pipeline order kept
    assert pl.select_notebooks(["03_downstream_eval", "01"]) == ["01_kernels", "03_downstream_eval"]
    with pytest.raises(pl.PipelineError, match="unknown notebook '7'"):
        pl.select_notebooks("00,7")
    with pytest.raises(pl.PipelineError, match="no notebook"):
        pl.select_notebooks(" , ")


def test_parse_overrides_types_and_errors():
    got = pl.parse_overrides(["00:M=64", "00:tiles=[64, 128]", "02:lr=3e-4", "02:name=abc", "01:flag=true"])
    assert got == {"00_twell_format": {"M": 64, "tiles": [64, 128]},
                   "02_sparse_training": {"lr": 3e-4, "name": "abc"}, "01_kernels": {"flag": True}}
    for bad in ("00M=3", "00:M", "00:=3", "99:M=3"):
        with pytest.raises(pl.PipelineError):
            pl.parse_overrides([bad])
    # Errors of the pipeline (exit 2), not tracebacks; the pipeline's own parameters are not --set.
    for bad, why in (("00,01:M=512", "one notebook per --set"), ("00:tiles=[64, 128", "not valid YAML"),
                     ("00:M=", "no value"), ("00:reports_dir=/tmp/x", "use --reports-dir"),
                     ("00:profile=gpu-full", "use --profile")):
        with pytest.raises(pl.PipelineError, match=why):
            pl.parse_overrides([bad])
    assert pl.parse_overrides(["00:M=null"]) == {"00_twell_format": {"M": None}}


def test_load_profile_errors_name_the_file(tmp_path):
    with pytest.raises(pl.PipelineError, match=r"expected .*00_twell_format\.yaml"):
        pl.load_profile(tmp_path, "00_twell_format", "cpu-smoke")
    (tmp_path / "00_twell_format.yaml").write_text("profiles:\n  cpu-smoke: {n: 2}\n")
    with pytest.raises(pl.PipelineError, match=r"'gpu-full' is not defined in .*00_twell_format\.yaml.*cpu-smoke"):
        pl.load_profile(tmp_path, "00_twell_format", "gpu-full")
    assert pl.load_profile(tmp_path, "00_twell_format", "cpu-smoke") == {"n": 2}
    (tmp_path / "03_downstream_eval.yaml").write_text("profiles:\n  cpu-smoke: {lr: 3e-4, n: [1, 2]}\n")
    assert pl.load_profile(tmp_path, "03_downstream_eval", "cpu-smoke") == {"lr": 3e-4, "n": [1, 2]}
    (tmp_path / "01_kernels.yaml").write_text("cpu-smoke: {n: 2}\n")
    with pytest.raises(pl.PipelineError, match="must hold a mapping 'profiles"):
        pl.load_profile(tmp_path, "01_kernels", "cpu-smoke")
    (tmp_path / "02_sparse_training.yaml").write_text("profiles:\n  cpu-smoke: [1, 2]\n")
    with pytest.raises(pl.PipelineError, match="must be a mapping of parameters"):
        pl.load_profile(tmp_path, "02_sparse_training", "cpu-smoke")


def test_plan_checks_everything_before_running(tmp_path):
    _write_notebook(tmp_path, "00_twell_format", ["pass"])
    d = _dirs(tmp_path)
    paths = pl.PipelinePaths.resolve(**d)
    runs = pl.plan("cpu-smoke", ["00_twell_format"], paths, {"00": {"n": 5}})
    assert runs[0].parameters == {"n": 5, "profile": "cpu-smoke", "reports_dir": str(paths.reports)}
    assert runs[0].output == paths.reports / "notebooks" / "00_twell_format.ipynb"
    with pytest.raises(pl.PipelineError, match=r"notebook 01_kernels not found: expected .*01_kernels\.ipynb"):
        pl.plan("cpu-smoke", ["00_twell_format", "01_kernels"], paths)
    with pytest.raises(pl.PipelineError, match=r"\['typo'\].*not defined in the parameters cell"):
        pl.plan("cpu-smoke", ["00_twell_format"], paths, {"00": {"typo": 1}})
    with pytest.raises(pl.PipelineError, match=r"\['reports_dir'\] cannot be overridden"):
        pl.plan("cpu-smoke", ["00_twell_format"], paths, {"00": {"reports_dir": "/elsewhere"}})
    with pytest.raises(pl.PipelineError, match="not selected"):
        pl.plan("cpu-smoke", ["00_twell_format"], paths, {"02": {"n": 1}})
    _write_notebook(tmp_path, "01_kernels", ["pass"], params=None)
    with pytest.raises(pl.PipelineError, match="no cell tagged 'parameters'"):
        pl.plan("cpu-smoke", ["01_kernels"], paths)


def test_missing_notebook_fails_before_any_kernel_starts(tmp_path):
    _write_notebook(tmp_path, "00_twell_format", ["open('ran', 'w').write('x')"])
    with pytest.raises(pl.PipelineError, match="notebook 02_sparse_training not found"):
        pl.run_pipeline(only="00,02", progress=False, **_dirs(tmp_path))
    assert not (tmp_path / "notebooks" / "ran").exists()


def test_env_variables_redirect_directories(tmp_path, monkeypatch):
    monkeypatch.setenv("TWELL_NOTEBOOKS", str(tmp_path / "nb"))
    monkeypatch.setenv("TWELL_PIPELINE_CONFIGS", str(tmp_path / "cfg"))
    monkeypatch.setenv("TWELL_REPORTS", str(tmp_path / "rep"))
    p = pl.PipelinePaths.resolve()
    assert (p.notebooks, p.configs, p.reports) == ((tmp_path / "nb").resolve(), (tmp_path / "cfg").resolve(),
                                                   (tmp_path / "rep").resolve())
    assert pl.PipelinePaths.resolve(notebooks_dir=tmp_path / "x").notebooks == (tmp_path / "x").resolve()


def test_smoke_profile_writes_beside_the_committed_reports(monkeypatch, tmp_path):
    monkeypatch.delenv("TWELL_REPORTS", raising=False)
    root = pl.repo_root() / "reports"
    assert pl.PipelinePaths.resolve(profile="cpu-smoke").reports == (root / "smoke").resolve()
    assert pl.PipelinePaths.resolve(profile="gpu-small").reports == root.resolve()
    assert pl.PipelinePaths.resolve(profile="cpu-smoke", reports_dir=tmp_path).reports == tmp_path.resolve()
    monkeypatch.setenv("TWELL_REPORTS", str(tmp_path / "rep"))
    assert pl.PipelinePaths.resolve(profile="cpu-smoke").reports == (tmp_path / "rep").resolve()


def test_empty_reports_variable_means_unset_everywhere(monkeypatch, tmp_path):
    """TWELL_REPORTS="" falls back to reports/ for both helpers (not to the working directory)."""
    from twell import paths

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TWELL_REPORTS", "")
    root = paths.repo_root() / "reports"
    assert paths.reports_dir("bench", create=False) == root / "bench"
    assert paths.reports_root() == root
    monkeypatch.setenv("TWELL_REPORTS", str(tmp_path / "rep"))
    assert paths.reports_dir("bench", create=False) == tmp_path / "rep" / "bench"
    assert paths.reports_root() == tmp_path / "rep"


def test_console_script_points_at_main():
    eps = [ep for ep in entry_points(group="console_scripts") if ep.name == "twell-pipeline"]
    assert eps and eps[0].value == "twell.pipeline:main"


def test_list_shows_presence_and_profiles(tmp_path, capsys):
    _write_notebook(tmp_path, "00_twell_format", ["pass"], profiles={"cpu-smoke": {"n": 1}, "gpu-small": {"n": 2}})
    d = _dirs(tmp_path)
    assert pl.main(["--list", "--notebooks-dir", str(d["notebooks_dir"]), "--configs-dir", str(d["configs_dir"])]) == 0
    out = capsys.readouterr().out
    assert "00_twell_format" in out and "present" in out and "cpu-smoke, gpu-small" in out
    assert "01_kernels" in out and "MISSING" in out


# -- the repository's own notebooks and profiles -----------------------------------------------------
def _literal_defaults(nb_path: Path) -> dict:
    nb = nbformat.read(nb_path, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    out = {}
    for node in ast.parse(cell.source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass  # an expression default: not comparable to YAML
    return out


@pytest.mark.parametrize("name", [n for n in pl.NOTEBOOK_ORDER if (ROOT / "notebooks" / f"{n}.ipynb").is_file()])
def test_cpu_smoke_profile_equals_notebook_defaults(name):
    """Running a notebook alone with its defaults must be the cpu-smoke run."""
    profile = pl.load_profile(ROOT / "configs" / "pipeline", name, "cpu-smoke")
    defaults = _literal_defaults(ROOT / "notebooks" / f"{name}.ipynb")
    differ = {k: (v, defaults.get(k, "<not a literal>")) for k, v in profile.items() if defaults.get(k) != v}
    assert not differ, f"{name}: cpu-smoke (yaml) vs parameters cell: {differ}"
    assert defaults.get("profile") == "cpu-smoke" and "reports_dir" in defaults



def test_cpu_smoke_evaluates_what_notebook_02_trains():
    """03's smoke checkpoints are 02's smoke runs (both of them: a missing one would become a FIXTURE), and
    02 trains apart from runs/<config>, the CLI's default, which its overwrite would otherwise delete."""
    from twell.train.study import NOTEBOOK_RUNS

    train = pl.load_profile(ROOT / "configs" / "pipeline", "02_sparse_training", "cpu-smoke")
    ev = pl.load_profile(ROOT / "configs" / "pipeline", "03_downstream_eval", "cpu-smoke")
    runs = NOTEBOOK_RUNS.relative_to(ROOT).as_posix()
    assert train["train"] and train["dense_twin"] and runs != "runs"
    assert ev["checkpoints"] == {"sparse": f"{runs}/{train['config']}/final",
                                 "dense": f"{runs}/{train['config']}_dense_twin/final"}

# -- executing notebooks -----------------------------------------------------------------------------
def test_failing_notebook_stops_pipeline_and_names_the_cell(tmp_path):
    _write_notebook(tmp_path, "00_twell_format", ["import sys\nprint('EXE', sys.executable, n, profile)"])
    _write_notebook(tmp_path, "01_kernels", ["x = n + 1", "raise ValueError(f'boom {x}')", "print('after')"])
    _write_notebook(tmp_path, "02_sparse_training", ["open('ran', 'w').write('x')"])
    d = _dirs(tmp_path)
    with pytest.raises(pl.NotebookFailedError) as info:
        pl.run_pipeline(only=["00", "01", "02"], progress=False, **d)
    msg = str(info.value)
    assert "01_kernels" in msg and "In [4]" in msg and "raise ValueError" in msg and "ValueError: boom 3" in msg
    statuses = [(r.notebook, r.status) for r in info.value.results]
    assert statuses == [("00_twell_format", "ok"), ("01_kernels", "failed"), ("02_sparse_training", "not run")]
    assert info.value.results[1].failed_cell == 4
    assert not (tmp_path / "notebooks" / "ran").exists()
    # The kernel is this interpreter and got the profile's parameters.
    text = _stream_text(d["reports_dir"] / "notebooks" / "00_twell_format.ipynb")
    assert f"EXE {sys.executable} 2 cpu-smoke" in text
    assert (d["reports_dir"] / "notebooks" / "01_kernels.ipynb").is_file()
    record = json.loads((d["reports_dir"] / "notebooks" / "pipeline_run.json").read_text())
    assert [r["status"] for r in record["results"]] == ["ok", "failed", "not run"]


def test_cli_exits_nonzero_naming_notebook_and_cell(tmp_path):
    _write_notebook(tmp_path, "01_kernels", ["y = 1", "1 / 0"])
    d = _dirs(tmp_path)
    cmd = [sys.executable, "-m", "twell.pipeline", "--only", "01", "--no-progress",
           "--notebooks-dir", str(d["notebooks_dir"]), "--configs-dir", str(d["configs_dir"]),
           "--reports-dir", str(d["reports_dir"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "FAILED: notebook 01_kernels failed in cell In [4]" in proc.stderr
    assert "ZeroDivisionError" in proc.stderr and "failed" in proc.stderr



def test_main_bad_input_exits_2(tmp_path, capsys):
    _write_notebook(tmp_path, "01_kernels", ["pass"])
    d = _dirs(tmp_path)
    args = ["--notebooks-dir", str(d["notebooks_dir"]), "--configs-dir", str(d["configs_dir"]), "--no-progress"]
    assert pl.main(["--only", "01", "--profile", "gpu-full", *args]) == 2
    assert "'gpu-full' is not defined in" in capsys.readouterr().err
    assert pl.main(["--only", "00", *args]) == 2
    assert "notebook 00_twell_format not found" in capsys.readouterr().err
    assert pl.main(["--only", "01", "--set", "01:bad", *args]) == 2
    assert "expected NOTEBOOK:KEY=VALUE" in capsys.readouterr().err


def test_override_reaches_notebook(tmp_path):
    _write_notebook(tmp_path, "00_twell_format", ["print('VALUE', n * 10)"])
    results = pl.run_pipeline(only="00", overrides=pl.parse_overrides(["00:n=7"]), progress=False, **_dirs(tmp_path))
    assert [(r.notebook, r.status) for r in results] == [("00_twell_format", "ok")]
    assert "VALUE 70" in _stream_text(results[0].output)
    assert results[0].parameters["n"] == 7


def test_inline_figures_are_stored_at_the_pipeline_dpi(tmp_path):
    """Executed notebooks keep their inline figures at INLINE_FIGURE_DPI (the saved files keep their own)."""
    import base64
    import struct

    _write_notebook(tmp_path, "00_twell_format", [
        "import matplotlib.pyplot as plt\nfig, ax = plt.subplots(figsize=(4, 2))\nax.plot([0, 1])\nplt.show()"])
    results = pl.run_pipeline(only="00", progress=False, **_dirs(tmp_path))
    nb = nbformat.read(results[0].output, as_version=4)
    png = next(base64.b64decode(o["data"]["image/png"]) for c in nb.cells if c.cell_type == "code"
               for o in c.get("outputs", []) if "image/png" in o.get("data", {}))
    width = struct.unpack(">I", png[16:20])[0]  # the IHDR chunk's width
    assert 0.8 * 4 * pl.INLINE_FIGURE_DPI < width <= 4 * pl.INLINE_FIGURE_DPI + 20, width


@pytest.mark.slow
def test_notebook_00_cpu_smoke_writes_reports(tmp_path):
    start = time.time() - 1
    reports = tmp_path / "reports"
    env_before = (os.environ.get("TWELL_REPORTS"), os.environ.get("JUPYTER_PATH"))
    t0 = time.perf_counter()
    results = pl.run_pipeline("cpu-smoke", only="00", reports_dir=reports, progress=False)
    elapsed = time.perf_counter() - t0
    assert [(r.notebook, r.status) for r in results] == [("00_twell_format", "ok")]
    executed = reports / "notebooks" / "00_twell_format.ipynb"
    nb = nbformat.read(executed, as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert reading_problems(nb) == []
    assert nb.metadata["papermill"]["parameters"]["profile"] == "cpu-smoke"
    expected = [reports / "figures" / f"00_{n}.png" for n in ("tile_packing", "memory_footprint", "overflow_rate")]
    for stem in ("word_layout_row3_tile0", "calibrated_cases", "memory_footprint", "overflow_rate"):
        expected += [reports / "tables" / f"00_{stem}.csv", reports / "tables" / f"00_{stem}.md"]
    for path in expected:
        assert path.is_file(), f"missing {path}"
        assert path.stat().st_size > 100 and path.stat().st_mtime >= start, f"{path} empty or stale"
    for png in expected[:3]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The run sets TWELL_REPORTS / JUPYTER_PATH only while it runs.
    assert (os.environ.get("TWELL_REPORTS"), os.environ.get("JUPYTER_PATH")) == env_before
    assert elapsed < 120, f"notebook 00 cpu-smoke took {elapsed:.0f} s"


_LATER = ["01_kernels", "02_sparse_training", "03_downstream_eval", "04_efficiency"]
_MISSING = [n for n in _LATER if not (ROOT / "notebooks" / f"{n}.ipynb").is_file()
            or not (ROOT / "configs" / "pipeline" / f"{n}.yaml").is_file()]


@pytest.mark.slow
@pytest.mark.skipif(bool(_MISSING), reason=f"notebook or profile not written yet: {', '.join(_MISSING)}")
def test_rest_of_pipeline_cpu_smoke(tmp_path):
    """CI runs the whole pipeline in its smallest profile: 01-04 here, 00 in the test above."""
    results = pl.run_pipeline("cpu-smoke", only="01,02,03,04", reports_dir=tmp_path / "reports", progress=False)
    assert [(r.notebook, r.status) for r in results] == [(n, "ok") for n in _LATER]
    for r in results:
        assert r.output.is_file()
        assert reading_problems(nbformat.read(r.output, as_version=4)) == [], r.notebook


def test_environ_set_restores_after_an_error(monkeypatch):
    from twell.paths import environ_set

    monkeypatch.setenv("TWELL_TEST_A", "a")
    monkeypatch.delenv("TWELL_TEST_B", raising=False)
    with pytest.raises(RuntimeError):
        with environ_set({"TWELL_TEST_A": None, "TWELL_TEST_B": "b"}):
            assert "TWELL_TEST_A" not in os.environ and os.environ["TWELL_TEST_B"] == "b"
            raise RuntimeError("inside")
    assert os.environ["TWELL_TEST_A"] == "a" and "TWELL_TEST_B" not in os.environ


@pytest.mark.gpu
@pytest.mark.slow
def test_notebook_01_on_a_gpu_builds_verifies_and_benchmarks_the_kernels(tmp_path):
    """Notebook 01's GPU branch, end to end through papermill: gpu-small with smaller shapes."""
    import pandas as pd

    from twell import kernels

    ok, why = kernels.available(build=False)
    assert ok, f"kernels unavailable on this GPU machine: {why}"
    reports = tmp_path / "reports"
    small = {"verify_shapes": [[777, 320, 1000, 8, 0.1]], "heavy_rows": 4, "Ms": [2048],
             "cases": ["nnz8", "nnz29-heavy"], "reps": 5}
    results = pl.run_pipeline("gpu-small", only="01", overrides={"01": small}, reports_dir=reports,
                              progress=False)
    assert [(r.notebook, r.status) for r in results] == [("01_kernels", "ok")]
    text = _stream_text(results[0].output)
    assert "ready in" in text and "NO BENCHMARK DATA" not in text
    checks = pd.read_csv(reports / "tables" / "01_kernel_verification.csv")
    # The kernels ran (compared with the reference) and passed on both row groups of every op.
    assert set(checks["op"]) == {"gate -> TwELL", "fused gated up/down", "non-gated down"}
    assert checks["ok"].eq("yes").all() and checks["vs reference"].notna().all()
    # This run's benchmark: written under the run's reports, shown as measured in this run, correct.
    (bench_json,) = (reports / "bench").glob("ffn-*.json")
    result = json.loads(bench_json.read_text())
    assert not result["failures"]
    speed = pd.read_csv(reports / "tables" / "01_kernel_speedup.csv")
    assert set(speed["M"]) == {2048, 12345} and speed["in this run"].eq("yes").all()
    assert speed["correct"].eq("yes").all() and (speed["speedup"] > 0).all()
    assert (reports / "figures" / "01_kernel_speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the command line on bad input ----------------------------------------------------------------------------
def test_list_shows_only_the_selected_notebooks(tmp_path, capsys):
    _write_notebook(tmp_path, "01_kernels", ["pass"])
    d = _dirs(tmp_path)
    args = ["--notebooks-dir", str(d["notebooks_dir"]), "--configs-dir", str(d["configs_dir"])]
    assert pl.main(["--list", "--only", "01", *args]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("01_kernels") and "present" in lines[0]
    assert pl.main(["--list", "--only", "07", *args]) == 2
    assert capsys.readouterr().err.startswith("python -m twell.pipeline: error: unknown notebook '07'")


def test_unknown_kernel_is_refused_before_any_notebook_runs(tmp_path, capsys):
    _write_notebook(tmp_path, "00_twell_format", ["open('ran', 'w').write('x')"])
    d = _dirs(tmp_path)
    assert pl.main(["--only", "00", "--kernel", "no-such-kernel-here", "--no-progress",
                    *[a for k, v in d.items() for a in (f"--{k.replace('_', '-')}", str(v))]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m twell.pipeline: error: no Jupyter kernel named 'no-such-kernel-here'")
    assert "leave --kernel out" in err
    assert not (d["reports_dir"] / "notebooks" / "pipeline_run.json").exists()
    assert not (tmp_path / "notebooks" / "ran").exists()


def test_cell_timeout_must_be_positive(capsys):
    with pytest.raises(SystemExit) as info:
        pl.main(["--cell-timeout", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "python -m twell.pipeline: error: argument --cell-timeout: expected a positive number" in err


def test_an_override_of_the_wrong_kind_is_refused_before_running(tmp_path):
    _write_notebook(tmp_path, "00_twell_format", ["open('ran', 'w').write('x')"],
                    params="n = 1\nflag = True\nname = 'a'",
                    profiles={"cpu-smoke": {"n": 2, "flag": True, "name": "a"}})
    d = _dirs(tmp_path)
    for item, kind in (("00:n=abc", "is a str, but profile 'cpu-smoke' sets n to a number (2)"),
                       ("00:flag=3", "is a number, but profile 'cpu-smoke' sets flag to true/false")):
        with pytest.raises(pl.PipelineError, match=kind.replace("(", r"\(").replace(")", r"\)")):
            pl.run_pipeline(only="00", overrides=pl.parse_overrides([item]), progress=False, **d)
    assert not (tmp_path / "notebooks" / "ran").exists()
    # a number for a number, and any value for text or where the profile has none, are the notebook's to judge
    runs = pl.plan("cpu-smoke", ["00_twell_format"], pl.PipelinePaths.resolve(**d),
                   pl.parse_overrides(["00:n=2.5", "00:name=7", "00:flag=false"]))
    assert {k: runs[0].parameters[k] for k in ("n", "name", "flag")} == {"n": 2.5, "name": 7, "flag": False}
