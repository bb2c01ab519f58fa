"""The repository speaks to a reader who has only the repository.

Code, comments, docstrings, tests, notebooks, scripts, configs, the documentation and the committed
reports must not point to the project's work log: numbered work sessions or tracker issues, or the kernel
notes file that docs/kernels.md replaced. A reference of that kind tells a newcomer nothing; name a
section of the docs or a report file instead. The scan covers git's tracked files and untracked files git
does not ignore; notebooks are scanned cell by cell (sources and the text of their outputs). Outside
reports/ data files are skipped; in reports/ the records themselves are read too (their headers and notes
are prose a reader sees), all but the kinds in REPORTS_SKIPPED.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCANNED_DIRS = ("src/", "csrc/", "tests/", "notebooks/", "scripts/", "configs/", "docs/")
SCANNED_FILES = {"README.md", "Makefile", "environment.yml"}
# Generated or measured data, not prose (notebooks are read as JSON below).
DATA_SUFFIXES = {".json", ".jsonl", ".csv", ".tsv", ".parquet", ".png", ".jpg", ".svg", ".pdf", ".pt",
                 ".safetensors", ".bin", ".npy", ".npz"}
REPORTS = "reports/"
# Under reports/, what is not read: images, and two kinds of text no one here wrote: the per-step metrics of
# training runs (numbers under fixed keys, most of reports/ by size) and the captured output of third-party
# tools in GPU logs (a library's message may cite its own tracker).
REPORTS_SKIPPED = {".png", ".jpg", ".svg", ".pdf", ".jsonl", ".log"}

# Written so that none of them matches its own source text: this file is scanned like any other.
PATTERNS = {
    "numbered work session": re.compile(r"\bsessions?\s+#?\d+(?:\s*[-–]\s*\d+)?", re.IGNORECASE),
    "work session": re.compile(r"\b(?:this|next|last|previous|that|same|another)\s+session\b", re.IGNORECASE),
    "tracker issue": re.compile(r"\bissues?\s+#?\d+\b", re.IGNORECASE),
    "deleted notes file (now docs/kernels.md)": re.compile(r"csrc/NOTES\.md|(?<![\w/.-])NOTES\.md"),
}


def _git_files() -> list[str]:
    """Tracked files plus untracked ones that git does not ignore, relative to the repository root."""
    names: set[str] = set()
    for extra in ((), ("--others", "--exclude-standard")):
        out = subprocess.run(["git", "ls-files", "-z", *extra], cwd=ROOT, capture_output=True, check=True)
        names.update(n for n in out.stdout.decode("utf-8", "surrogateescape").split("\0") if n)
    return sorted(names)


def scanned_files() -> list[str]:
    files = []
    for name in _git_files():
        in_reports = name.startswith(REPORTS)
        if not (in_reports or name in SCANNED_FILES or name.startswith(SCANNED_DIRS)):
            continue
        path = ROOT / name
        if not path.is_file() or path.is_symlink():  # deleted in the working tree, or a link
            continue
        if path.suffix.lower() in (REPORTS_SKIPPED if in_reports else DATA_SUFFIXES):
            continue
        files.append(name)
    return files


def text_lines(name: str) -> list[tuple[str, str]]:
    """(where, line) for every line a reader sees: a notebook's cell sources and the text of its outputs (an
    executed notebook in reports/ shows them), else the file's text. Binary files give nothing."""
    data = (ROOT / name).read_bytes()
    if b"\0" in data:
        return []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return []
    if name.endswith(".ipynb"):
        cells = json.loads(text).get("cells", [])
        lines = [(f"cell {i} line {j}", line)
                 for i, cell in enumerate(cells)
                 for j, line in enumerate("".join(cell.get("source", "")).splitlines(), 1)]
        return lines + [(f"cell {i} output {k} line {j}", line)
                        for i, cell in enumerate(cells)
                        for k, out in enumerate(cell.get("outputs", []))
                        for j, line in enumerate(_output_text(out).splitlines(), 1)]
    return [(f"line {j}", line) for j, line in enumerate(text.splitlines(), 1)]


def _output_text(out: dict) -> str:
    """The text a notebook output shows: a stream, a result's plain or markdown text, an error's traceback."""
    parts = [out.get("text", ""), *(out.get("data", {}).get(kind, "") for kind in ("text/plain", "text/markdown")),
             out.get("traceback", [])]
    return "\n".join("".join(p) if isinstance(p, list) else p for p in parts if p)


def find_hits(lines: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(where, what, matched text) of every pattern hit in ``lines``."""
    return [(where, what, m.group(0))
            for where, line in lines
            for what, pattern in PATTERNS.items()
            for m in pattern.finditer(line)]


def _joined(*parts: str) -> str:
    """Examples for the patterns, kept in pieces so that this file's text does not match them."""
    return "".join(parts)


@pytest.mark.parametrize("text", [
    _joined("measured in sess", "ion 19"), _joined("Sess", "ions 23-24 made it cheaper"),
    _joined("sess", "ions 23–24"), _joined("the speed bar of iss", "ue 3"), _joined("(iss", "ue #4)"),
    _joined("iss", "ue 3's bars"), _joined("left for the next ", "session"), _joined("as this ", "session found"),
    _joined("see csrc/NOT", "ES.md"), _joined("(NOT", "ES.md, v13)"),
])
def test_patterns_catch_process_words(text):
    assert find_hits([("line 1", text)]), text


@pytest.mark.parametrize("text", [
    "a bulk copy issues 8x fewer instructions", "lane 0 issues the next row's copies",
    "the paper's kernels (../shared/KERNEL_NOTES.md)", "a training session of ten minutes",
    "ffn-NVIDIA-H100-80GB-HBM3-20261127T111641Z-s39-H100.md", "docs/kernels.md §7", "notes.md",
])
def test_patterns_leave_ordinary_text_alone(text):
    assert not find_hits([("line 1", text)]), text


def test_notebook_sources_and_output_text_are_scanned(tmp_path, monkeypatch):
    stream = _joined("measured in sess", "ion 5\n")
    nb = {"cells": [{"cell_type": "markdown", "source": ["clean\n", "text"]},
                    {"cell_type": "code", "source": "x = 1",
                     "outputs": [{"output_type": "stream", "text": ["ok\n", stream]},
                                 {"output_type": "execute_result", "data": {"text/plain": ["42"], "image/png": "iVBO"}},
                                 {"output_type": "error", "traceback": [_joined("see iss", "ue 7")]}]}]}
    (tmp_path / "n.ipynb").write_text(json.dumps(nb))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    lines = text_lines("n.ipynb")
    assert lines == [("cell 0 line 1", "clean"), ("cell 0 line 2", "text"), ("cell 1 line 1", "x = 1"),
                     ("cell 1 output 0 line 1", "ok"), ("cell 1 output 0 line 2", stream.strip()),
                     ("cell 1 output 1 line 1", "42"), ("cell 1 output 2 line 1", _joined("see iss", "ue 7"))]
    assert [where for where, _, _ in find_hits(lines)] == ["cell 1 output 0 line 2", "cell 1 output 2 line 1"]


def test_reports_are_scanned_but_metrics_logs_and_images(tmp_path, monkeypatch):
    names = ["reports/bench/a.txt", "reports/bench/a.json", "reports/bench/a.csv", "reports/tables/t.md",
             "reports/runs/r/config.yaml", "reports/runs/r/metrics.jsonl", "reports/bench/run/x.log",
             "reports/figures/f.png", "data/other.json", "src/twell/x.json"]
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "_git_files", lambda: sorted(names))
    assert scanned_files() == ["reports/bench/a.csv", "reports/bench/a.json", "reports/bench/a.txt",
                               "reports/runs/r/config.yaml", "reports/tables/t.md"]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_no_work_log_references():
    files = scanned_files()
    # The scan must see the code, the notebooks and itself, or it proves nothing.
    for must in ("csrc/twell_ffn.cu", "src/twell/nn/ffn.py", "notebooks/01_kernels.ipynb", "docs/kernels.md",
                 "tests/test_repository.py", "reports/README.md", "reports/notebooks/03_downstream_eval.ipynb",
                 "reports/bench/power-H100-20261124.txt", "reports/bench/union-rule-refit-generator-H100-20261125.csv",
                 "reports/bench/ffn-NVIDIA-H100-80GB-HBM3-20261127T111641Z-s39-H100.json",
                 "reports/tables/03_downstream_eval.md"):
        assert must in files, f"{must} not scanned"
    hits = [f"{name}: {where}: {matched!r} ({what})"
            for name in files
            for where, what, matched in find_hits(text_lines(name))]
    assert not hits, ("references to the work log (name a docs/ section or a report file instead):\n"
                      + "\n".join(hits))
