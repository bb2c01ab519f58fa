"""Write the lock: the exact versions a fresh CPU set-up resolves today, as a pip constraints file.

    python scripts/lock.py [requirements/cpu-py311.lock]      (what `make lock` runs)

It builds a temporary virtual environment with this interpreter, installs torch the way set-up does
(scripts/ensure_torch.py, no TWELL_TORCH_SPEC), then pyproject.toml's dependencies and dev extra
without any lock, and writes `pip freeze --all` less pip, torch, triton, nvidia-* and twell. torch
stays out so that `pip install -c <lock>` never replaces a machine's own torch (a GPU machine's CUDA
build).
`make setup` installs with the lock; upgrading is regenerating it and committing the result.
Needs only the standard library (it runs before anything is installed).
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "requirements" / f"cpu-py{sys.version_info.major}{sys.version_info.minor}.lock"
# torch and what a CUDA build of it brings (triton, nvidia-*-cu*): installed by scripts/ensure_torch.py, or already
# there on a GPU machine, and never constrained by the lock. A declared dependency (nvidia-ml-py) stays in.
LEFT_OUT = re.compile(r"^(torch|triton|nvidia-.*|twell)$")


def canonical(name: str) -> str:
    """PEP 503 normalised name (what pip compares)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def req_name(spec: str) -> str:
    return canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec).group(0))


def declared() -> list[str]:
    """pyproject.toml's dependencies plus the dev extra (what `pip install -e ".[dev]"` asks for)."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)["project"]
    return project["dependencies"] + project["optional-dependencies"]["dev"]


def main(out: Path) -> None:
    tag = re.search(r"py(\d)(\d+)", out.name)
    if tag and (int(tag[1]), int(tag[2])) != sys.version_info[:2]:
        sys.exit(f"{out.name} is for Python {tag[1]}.{tag[2]}, but this is Python {platform.python_version()}: "
                 f"run it with that interpreter (make lock BASE_PYTHON=python{tag[1]}.{tag[2]})")
    env = {k: v for k, v in os.environ.items() if k not in ("TWELL_TORCH_SPEC", "PIP_CONSTRAINT")}
    with tempfile.TemporaryDirectory(prefix="twell-lock-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.check_call([sys.executable, "-m", "venv", str(venv)])
        py = str(venv / "bin" / "python")
        subprocess.check_call([py, str(ROOT / "scripts" / "ensure_torch.py")], env=env)
        subprocess.check_call([py, "-m", "pip", "install", *declared()], env=env)
        # --all: setuptools too (torch requires it); pip itself is the interpreter's own and stays out
        frozen = subprocess.check_output([py, "-m", "pip", "freeze", "--all", "--exclude", "pip"], env=env,
                                         text=True).splitlines()
    wanted = {req_name(s) for s in declared()} - {"torch"}
    pins, torch = {}, "none"
    for line in frozen:
        if not line or line.startswith(("#", "-")) or "==" not in line:
            raise SystemExit(f"unexpected `pip freeze` line (not name==version): {line!r}")
        name, version = line.split("==", 1)
        if canonical(name) == "torch":
            torch = version
        if not LEFT_OUT.match(canonical(name)) or canonical(name) in wanted:
            pins[canonical(name)] = f"{canonical(name)}=={version}"
    missing = sorted(wanted - set(pins))
    if missing:
        raise SystemExit(f"the fresh environment lacks declared dependencies {missing}")
    header = [
        f"# Exact versions of the CPU set-up on Python {sys.version_info.major}.{sys.version_info.minor}, as a pip "
        "constraints file:",
        "# `make setup` runs `pip install -c <this file> -e \".[dev]\"`. Made by `make lock` (python scripts/lock.py):",
        "# a fresh virtual environment, torch from scripts/ensure_torch.py, then pyproject.toml's dependencies and",
        "# dev extra, then `pip freeze --all`. Do not edit by hand: regenerate and commit.",
        "# Left out: pip, torch, triton, nvidia-* (scripts/ensure_torch.py installs torch only when none is",
        "# importable, so a GPU machine's CUDA build stays) and twell itself.",
        f"# Made with Python {platform.python_version()} on {platform.system()} {platform.machine()}, torch {torch}.",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(header + [pins[k] for k in sorted(pins)]) + "\n")
    print(f"[lock] wrote {len(pins)} pins to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else DEFAULT_OUT)
