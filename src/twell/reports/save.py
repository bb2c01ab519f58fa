"""Write figures and tables under reports/ (or the ``reports_dir`` a notebook was given).

Figures go to ``<reports>/figures/<name>.png`` (and ``.svg`` on request), tables to
``<reports>/tables/<name>.csv`` plus a Markdown copy ``<name>.md`` for reading on GitHub.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from twell.paths import repo_root
from twell.paths import reports_dir as _default_reports_dir

# Set by the pipeline for its kernels: the folder the executed notebook is written to (<reports>/notebooks),
# which is not the folder the kernel runs in (the source notebook's). Links in outputs are relative to it.
NOTEBOOK_DIR_VARIABLE = "TWELL_NOTEBOOK_DIR"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _target(kind: str, name: str, reports_dir: str | Path | None) -> Path:
    if not isinstance(name, str) or not _NAME.match(name) or name.endswith((".png", ".svg", ".csv", ".md")):
        raise ValueError(
            f"expected a plain file stem like '00_footprint' (letters, digits, _ . -; no folder, no suffix), got {name!r}"
        )
    root = Path(reports_dir).expanduser() if reports_dir is not None else _default_reports_dir()
    folder = root / kind
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


SAVE_DPI = 150

MISSING = "-"  # how tables show a value that was not measured


def save_figure(fig, name: str, reports_dir: str | Path | None = None, *, svg: bool = False,
                dpi: int = SAVE_DPI) -> tuple[Path, ...]:
    """Save a matplotlib Figure as ``figures/<name>.png`` (+ ``.svg``); return the written paths."""
    from matplotlib.figure import Figure

    if not isinstance(fig, Figure):
        raise TypeError(f"expected a matplotlib Figure, got {type(fig).__name__}")
    stem = _target("figures", name, reports_dir)
    paths = [stem.with_name(name + ".png")]
    fig.savefig(paths[0], dpi=dpi, bbox_inches="tight")
    if svg:
        paths.append(stem.with_name(name + ".svg"))
        fig.savefig(paths[1], bbox_inches="tight")
    return tuple(paths)


def _cell(v: Any, float_digits: int) -> str:
    if v is None:  # a measure the run did not record (e.g. energy without a power counter)
        return MISSING
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        if v.is_integer() and abs(v) < 1e15:
            return str(int(v))  # byte counts and the like: no exponent
        short = f"{v:.{float_digits}g}"
        if abs(v) >= 10 ** float_digits or abs(float(short)) >= 10 ** float_digits:  # 9999.7 -> "1e+04"
            return f"{v:.1f}"
        return short
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(df, float_digits: int = 4, index: bool = False) -> str:
    """A GitHub-flavoured Markdown table of a DataFrame (floats to ``float_digits`` significant digits)."""
    import pandas as pd

    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"expected a pandas DataFrame, got {type(df).__name__}")
    frame = df.reset_index() if index else df
    header = [str(c) for c in frame.columns]
    rows = [[_cell(v, float_digits) for v in rec] for rec in frame.itertuples(index=False, name=None)]
    numeric = [pd.api.types.is_numeric_dtype(frame[c]) for c in frame.columns]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if n else ":---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def readable(df, float_digits: int = 4):
    """A DataFrame for display: a pandas Styler without the index, floats to ``float_digits`` significant
    digits as in :func:`markdown_table`, no text cut short (pandas' own display shortens long strings to
    ``...`` and hides middle columns of wide tables); a missing value (None or NaN) reads ``-``."""
    import pandas as pd

    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"expected a pandas DataFrame, got {type(df).__name__}")
    floats = [c for c in df.columns if pd.api.types.is_float_dtype(df[c])]
    shown = lambda v: MISSING if v is None or (isinstance(v, float) and math.isnan(v)) else _cell(v, float_digits)  # noqa: E731
    return df.style.hide(axis="index").format(na_rep=MISSING).format(shown, subset=floats)


def save_table(df, name: str, reports_dir: str | Path | None = None, *, index: bool = False,
               float_digits: int = 4) -> tuple[Path, Path]:
    """Save a DataFrame as ``tables/<name>.csv`` (full precision) and ``tables/<name>.md``; return both paths."""
    md = markdown_table(df, float_digits=float_digits, index=index)  # validates df before touching disk
    stem = _target("tables", name, reports_dir)
    csv_path, md_path = stem.with_name(name + ".csv"), stem.with_name(name + ".md")
    df.to_csv(csv_path, index=index)
    md_path.write_text(md)
    return csv_path, md_path


def file_link(path: str | Path) -> str:
    """A Markdown link to ``path`` from the notebook whose outputs show it: relative to ``$TWELL_NOTEBOOK_DIR``
    (the pipeline's executed copies) or else to the working directory (a notebook run in JupyterLab runs in
    its own folder). The text is the path from the checkout (the file name outside it)."""
    path = Path(path).resolve()
    base = Path(os.environ.get(NOTEBOOK_DIR_VARIABLE) or os.getcwd()).resolve()
    root = repo_root().resolve()
    text = str(path.relative_to(root)) if path.is_relative_to(root) else path.name
    return f"[`{text}`]({Path(os.path.relpath(path, base)).as_posix()})"


def display_path(path: str | Path) -> str:
    """A checkpoint or file path as a committed report shows it: a relative path (or hub id) as given; an
    absolute one relative to this checkout, else from its last ``runs`` folder (``runs/<name>/final``, where
    ``python -m twell.train`` leaves models), else its name. Evaluations and benchmarks record the absolute
    paths of the machine they ran on; a report names no machine's folders."""
    p = Path(path)
    if not p.is_absolute():
        return str(path)
    root = repo_root().resolve()
    if p.is_relative_to(root):
        return p.relative_to(root).as_posix()
    if "runs" in p.parts:
        i = len(p.parts) - 1 - p.parts[::-1].index("runs")
        return "/".join(p.parts[i:])
    return p.name


def relative_source(run):
    """A copy of an evaluation run (``twell.eval.harness.EvalRun``, any dataclass with ``source``) whose source
    is :func:`display_path` of its own."""
    import dataclasses

    return dataclasses.replace(run, source=display_path(run.source))


def saved_image(png: str | Path, dpi: int = SAVE_DPI):
    """An IPython ``Image`` of a PNG that :func:`save_figure` wrote at ``dpi``, to be shown at the size of the
    kernel's inline figures (``figure.dpi`` pixels per inch): a 150-dpi file shown one pixel per pixel would
    be twice the figure's size, and a notebook scales an image wider than itself down to fit."""
    import struct

    import matplotlib
    from IPython.display import Image

    data = Path(png).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{png}: expected a PNG file")
    width = struct.unpack(">I", data[16:20])[0]  # the IHDR chunk comes first
    return Image(data=data, format="png", width=round(width * float(matplotlib.rcParams["figure.dpi"]) / dpi))
