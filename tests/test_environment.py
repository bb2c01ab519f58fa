"""pyproject.toml (ranges), requirements/cpu-py311.lock (exact versions) and environment.yml (conda) agree.

pyproject.toml declares ranges; `make lock` (scripts/lock.py) resolves them in a fresh venv into the lock;
environment.yml names the same packages pinned to the lock's versions; torch stays out of the lock
(scripts/ensure_torch.py installs it only when none is importable) and environment.yml pins the version
ensure_torch installs.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.specifiers import SpecifierSet
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python >= 3.11")

ROOT = Path(__file__).resolve().parents[1]
LOCK = "requirements/cpu-py311.lock"


def _by_name(reqs: list[Requirement], source: str) -> dict[str, Requirement]:
    out: dict[str, Requirement] = {}
    for r in reqs:
        name = canonicalize_name(r.name)
        assert name not in out, f"{source} lists {name} twice"
        out[name] = r
    return out


def _pin(req: Requirement, source: str) -> str:
    """The version of an exact ``name==version`` requirement."""
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version, (
        f"{source}: expected an exact pin name==version, got {req}")
    return specs[0].version


@pytest.fixture(scope="module")
def pyproject() -> dict:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


@pytest.fixture(scope="module")
def declared(pyproject) -> dict[str, Requirement]:
    project = pyproject["project"]
    return _by_name([Requirement(s) for s in project["dependencies"] + project["optional-dependencies"]["dev"]],
                    "pyproject.toml")


@pytest.fixture(scope="module")
def environment() -> dict:
    with (ROOT / "environment.yml").open() as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def lock() -> dict[str, str]:
    """The lock's pins, name -> version (comment lines skipped)."""
    lines = [x.strip() for x in (ROOT / LOCK).read_text().splitlines()]
    reqs = [Requirement(x) for x in lines if x and not x.startswith("#")]
    return {n: _pin(r, LOCK) for n, r in _by_name(reqs, LOCK).items()}


@pytest.fixture(scope="module")
def torch_spec() -> Requirement:
    """What scripts/ensure_torch.py installs when no torch is importable."""
    spec = importlib.util.spec_from_file_location("ensure_torch", ROOT / "scripts" / "ensure_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines TORCH_SPEC and main(); installs nothing on import
    return Requirement(module.TORCH_SPEC)


def _pip_section(env: dict) -> list[str]:
    sections = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(sections) == 1, f"expected one 'pip:' list in environment.yml, found {len(sections)}"
    return [str(x) for x in sections[0]]


def _conda_pins(env: dict) -> dict[str, Requirement]:
    return _by_name([Requirement(s) for s in _pip_section(env) if not s.startswith("-")], "environment.yml")


def test_environment_yml_names_the_declared_dependencies(declared, environment):
    pip = _pip_section(environment)
    assert "-e ." in pip, "environment.yml should install the package itself with '-e .'"
    assert f"-c {LOCK}" in pip, f"environment.yml should hold the other packages to the lock with '-c {LOCK}'"
    conda = _conda_pins(environment)
    only_py, only_env = sorted(set(declared) - set(conda)), sorted(set(conda) - set(declared))
    assert not only_py and not only_env, f"in pyproject.toml only: {only_py}; in environment.yml only: {only_env}"
    outside = {n: f"{conda[n].specifier} vs {declared[n].specifier}" for n in declared
               if not declared[n].specifier.contains(_pin(conda[n], "environment.yml"), prereleases=True)}
    assert not outside, f"environment.yml pins outside pyproject.toml's ranges: {outside}"


def test_lock_covers_the_declared_dependencies_within_their_ranges(declared, lock):
    missing = sorted(set(declared) - set(lock) - {"torch"})
    assert not missing, f"{LOCK} lacks {missing}: run `make lock`"
    outside = {n: f"{lock[n]} vs {declared[n].specifier}" for n in declared
               if n in lock and not declared[n].specifier.contains(lock[n], prereleases=True)}
    assert not outside, f"{LOCK} pins outside pyproject.toml's ranges: {outside}: run `make lock`"


def test_lock_leaves_out_torch_and_the_project(declared, lock):
    # `pip install -c <lock>` must never replace a machine's torch (a GPU machine's CUDA build); pip is the
    # interpreter's own
    kept = sorted(n for n in lock
                  if n in ("torch", "triton", "twell", "pip") or (n.startswith("nvidia-") and n not in declared))
    assert not kept, f"{LOCK} pins {kept}; scripts/lock.py leaves them out"


def test_environment_yml_versions_are_the_locks(environment, lock, torch_spec, declared):
    conda = {n: _pin(r, "environment.yml") for n, r in _conda_pins(environment).items()}
    differ = {n: (v, lock.get(n)) for n, v in conda.items() if n != "torch" and lock.get(n) != v}
    assert not differ, f"environment.yml vs {LOCK} (copy the lock's versions after `make lock`): {differ}"
    want = _pin(torch_spec, "scripts/ensure_torch.py")
    assert conda["torch"] == want, (
        f"environment.yml pins torch {conda['torch']}, scripts/ensure_torch.py installs {want}")
    assert declared["torch"].specifier.contains(want), f"ensure_torch's torch {want} is outside {declared['torch']}"


def test_lock_is_the_one_set_up_uses_and_says_how_it_was_made(environment):
    assert re.search(rf"^LOCK \?= {re.escape(LOCK)}$", (ROOT / "Makefile").read_text(), re.M), (
        f"the Makefile's LOCK should default to {LOCK}")
    header = [x for x in (ROOT / LOCK).read_text().splitlines() if x.startswith("#")]
    assert any("make lock" in x for x in header), f"{LOCK} should say it is made by `make lock`"
    made = re.search(r"Made with Python (\d+)\.(\d+)", "\n".join(header))
    python = next(d for d in environment["dependencies"] if isinstance(d, str) and d.startswith("python"))
    assert made and f"{made[1]}.{made[2]}" == python.split("=", 1)[1].lstrip("="), (
        f"{LOCK} was made with another Python than environment.yml's {python}")


def test_project_venv_has_the_locked_versions(lock):
    # What `make setup` installs into .venv/ (CI's environment): each locked package at the lock's version.
    from importlib.metadata import PackageNotFoundError, version

    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip("not running in the project's .venv/ (make test PYTHON=... uses an interpreter as it is)")
    wrong = {}
    for name, pinned in lock.items():
        try:
            have = version(name)
        except PackageNotFoundError:
            have = None
        if have is None or Version(have) != Version(pinned):
            wrong[name] = (have, pinned)
    assert not wrong, f"installed vs {LOCK} (run `make setup`): {wrong}"


def test_required_tools_declared(pyproject):
    names = {canonicalize_name(Requirement(s).name) for s in pyproject["project"]["dependencies"]}
    # The tools the project is built with; the pipeline also needs ipykernel (notebook kernel) and pyyaml (profiles).
    for needed in ("jupyterlab", "torch", "lm-eval", "datasets", "papermill", "seaborn", "ninja",
                   "ipykernel", "ipywidgets", "pyyaml", "nbformat"):
        assert needed in names, f"pyproject.toml dependencies lack {needed}"


def test_conda_python_satisfies_requires_python(pyproject, environment):
    pins = [d for d in environment["dependencies"] if isinstance(d, str) and d.startswith("python")]
    assert len(pins) == 1, f"expected one python pin in environment.yml, got {pins}"
    version = pins[0].split("=", 1)[1].lstrip("=")
    spec = SpecifierSet(pyproject["project"]["requires-python"])
    assert Version(version) in spec, f"environment.yml python {version} outside requires-python {spec}"
    running = Version(".".join(map(str, sys.version_info[:3])))
    assert running in spec, f"this interpreter {running} is outside requires-python {spec}"


def test_installed_environment_satisfies_pyproject(pyproject):
    # Some test modules skip when an optional import is missing (the GPU image has no papermill or
    # nbformat); this test keeps such skips from hiding a broken install where the tests normally run.
    from importlib.metadata import PackageNotFoundError, version

    project = pyproject["project"]
    missing, wrong = [], []
    for spec in project["dependencies"] + project["optional-dependencies"]["dev"]:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            have = version(req.name)
        except PackageNotFoundError:
            missing.append(req.name)
            continue
        if not req.specifier.contains(have, prereleases=True):
            wrong.append(f"{req.name} {have} (needs {req.specifier})")
    assert not missing and not wrong, f"not installed: {missing}; wrong version: {wrong} (run `make setup`)"
