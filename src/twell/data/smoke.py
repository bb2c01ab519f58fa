"""A small SMOKE corpus built from text that installed Python packages ship.

Package descriptions (the body of each distribution's METADATA) and licence/notice files are
real English prose present on any machine where twell is installed, so the ``tiny`` run works on
a fresh machine with nothing downloaded. It is a smoke-test corpus, not a pretraining corpus:
results on it say only that the code runs and the recipe behaves, nothing about FineWeb-Edu.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from importlib import metadata
from pathlib import Path

from twell.paths import cache_dir

SMOKE_LABEL = "smoke corpus (text of installed Python packages' METADATA and licence files; not FineWeb-Edu)"
_LICENSE = re.compile(r"(^|/)(LICEN[CS]E|COPYING|NOTICE|AUTHORS)[^/]*$", re.IGNORECASE)


def _documents(min_chars: int):
    """(id, text) pairs, sorted by distribution name so the corpus is reproducible on one machine."""
    dists = {}
    for d in metadata.distributions():
        name = (d.metadata.get("Name") or "").strip()
        if name and name.lower() not in dists:
            dists[name.lower()] = d
    seen: set[str] = set()
    for key in sorted(dists):
        d = dists[key]
        tag = f"{d.metadata.get('Name')}-{d.version}"
        texts = []
        body = d.metadata.get_payload() if hasattr(d.metadata, "get_payload") else None
        if isinstance(body, str):
            texts.append(("METADATA", body))
        for f in sorted(d.files or [], key=str):
            if _LICENSE.search(str(f)):
                try:
                    texts.append((str(f), Path(d.locate_file(f)).read_text(encoding="utf-8", errors="replace")))
                except OSError:
                    continue
        for part, text in texts:
            text = text.strip()
            digest = hashlib.sha1(text.encode("utf-8", "replace")).hexdigest()
            if len(text) < min_chars or digest in seen:
                continue
            seen.add(digest)
            yield f"{tag}/{part}", text


def build_smoke_corpus(path: str | Path | None = None, *, max_chars: int = 4_000_000, min_chars: int = 300) -> Path:
    """Write the smoke corpus as JSONL (``{"id", "text", "source"}``) and return its path.

    Default location: ``<cache>/smoke/smoke_corpus.jsonl``. Rebuilt each call (seconds), written to a
    temporary file then renamed, so readers never see a partial file. Raises when the installed
    packages ship less than 100 kB of text.
    """
    path = Path(path) if path is not None else cache_dir("smoke") / "smoke_corpus.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    total = 0
    with tmp.open("w", encoding="utf-8") as f:
        for doc_id, text in _documents(min_chars):
            if total >= max_chars:
                break
            text = text[: max_chars - total] if total + len(text) > max_chars else text
            f.write(json.dumps({"id": doc_id, "text": text, "source": "smoke"}, ensure_ascii=False) + "\n")
            total += len(text)
    if total < 100_000:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"installed packages ship only {total} characters of text; too little for a smoke corpus")
    os.replace(tmp, path)
    return path
