"""Compressed corpus shards: ``.jsonl.xz`` files read line by line, checked against ``SHA256SUMS``.

A sharded corpus is a directory of ``<name>-NN.jsonl.xz`` files, one JSON object per document
(``{"id", "text"}``), optionally with ``SHA256SUMS`` (``sha256sum`` output: the compressed files'
digests) and ``shards.json`` (a list of ``{"shard", "books", "characters"}``). Shards are
decompressed as a stream (the ``lzma`` module), never written out: only the token files that
:mod:`twell.data.prepare` makes from them land in the cache.
"""
from __future__ import annotations

import hashlib
import json
import lzma
from pathlib import Path
from typing import Any, Iterator

XZ_SUFFIX = ".jsonl.xz"
CHECKSUMS = "SHA256SUMS"
SHARD_INDEX = "shards.json"


def is_xz_shard(path: str | Path) -> bool:
    return Path(path).name.endswith(XZ_SUFFIX)


def _corrupt(path: Path, line: int, what: str) -> ValueError:
    return ValueError(f"{path}: line {line}: {what}; the shard is damaged: copy it again from its source "
                      f"(its {CHECKSUMS} entry, when there is one, checks the copy)")


def iter_jsonl_xz(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line index, parsed value)`` for every non-blank line of an xz-compressed JSON-lines file, streamed.

    ValueError naming the shard and the line on a truncated or corrupt xz stream, a line that is not
    UTF-8, or a line that is not valid JSON.
    """
    path = Path(path)
    i = -1
    try:
        with lzma.open(path, "rt", encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise _corrupt(path, i + 1, f"not valid JSON ({exc})") from None
                yield i, value
    except EOFError:  # the xz stream stops before its end marker: a cut copy
        raise _corrupt(path, i + 2, "the xz stream ends early (truncated file)") from None
    except lzma.LZMAError as exc:
        raise _corrupt(path, i + 2, f"the xz data cannot be decompressed ({exc})") from None
    except UnicodeDecodeError as exc:
        raise _corrupt(path, i + 2, f"not UTF-8 text ({exc.reason})") from None


def read_checksums(directory: str | Path) -> dict[str, str]:
    """``{file name: sha256}`` from ``<directory>/SHA256SUMS`` (empty when there is none)."""
    path = Path(directory) / CHECKSUMS
    if not path.is_file():
        return {}
    out = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        digest, _, name = line.strip().partition(" ")
        name = name.strip().lstrip("*")  # sha256sum writes "<digest>  <name>" or "<digest> *<name>" (binary mode)
        if len(digest) != 64 or not name:
            raise ValueError(f"{path}:{n}: expected '<sha256>  <file name>', got {line!r}")
        out[name] = digest.lower()
    return out


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def verify_checksums(files: list[Path]) -> dict[str, dict[str, Any]]:
    """Check every file listed in the ``SHA256SUMS`` beside it; ``{file name: {"sha256", "verified"}}``.

    A file without an entry (or without a ``SHA256SUMS``) is recorded with ``sha256`` None and
    ``verified`` False: nothing is hashed that cannot be checked. ValueError on a mismatch.
    """
    out: dict[str, dict[str, Any]] = {}
    sums_by_dir: dict[Path, dict[str, str]] = {}
    for f in files:
        sums = sums_by_dir.setdefault(f.parent, read_checksums(f.parent))
        want = sums.get(f.name)
        if want is None:
            out[f.name] = {"sha256": None, "verified": False}
            continue
        got = sha256_file(f)
        if got != want:
            raise ValueError(f"{f}: sha256 {got} does not match {f.parent / CHECKSUMS} ({want}): the shard is damaged "
                             "or was changed; copy it again (or set data.verify_checksums=false to use it unchecked)")
        out[f.name] = {"sha256": got, "verified": True}
    return out


def read_shard_index(directory: str | Path) -> dict[str, dict[str, Any]]:
    """``{shard name: {"books", "characters"}}`` from ``<directory>/shards.json`` (empty when absent)."""
    path = Path(directory) / SHARD_INDEX
    if not path.is_file():
        return {}
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
        return {str(r["shard"]): {k: v for k, v in r.items() if k != "shard"} for r in rows}
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: expected a JSON list of {{'shard', 'books', 'characters'}} objects ({exc})") from None
