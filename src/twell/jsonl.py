"""Reading JSON-lines files with errors that name the file and line."""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Iterator


def iter_jsonl(path: str | Path, partial_last_ok: bool = False) -> Iterator[tuple[int, Any]]:
    """``(line index, parsed value)`` for every non-blank line, streamed; ValueError on a bad line.

    partial_last_ok: a last line that has no newline and does not parse (a file still being written,
    or a writer killed mid-line) is skipped with a warning instead of raising.
    """
    with Path(path).open(encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as exc:
                if partial_last_ok and not line.endswith("\n"):
                    warnings.warn(f"{path}:{i + 1}: incomplete last line skipped (still being written, or the "
                                  "writer stopped mid-line)", stacklevel=2)
                    return
                raise ValueError(f"{path}:{i + 1}: not valid JSON ({exc})") from None
