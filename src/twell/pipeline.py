"""Run the project's notebooks in order with papermill under a named profile.

``python -m twell.pipeline`` (also ``twell-pipeline`` and ``make run``) executes

    00_twell_format -> 01_kernels -> 02_sparse_training -> 03_downstream_eval -> 04_efficiency

from ``notebooks/<name>.ipynb``. Each notebook's parameters come from
``configs/pipeline/<name>.yaml``::

    profiles:
      cpu-smoke: {M: 256, ...}     # default; also the parameters cell's own defaults
      gpu-small: {...}
      gpu-full:  {...}

plus the common parameters ``profile`` (the profile name) and ``reports_dir`` (output root:
``reports/`` for gpu-small and gpu-full, ``reports/smoke/`` for cpu-smoke, so that the default run
never replaces the committed results). Executed notebooks go to ``<reports>/notebooks/<name>.ipynb``
(overwritten by the next run, like the figures and tables they write; the profile is recorded in the
notebook's papermill metadata and in ``<reports>/notebooks/pipeline_run.json``). The run stops at the
first failing notebook and exits non-zero naming the notebook and the failing cell. The kernels run
with ``KERNEL_QUIET_ENV`` set, which turns off the progress bars that read it (tqdm's text bars, the
project's bars of ``twell.progress``, those of datasets and transformers), so that the executed
notebooks do not fill with them; the terminal shows the pipeline's and papermill's bars
(``--no-progress`` hides them).

Directories can be redirected (tests do this) with arguments/flags or environment variables:
``TWELL_NOTEBOOKS`` (notebooks), ``TWELL_PIPELINE_CONFIGS`` (profile YAMLs), ``TWELL_REPORTS`` (outputs).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import yaml

from twell.cli import positive_float, report
from twell.paths import SMOKE_PROFILE, environ_set, repo_root, reports_root
from twell.reports.save import NOTEBOOK_DIR_VARIABLE

PROG = "python -m twell.pipeline"

NOTEBOOK_ORDER: tuple[str, ...] = (
    "00_twell_format",
    "01_kernels",
    "02_sparse_training",
    "03_downstream_eval",
    "04_efficiency",
)
DEFAULT_PROFILE = SMOKE_PROFILE
KNOWN_PROFILES: tuple[str, ...] = ("cpu-smoke", "gpu-small", "gpu-full")
# Set for the kernels: progress bars off in the executed notebooks (tqdm's text bars, the project's bars of
# twell.progress, those of datasets, and of huggingface_hub and transformers). Papermill's own bar, per
# cell, runs on the terminal.
KERNEL_QUIET_ENV: dict[str, str] = {
    "TQDM_DISABLE": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}
# Resolution of the figures an executed notebook stores inline (matplotlib's default is 100). They repeat
# the files that save_figure writes at 150 dpi; at 100 one executed notebook passed 2 MB.
INLINE_FIGURE_DPI = 72
# Parameters every notebook receives besides its profile's own.
COMMON_PARAMETERS: tuple[str, ...] = ("profile", "reports_dir")


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``3e-4`` as a float (YAML 1.1 wants ``3.0e-4``; a string would slip through)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


class PipelineError(RuntimeError):
    """Bad pipeline input: unknown notebook, missing file or profile, bad override."""


class NotebookFailedError(PipelineError):
    """A notebook raised in one of its cells; ``results`` holds every notebook's outcome."""

    def __init__(self, message: str, results: list["NotebookResult"]):
        super().__init__(message)
        self.results = results


@dataclasses.dataclass
class NotebookResult:
    """Outcome of one notebook: status is "ok", "failed" or "not run"."""

    notebook: str
    status: str
    seconds: float
    output: Path | None
    parameters: dict[str, Any]
    error: str | None = None
    failed_cell: int | None = None  # execution count ("In [n]") of the failing cell

    def as_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["output"] = str(self.output) if self.output else None
        return d


@dataclasses.dataclass
class PipelinePaths:
    """Where notebooks, profile YAMLs and outputs live (arguments > env > repository defaults)."""

    notebooks: Path
    configs: Path
    reports: Path

    @classmethod
    def resolve(cls, notebooks_dir=None, configs_dir=None, reports_dir=None, profile=None) -> "PipelinePaths":
        """``profile`` picks the default output root: the smoke profile writes to ``reports/smoke``
        (git-ignored) so that ``make run`` never overwrites the committed results of the full profiles."""
        root = repo_root()

        def pick(arg, env, default):
            value = arg if arg is not None else os.environ.get(env) or default
            return Path(value).expanduser().resolve()

        return cls(
            notebooks=pick(notebooks_dir, "TWELL_NOTEBOOKS", root / "notebooks"),
            configs=pick(configs_dir, "TWELL_PIPELINE_CONFIGS", root / "configs" / "pipeline"),
            reports=pick(reports_dir, "TWELL_REPORTS", reports_root(profile)),
        )


def select_notebooks(only: str | Sequence[str] | None) -> list[str]:
    """Notebook names in pipeline order; ``only`` holds names or number prefixes ("00", "02")."""
    if only is None:
        return list(NOTEBOOK_ORDER)
    tokens = [t.strip() for t in (only.split(",") if isinstance(only, str) else only) if t.strip()]
    if not tokens:
        raise PipelineError("--only got no notebook; expected e.g. '00,02' or '00_twell_format'")
    chosen = set()
    for tok in tokens:
        hits = [n for n in NOTEBOOK_ORDER if n == tok or n.split("_", 1)[0] == tok]
        if not hits:
            raise PipelineError(f"unknown notebook {tok!r}; expected one of {', '.join(NOTEBOOK_ORDER)} or their numbers")
        chosen.update(hits)
    return [n for n in NOTEBOOK_ORDER if n in chosen]


def parse_overrides(items: Sequence[str] | None) -> dict[str, dict[str, Any]]:
    """``["00:M=512", "02:lr=3e-4"]`` -> ``{"00_twell_format": {"M": 512}, ...}`` (values parsed as YAML)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items or ():
        nb, sep, rest = item.partition(":")
        key, eq, raw = rest.partition("=")
        if not sep or not eq or not key.strip():
            raise PipelineError(f"bad --set {item!r}; expected NOTEBOOK:KEY=VALUE, e.g. 00:M=512")
        names = select_notebooks(nb)
        if len(names) != 1:
            raise PipelineError(f"bad --set {item!r}: one notebook per --set (got {', '.join(names)})")
        if key.strip() in COMMON_PARAMETERS:
            raise PipelineError(f"bad --set {item!r}: {key.strip()!r} is set by the pipeline; use "
                                f"--{key.strip().replace('_', '-')} instead")
        if not raw.strip():
            raise PipelineError(f"bad --set {item!r}: no value (write null for None)")
        try:
            value = _yaml(raw)
        except yaml.YAMLError as exc:
            raise PipelineError(f"bad --set {item!r}: the value is not valid YAML ({str(exc).splitlines()[0]})") from None
        out.setdefault(names[0], {})[key.strip()] = value
    return out


def load_profile(configs_dir: Path, notebook: str, profile: str) -> dict[str, Any]:
    """The parameters of ``profile`` in ``<configs_dir>/<notebook>.yaml`` (errors name the file)."""
    path = configs_dir / f"{notebook}.yaml"
    if not path.is_file():
        raise PipelineError(f"no profile file for notebook {notebook}: expected {path}")
    try:
        data = _yaml(path.read_text())
    except yaml.YAMLError as exc:
        raise PipelineError(f"{path} is not valid YAML: {exc}") from exc
    profiles = data.get("profiles") if isinstance(data, dict) else None
    if not isinstance(profiles, dict):
        raise PipelineError(f"{path} must hold a mapping 'profiles: {{{DEFAULT_PROFILE}: {{...}}, ...}}'")
    if profile not in profiles:
        raise PipelineError(
            f"profile {profile!r} is not defined in {path} (it defines: {', '.join(map(str, profiles)) or 'none'})"
        )
    params = profiles[profile] or {}
    if not isinstance(params, dict):
        raise PipelineError(f"profile {profile!r} in {path} must be a mapping of parameters, got {type(params).__name__}")
    return dict(params)


def notebook_parameters(path: Path) -> set[str]:
    """Names defined in the notebook's cell tagged ``parameters`` (error if there is none)."""
    import nbformat
    import papermill

    nb = nbformat.read(path, as_version=4)
    if not any("parameters" in c.get("metadata", {}).get("tags", []) for c in nb.cells):
        raise PipelineError(f"{path} has no cell tagged 'parameters'; papermill needs one to inject the profile")
    return set(papermill.inspect_notebook(str(path)))


@dataclasses.dataclass
class PlannedRun:
    notebook: str
    source: Path
    output: Path
    parameters: dict[str, Any]


def plan(
    profile: str,
    notebooks: Sequence[str],
    paths: PipelinePaths,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[PlannedRun]:
    """Check every selected notebook, profile and override before anything runs."""
    overrides = {select_notebooks(k)[0]: dict(v) for k, v in (overrides or {}).items()}
    for name in overrides:
        if name not in notebooks:
            raise PipelineError(f"--set given for {name}, which is not selected to run ({', '.join(notebooks)})")
    runs = []
    for name in notebooks:
        source = paths.notebooks / f"{name}.ipynb"
        if not source.is_file():
            raise PipelineError(f"notebook {name} not found: expected {source}")
        params = load_profile(paths.configs, name, profile)
        given = sorted(set(overrides.get(name, {})) & set(COMMON_PARAMETERS))
        if given:  # the pipeline sets these itself (below): an override would be silently replaced
            raise PipelineError(f"{name}: {given} cannot be overridden; use --profile / --reports-dir")
        for key, value in overrides.get(name, {}).items():
            if _type_clash(params.get(key), value):
                raise PipelineError(f"{name}: --set {key}={value!r} is {_kind(value)}, but profile {profile!r} sets "
                                    f"{key} to {_kind(params[key])} ({params[key]!r}); give a value of that kind")
        params.update(overrides.get(name, {}))
        declared = notebook_parameters(source)
        unknown = sorted(set(params) - declared - set(COMMON_PARAMETERS))
        if unknown:
            raise PipelineError(
                f"{name}: parameters {unknown} (profile {profile!r} or --set) are not defined in the parameters "
                f"cell of {source} (it defines: {', '.join(sorted(declared))})"
            )
        params.update(profile=profile, reports_dir=str(paths.reports))
        runs.append(PlannedRun(name, source, paths.reports / "notebooks" / f"{name}.ipynb", params))
    return runs


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "true/false"
    return "a number" if isinstance(value, (int, float)) else f"a {type(value).__name__}"


def _type_clash(profile_value: Any, value: Any) -> bool:
    """True where an override cannot be meant for the profile's value: text or a list for a number, anything but
    true/false for a flag (the notebook would fail on it in some cell, after the notebooks before it ran). None
    on either side, strings, lists and mappings are left to the notebook."""
    if profile_value is None or value is None:
        return False
    if isinstance(profile_value, bool) or isinstance(value, bool):
        return isinstance(profile_value, bool) != isinstance(value, bool)
    if isinstance(profile_value, (int, float)):
        return not isinstance(value, (int, float))
    return False


@contextlib.contextmanager
def _kernel_environment(reports: Path, kernel_name: str | None) -> Iterator[str]:
    """Yield the kernel name to use, with TWELL_REPORTS and :data:`KERNEL_QUIET_ENV` set for the kernel process,
    and a matplotlibrc that stores inline figures at :data:`INLINE_FIGURE_DPI` (unless MATPLOTLIBRC is set).

    Without an explicit kernel, a private ``python3`` kernelspec whose argv is *this* interpreter is put
    first on JUPYTER_PATH for the run: the ``python3`` spec Jupyter would find otherwise can belong to
    another interpreter without twell (e.g. ``~/.local/share/jupyter/kernels/python3`` registered from
    another environment with an absolute path), and nothing has to be registered by hand.
    """
    with tempfile.TemporaryDirectory(prefix="twell-kernel-") as tmp:
        env: dict[str, str | None] = {"TWELL_REPORTS": str(reports), NOTEBOOK_DIR_VARIABLE: str(reports / "notebooks"),
                                      **KERNEL_QUIET_ENV}
        if not os.environ.get("MATPLOTLIBRC"):
            rc = Path(tmp) / "matplotlibrc"
            rc.write_text(f"figure.dpi: {INLINE_FIGURE_DPI}\n")
            env["MATPLOTLIBRC"] = str(rc)
        if kernel_name is None:
            kernel_name = "python3"
            spec_dir = Path(tmp) / "kernels" / kernel_name
            spec_dir.mkdir(parents=True)
            from ipykernel.kernelspec import get_kernel_dict  # argv[0] == sys.executable

            (spec_dir / "kernel.json").write_text(json.dumps(get_kernel_dict(), indent=1))
            env["JUPYTER_PATH"] = os.pathsep.join(filter(None, [tmp, os.environ.get("JUPYTER_PATH")]))
        with environ_set(env):
            yield kernel_name


def check_kernel(name: str) -> None:
    """PipelineError unless Jupyter knows a kernel called ``name`` (else every notebook would fail to start)."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    manager = KernelSpecManager()
    try:
        manager.get_kernel_spec(name)
    except NoSuchKernel:
        known = ", ".join(sorted(manager.find_kernel_specs())) or "none"
        raise PipelineError(f"no Jupyter kernel named {name!r} (installed: {known}); leave --kernel out to run the "
                            f"notebooks on this interpreter, or register it (python -m ipykernel install --user "
                            f"--name {name})") from None


def _describe_failure(name: str, exc: Exception) -> tuple[str, int | None]:
    from papermill.exceptions import PapermillExecutionError

    if isinstance(exc, PapermillExecutionError):
        first = next((ln for ln in (exc.source or "").splitlines() if ln.strip()), "")
        msg = (
            f"notebook {name} failed in cell In [{exc.exec_count}] (starts `{first.strip()[:80]}`): "
            f"{exc.ename}: {str(exc.evalue)[:500]}"
        )
        return msg, exc.exec_count
    return f"notebook {name} failed before or outside a cell: {type(exc).__name__}: {exc}", None


def run_pipeline(
    profile: str = DEFAULT_PROFILE,
    only: str | Sequence[str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    notebooks_dir: str | Path | None = None,
    configs_dir: str | Path | None = None,
    reports_dir: str | Path | None = None,
    kernel_name: str | None = None,
    progress: bool = True,
    log_output: bool = False,
    cell_timeout: float | None = None,
) -> list[NotebookResult]:
    """Execute the selected notebooks in order; return one result per notebook.

    Raises PipelineError on bad input before running anything, and NotebookFailedError (with
    ``.results``) at the first notebook whose cell raises; later notebooks are reported "not run".
    """
    import papermill
    from tqdm.auto import tqdm

    paths = PipelinePaths.resolve(notebooks_dir, configs_dir, reports_dir, profile)
    runs = plan(profile, select_notebooks(only), paths, overrides)
    if kernel_name is not None:
        check_kernel(kernel_name)
    (paths.reports / "notebooks").mkdir(parents=True, exist_ok=True)
    results: list[NotebookResult] = []
    failure: str | None = None
    with _kernel_environment(paths.reports, kernel_name) as kernel:
        bar = tqdm(runs, desc=f"pipeline [{profile}]", unit="notebook", disable=not progress, position=0)
        for run in bar:
            if failure is not None:
                results.append(NotebookResult(run.notebook, "not run", 0.0, None, run.parameters))
                continue
            bar.set_postfix_str(run.notebook)
            t0 = time.perf_counter()
            try:
                papermill.execute_notebook(
                    str(run.source),
                    str(run.output),
                    parameters=run.parameters,
                    kernel_name=kernel,
                    cwd=str(run.source.parent),
                    progress_bar={"desc": run.notebook, "position": 1, "leave": False} if progress else False,
                    log_output=log_output,
                    execution_timeout=cell_timeout,
                )
            except Exception as exc:  # any failure stops the pipeline; reported with the cell
                strip_absolute_paths(run.output, run.source.parent)
                failure, cell = _describe_failure(run.notebook, exc)
                results.append(
                    NotebookResult(run.notebook, "failed", time.perf_counter() - t0, run.output, run.parameters,
                                   error=failure, failed_cell=cell)
                )
                continue
            strip_absolute_paths(run.output, run.source.parent)
            results.append(NotebookResult(run.notebook, "ok", time.perf_counter() - t0, run.output, run.parameters))
        bar.close()
    _write_run_record(paths.reports, profile, results)
    if failure is not None:
        raise NotebookFailedError(f"{failure} (executed notebook with the error: {_failed_output(results)})", results)
    return results


def portable_path(path: Path, base: Path) -> str:
    """``path`` relative to ``base`` when both lie in this checkout, else absolute (a folder elsewhere)."""
    root = repo_root().resolve()
    path, base = Path(path).resolve(), Path(base).resolve()
    if path.is_relative_to(root) and base.is_relative_to(root):
        return os.path.relpath(path, base)
    return str(path)


def strip_absolute_paths(notebook: Path, cwd: Path) -> None:
    """Rewrite the checkout's absolute paths out of an executed notebook, so committed copies name no
    development machine: papermill's input and output paths become relative to the checkout, and the
    injected ``reports_dir`` relative to ``cwd`` (the notebook's folder, where its kernel ran: the same
    directory). The notebook ran with the absolute path: some of its calls resolve paths elsewhere."""
    notebook = Path(notebook)
    if not notebook.is_file():
        return
    nb = json.loads(notebook.read_text())
    meta = nb.get("metadata", {}).get("papermill", {})
    root = repo_root().resolve()
    changed = False
    for key in ("input_path", "output_path"):
        v = meta.get(key)
        if isinstance(v, str) and Path(v).is_absolute() and Path(v).resolve().is_relative_to(root):
            meta[key] = str(Path(v).resolve().relative_to(root))
            changed = True
    params = meta.get("parameters", {})
    given = params.get("reports_dir")
    if isinstance(given, str) and Path(given).is_absolute():
        rel = portable_path(Path(given), cwd)
        if rel != given:
            params["reports_dir"] = rel
            for cell in nb.get("cells", []):
                if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
                    src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
                    new = src.replace(json.dumps(given), json.dumps(rel))
                    cell["source"] = new.splitlines(keepends=True) if isinstance(cell["source"], list) else new
            changed = True
    if changed:
        notebook.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def _failed_output(results: list[NotebookResult]) -> Path | None:
    return next((r.output for r in results if r.status == "failed"), None)


def _from_checkout(path: str | Path) -> str:
    """``path`` relative to the checkout when it lies in it (a committed record names no machine's folders)."""
    p, root = Path(path).absolute(), repo_root().resolve()
    return p.relative_to(root).as_posix() if p.is_relative_to(root) else str(path)


def _write_run_record(reports: Path, profile: str, results: list[NotebookResult]) -> Path:
    path = reports / "notebooks" / "pipeline_run.json"
    record = {
        "profile": profile,
        "finished": _dt.datetime.now().isoformat(timespec="seconds"),
        "python": _from_checkout(sys.executable),
        "results": [{**r.as_json(), "output": _from_checkout(r.output) if r.output else None,
                     "parameters": {k: _from_checkout(v) if k == "reports_dir" else v for k, v in r.parameters.items()}}
                    for r in results],
    }
    path.write_text(json.dumps(record, indent=1, default=str))
    return path


def format_summary(results: Sequence[NotebookResult]) -> str:
    """A plain-text table: notebook, status, seconds."""
    width = max([len("notebook")] + [len(r.notebook) for r in results])
    lines = [f"{'notebook':<{width}}  {'status':<8}  {'seconds':>8}", f"{'-' * width}  {'-' * 8}  {'-' * 8}"]
    for r in results:
        secs = f"{r.seconds:8.1f}" if r.status != "not run" else f"{'-':>8}"
        lines.append(f"{r.notebook:<{width}}  {r.status:<8}  {secs}")
    return "\n".join(lines)


def list_notebooks(paths: PipelinePaths, names: Sequence[str] = NOTEBOOK_ORDER) -> str:
    """One line per notebook of ``names``: whether its file exists and which profiles its YAML defines."""
    lines = []
    for name in names:
        nb = paths.notebooks / f"{name}.ipynb"
        cfg = paths.configs / f"{name}.yaml"
        try:
            data = _yaml(cfg.read_text()) if cfg.is_file() else None
            profiles = ", ".join((data or {}).get("profiles", {}) or {}) if cfg.is_file() else "no profile file"
        except (yaml.YAMLError, AttributeError) as exc:
            profiles = f"unreadable {cfg.name}: {exc}"
        lines.append(f"{name:<22} {'present' if nb.is_file() else 'MISSING':<8} profiles: {profiles}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Execute notebooks " + ", ".join(NOTEBOOK_ORDER) + " in order with papermill.",
    )
    p.add_argument("--profile", default=DEFAULT_PROFILE, help=f"profile name ({', '.join(KNOWN_PROFILES)}; default %(default)s)")
    p.add_argument("--only", help="comma-separated notebook numbers or names, e.g. 00,02")
    p.add_argument("--list", action="store_true", help="list the notebooks (those of --only) and their profiles, "
                                                       "run nothing")
    p.add_argument("--set", dest="overrides", action="append", metavar="NB:KEY=VALUE", default=[],
                   help="override one parameter, e.g. --set 00:M=512 (value parsed as YAML); repeatable")
    p.add_argument("--kernel", default=None,
                   help="Jupyter kernel name (default: a python3 kernel running this interpreter)")
    p.add_argument("--notebooks-dir", default=None, help="default notebooks/ (env TWELL_NOTEBOOKS)")
    p.add_argument("--configs-dir", default=None, help="default configs/pipeline/ (env TWELL_PIPELINE_CONFIGS)")
    p.add_argument("--reports-dir", default=None,
                   help=f"default reports/, or reports/smoke/ for {DEFAULT_PROFILE} (env TWELL_REPORTS)")
    p.add_argument("--log-output", action="store_true", help="stream cell outputs to the terminal")
    p.add_argument("--cell-timeout", type=positive_float, default=None, help="seconds per cell (default: none)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars on the terminal")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    paths = PipelinePaths.resolve(args.notebooks_dir, args.configs_dir, args.reports_dir, args.profile)
    try:
        if args.list:
            print(list_notebooks(paths, select_notebooks(args.only)))
            return 0
        results = run_pipeline(
            args.profile, args.only, parse_overrides(args.overrides),
            notebooks_dir=paths.notebooks, configs_dir=paths.configs, reports_dir=paths.reports,
            kernel_name=args.kernel, progress=not args.no_progress, log_output=args.log_output,
            cell_timeout=args.cell_timeout,
        )
    except NotebookFailedError as exc:
        print("\n" + format_summary(exc.results), file=sys.stderr)
        print(f"\nFAILED: {exc}", file=sys.stderr)
        return 1
    except PipelineError as exc:
        return report(PROG, str(exc))
    print("\n" + format_summary(results))
    print(f"\nexecuted notebooks in {paths.reports / 'notebooks'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
