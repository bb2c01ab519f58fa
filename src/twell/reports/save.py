"""Write figures and tables under reports/ (or the ``reports_dir`` a notebook was given).

Figures go to ``<reports>/figures/<name>.png`` (and ``.svg`` on request), tables to
``<reports>/tables/<name>.csv`` plus a Markdown copy ``<name>.md`` for reading on GitHub.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from twell.paths import reports_dir as _default_reports_dir

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


def save_figure(fig, name: str, reports_dir: str | Path | None = None, *, svg: bool = False,
                dpi: int = 150) -> tuple[Path, ...]:
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


def save_table(df, name: str, reports_dir: str | Path | None = None, *, index: bool = False,
               float_digits: int = 4) -> tuple[Path, Path]:
    """Save a DataFrame as ``tables/<name>.csv`` (full precision) and ``tables/<name>.md``; return both paths."""
    md = markdown_table(df, float_digits=float_digits, index=index)  # validates df before touching disk
    stem = _target("tables", name, reports_dir)
    csv_path, md_path = stem.with_name(name + ".csv"), stem.with_name(name + ".md")
    df.to_csv(csv_path, index=index)
    md_path.write_text(md)
    return csv_path, md_path
