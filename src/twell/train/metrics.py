"""The run's JSONL log: one JSON object per line, each with ``kind`` and ``step``.

Kinds: ``train`` (every ``log_every`` steps: loss, CE, L1, lr, grad norm, throughput, active
neurons per layer, dead fraction per layer), ``val`` (validation CE and sparsity), ``positions``
(active neurons by token position), ``event`` (start, resume, wall-clock stop, re-init, end).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from twell.jsonl import iter_jsonl


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never a half-written file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def json_safe(v: Any) -> Any:
    """v with non-finite floats as strings ("nan", "inf"), recursively: JSON has no NaN."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


class MetricsLog:
    """Append-only JSONL writer (rank 0 only; other ranks get a disabled instance)."""

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self._fh = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> int:
        """Drop records with step > ``step`` (a killed run may have logged past its last checkpoint)."""
        if not self.enabled or not self.path.is_file():
            return 0
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the kill
                dropped += 1
                continue
            if rec.get("step", 0) > step:
                dropped += 1
            else:
                kept.append(line)
        atomic_write(self.path, "".join(k + "\n" for k in kept))
        return dropped

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._fh is None:
            self._fh = self.path.open("a", encoding="utf-8")
        self._fh.write(json.dumps(json_safe(record)) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _numbers_back(v: Any) -> Any:
    """json_safe undone: the strings it wrote for non-finite floats are floats again (plots need numbers)."""
    if isinstance(v, str):
        return _NONFINITE.get(v, v)
    if isinstance(v, dict):
        return {k: _numbers_back(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_numbers_back(x) for x in v]
    return v


def read_metrics(path: str | Path) -> dict[str, list[dict]]:
    """Records of a metrics JSONL grouped by kind: ``{"train": [...], "val": [...], ...}``; non-finite
    values (a diverged run) read back as float NaN / inf."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    out: dict[str, list[dict]] = {}
    for _, rec in iter_jsonl(path, partial_last_ok=True):  # a run may be writing it right now
        out.setdefault(rec.get("kind", "train"), []).append(_numbers_back(rec))
    return out
