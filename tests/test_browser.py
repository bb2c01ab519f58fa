"""The committed notebooks as a reader opens them: JupyterLab in headless Chromium (tests/browser_check.py).

Each source notebook and executed copy is opened in a 1440 x 900 window; the test fails on an error output,
a widget or rendering error, a table with hidden rows, columns or text (pandas' ``...``) or wider than the
notebook, an image shown narrower than its intended size, and a notebook marked modified (or rewritten on
disk) on opening. Marked ``browser``; skipped without Chromium (Debian: ``apt-get install chromium``; or
``TWELL_CHROMIUM=/path/to/chrome``). ``TWELL_SCREENSHOTS=reports/screenshots`` keeps a screenshot of each
executed copy's first page there (the README's notebook map shows them).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import browser_check as bc

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
             + sorted((ROOT / "reports" / "notebooks").glob("*.ipynb"))]


@pytest.fixture(scope="module")
def chromium() -> str:
    path = bc.find_chromium()
    if path is None:
        pytest.skip(f"no Chromium: install Debian's chromium package (apt-get install chromium) or set "
                    f"{bc.CHROMIUM_VARIABLE}")
    return path


@pytest.fixture(scope="module")
def views(chromium) -> dict[str, bc.NotebookView]:
    shots = os.environ.get("TWELL_SCREENSHOTS")
    found = bc.check_notebooks(chromium, ROOT, NOTEBOOKS, Path(shots).resolve() if shots else None)
    return {v.path: v for v in found}


# Known faults, each until the notebook is next executed: strict, so a fixed one fails here until removed.
KNOWN: dict[str, str] = {}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.xfail(reason=KNOWN[p], strict=True))
                                  if p in KNOWN else p for p in NOTEBOOKS])
def test_notebook_opens_cleanly(views, path):
    view = views[path]
    assert view.cells > 0 and view.kernel == "Python 3 (ipykernel)", view
    assert view.problems == [], f"{path}:\n  " + "\n  ".join(view.problems)


def test_the_check_finds_what_it_looks_for(chromium, tmp_path):
    """A notebook with each fault: an error output, a shortened pandas table, a table wider than the notebook,
    an image squeezed below its size, and a partial language_info (marked modified on opening)."""
    import base64
    import struct
    import zlib

    import nbformat

    def png(width: int, height: int) -> str:
        raw = b"".join(b"\x00" + b"\x80" * width * 3 for _ in range(height))
        chunk = lambda kind, data: (struct.pack(">I", len(data)) + kind + data  # noqa: E731
                                    + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
        body = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
        return base64.b64encode(body).decode()

    wide = "<table><tr>" + "".join(f"<td>column_{i}_value</td>" for i in range(80)) + "</tr></table>"
    cut = "<table><tr><th>a</th><th>...</th></tr><tr><td>1</td><td>...</td></tr></table>"
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [
        nbformat.v4.new_output("error", ename="ValueError", evalue="boom", traceback=["ValueError: boom"]),
        nbformat.v4.new_output("display_data", data={"text/html": cut, "text/plain": ""}),
        nbformat.v4.new_output("display_data", data={"text/html": wide, "text/plain": ""}),
        nbformat.v4.new_output("display_data", data={"image/png": png(3000, 20), "text/plain": ""}),
    ]
    nb.cells = [cell]
    (tmp_path / "faults").mkdir()
    nbformat.write(nb, tmp_path / "faults" / "faults.ipynb")
    (view,) = bc.check_notebooks(chromium, tmp_path, ["faults/faults.ipynb"])
    text = "\n".join(view.problems)
    assert "marked modified on opening" in text
    assert "error output ValueError: boom" in text
    assert 'hidden rows, columns or text ("..." in 2 cells' in text
    assert "px wide in" in text and "image shown" in text and "3000 px intended" in text
