"""The project's progress bars: one ``tqdm.auto`` bar per long step, off where ``TQDM_DISABLE`` is set.

``tqdm.auto`` draws a widget in a Jupyter kernel (ipywidgets is a dependency) and a text bar in a
terminal. ``TQDM_DISABLE`` is tqdm's own variable (any non-empty value, as tqdm reads it); the
pipeline sets it for the kernels that execute the notebooks, so that the executed copies hold no
progress output (papermill shows its own bar, per cell, on the terminal). tqdm applies it only as
the default of its text bars, and its widget bar ignores it; the project's bars check it here.

A widget bar is shown without tqdm's text fallback. tqdm displays its widget with a ``text/plain``
copy of the bar as it was when shown (``0%| | 0/6``); a notebook executed outside a live front end
(``jupyter nbconvert --execute``, nbclient) stores that copy, and every reader without the widget's
state (GitHub, a text view) sees a bar frozen at its start. Here the stored output is the widget or
nothing.
"""
from __future__ import annotations

import os
from typing import Any, Iterable

DISABLE_VARIABLE = "TQDM_DISABLE"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def bars_enabled(progress: bool = True) -> bool:
    """``progress``, unless ``TQDM_DISABLE`` is set."""
    return bool(progress) and not os.environ.get(DISABLE_VARIABLE)


def progress_bar(iterable: Iterable[Any] | None = None, *, progress: bool = True, **kwargs: Any):
    """A ``tqdm.auto`` bar, disabled when ``progress`` is False or ``TQDM_DISABLE`` is set; in a notebook,
    a widget displayed without a text copy."""
    from tqdm.auto import tqdm
    from tqdm.notebook import tqdm_notebook

    disable = not bars_enabled(progress)
    if disable or not issubclass(tqdm, tqdm_notebook):
        return tqdm(iterable, disable=disable, **kwargs)
    bar = tqdm(iterable, display=False, **kwargs)
    _display_widget_only(bar.container)
    bar.displayed = True
    return bar


def _display_widget_only(widget) -> None:
    from IPython.display import display

    bundle = {k: v for k, v in widget._repr_mimebundle_().items() if k == WIDGET_MIME}
    display({**bundle, "text/plain": ""}, raw=True)
