"""Where things live: the repository, reports/, and the offline data directory.

Every location can be overridden by an environment variable so that notebooks, the pipeline and
tests agree without passing paths around:

- ``TWELL_REPORTS``: output root for figures/tables/executed notebooks (default ``<repo>/reports``;
  ``<repo>/reports/smoke`` for the cpu-smoke profile's notebook runs, see :func:`reports_root`).
- ``TWELL_SHARED_DATA``: directory with offline corpora and evaluation files
  (default ``<repo>/../shared/data`` when it exists). Never copied into the repository.
- ``TWELL_CACHE``: generated artefacts such as token files and trained tokenizers
  (default ``<repo>/data/cache``).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Mapping


def repo_root() -> Path:
    """The checkout root (the directory holding pyproject.toml), else the current directory."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "src" / "twell").is_dir():
            return parent
    return Path.cwd()


def _reports_env() -> Path | None:
    """``$TWELL_REPORTS`` when set and non-empty (an empty value means unset, not the working directory)."""
    env = os.environ.get("TWELL_REPORTS")
    return Path(env).expanduser() if env else None


def reports_dir(*parts: str, create: bool = True) -> Path:
    """``reports/<parts...>`` (or ``$TWELL_REPORTS/<parts...>``); created on demand."""
    root = _reports_env() or repo_root() / "reports"
    path = root.joinpath(*parts)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


SMOKE_PROFILE = "cpu-smoke"


def reports_root(profile: str | None = None) -> Path:
    """Output root of a notebook run: ``$TWELL_REPORTS``, else ``reports/``, or ``reports/smoke/`` for the
    smoke profile, whose tiny-model and fixture outputs must not replace the committed results."""
    env = _reports_env()
    if env is not None:
        return env
    return repo_root() / "reports" / "smoke" if profile == SMOKE_PROFILE else repo_root() / "reports"


def shared_data_dir() -> Path | None:
    """The offline data directory, or None when neither the variable nor ../shared/data exists."""
    env = os.environ.get("TWELL_SHARED_DATA")
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"TWELL_SHARED_DATA={env!r} is not a directory")
        return path
    default = repo_root().parent / "shared" / "data"
    return default if default.is_dir() else None


def cache_dir(*parts: str, create: bool = True) -> Path:
    """``data/cache/<parts...>`` (git-ignored) for generated token files and tokenizers."""
    env = os.environ.get("TWELL_CACHE", "").strip()  # empty: the default, as for the other TWELL_ paths
    root = Path(env).expanduser() if env else repo_root() / "data" / "cache"
    path = root.joinpath(*parts)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def environ_set(values: Mapping[str, str | None]) -> Iterator[None]:
    """Within the block, set (or, for None, remove) environment variables; restore them after."""
    def apply(pairs: Mapping[str, str | None]) -> None:
        for k, v in pairs.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    saved = {k: os.environ.get(k) for k in values}
    try:
        apply(values)
        yield
    finally:
        apply(saved)
