"""The project's progress bars: one ``tqdm.auto`` bar per long step, off where ``TQDM_DISABLE`` is set.

``tqdm.auto`` draws a widget in a Jupyter kernel (ipywidgets is a dependency) and a text bar in a
terminal. ``TQDM_DISABLE`` is tqdm's own variable (any non-empty value, as tqdm reads it); the
pipeline sets it for the kernels that execute the notebooks, so that the executed copies hold no
progress output (papermill shows its own bar, per cell, on the terminal). tqdm applies it only as
the default of its text bars, and its widget bar ignores it; the project's bars check it here.
"""
from __future__ import annotations

import os
from typing import Any, Iterable

DISABLE_VARIABLE = "TQDM_DISABLE"


def bars_enabled(progress: bool = True) -> bool:
    """``progress``, unless ``TQDM_DISABLE`` is set."""
    return bool(progress) and not os.environ.get(DISABLE_VARIABLE)


def progress_bar(iterable: Iterable[Any] | None = None, *, progress: bool = True, **kwargs: Any):
    """A ``tqdm.auto`` bar, disabled when ``progress`` is False or ``TQDM_DISABLE`` is set."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not bars_enabled(progress), **kwargs)
