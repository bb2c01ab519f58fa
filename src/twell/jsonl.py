"""Reading JSON-lines files with errors that name the file and line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line index, parsed value)`` for every non-blank line, streamed; ValueError on a bad line."""
    with Path(path).open(encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i + 1}: not valid JSON ({exc})") from None
