"""Where documents come from: one ``(doc_id, text)`` stream for every kind of source.

Source strings (``data.source`` in a run config, or ``--data``):

- ``smoke``: the smoke corpus built from installed packages (see :mod:`twell.data.smoke`).
- ``fineweb-edu`` or ``hf:<dataset>[:<config>]``: a hub dataset streamed with ``datasets``
  (imported only here, only then; needs the network).
- ``shared:<relative path>``: a file under the offline data directory (``twell.paths.shared_data_dir``).
- a path to a ``.jsonl`` / ``.jsonl.xz`` / ``.parquet`` / ``.txt`` file, or a directory of them (sorted,
  recursive). JSONL and Parquet rows hold one document each (``text`` field, optional ``id``); a
  ``.txt`` file is one document. ``.jsonl.xz`` shards are decompressed as a stream
  (:mod:`twell.data.shards`).

A directory source can be narrowed to named files (``shards``, e.g. ``data.shards`` of a run
config), read in the order given, so that a run records exactly which shards it saw.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from twell.data.shards import XZ_SUFFIX, is_xz_shard, iter_jsonl_xz
from twell.jsonl import iter_jsonl
from twell.paths import shared_data_dir

FILE_SUFFIXES = (".jsonl", XZ_SUFFIX, ".parquet", ".txt")
FINEWEB_EDU = "HuggingFaceFW/fineweb-edu"
# Labels of the offline corpora (README of the shared data): results on them are not FineWeb-Edu results.
GUTENBERG_LABEL = "Project Gutenberg books (public-domain literary English; not FineWeb-Edu)"


def is_corpus_file(path: Path) -> bool:
    """A file a source reads: one of FILE_SUFFIXES (``.jsonl.xz`` by its full ending)."""
    return is_xz_shard(path) or path.suffix in (".jsonl", ".parquet", ".txt")


@dataclass
class Source:
    """A resolved source: ``kind`` is smoke, hub or files."""

    kind: str
    spec: str
    label: str
    files: list[Path] = field(default_factory=list)
    hub_dataset: str | None = None
    hub_config: str | None = None
    root: Path | None = None  # the directory of a directory source (where its other shards are)

    def identity(self) -> dict:
        """What the prepared token files depend on (cache key material; cheap to compute)."""
        if self.kind == "hub":
            return {"kind": "hub", "dataset": self.hub_dataset, "config": self.hub_config}
        out = []
        for f in self.files:
            st = f.stat()
            out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
        if self.kind == "smoke":  # rebuilt each time: key on content
            h = hashlib.sha256()
            for f in self.files:
                h.update(f.read_bytes())
            return {"kind": "smoke", "sha256": h.hexdigest()}
        return {"kind": self.kind, "files": out}


def _label_for(path: Path) -> str:
    if path.name.startswith("python311_docs"):
        return "python311_docs (reStructuredText sources of the Python 3.11 documentation; not FineWeb-Edu)"
    if path.name.startswith("gutenberg"):
        return f"{path.name}: {GUTENBERG_LABEL}"
    return f"local corpus {path.name} (not FineWeb-Edu)"


def _corpus_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and is_corpus_file(p))


def _shard_label(path: Path, shards: list[Path], available: int) -> str:
    names = ", ".join(p.name for p in shards) if len(shards) <= 3 else f"{shards[0].name} ... {shards[-1].name}"
    what = GUTENBERG_LABEL if path.name.startswith("gutenberg") else "local corpus, not FineWeb-Edu"
    return f"{path.name}/ {len(shards)} of {available} shards ({names}): {what}"


def resolve_shards(directory: Path, shards: list[str]) -> list[Path]:
    """The named files of a directory source, in the order given; errors name what is missing and what exists."""
    if not directory.is_dir():
        raise ValueError(f"data.shards names files of a directory source, but {directory} is not a directory; "
                         "point data.source at the corpus directory (e.g. shared:corpus/gutenberg)")
    if len(set(shards)) != len(shards):
        dup = sorted({s for s in shards if shards.count(s) > 1})
        raise ValueError(f"data.shards lists {dup} more than once; a shard is read once")
    files = [directory / s for s in shards]
    missing = [s for s, f in zip(shards, files) if not f.is_file()]
    if missing:
        have = [p.relative_to(directory).as_posix() for p in _corpus_files(directory)]
        raise FileNotFoundError(f"data.shards: {missing} not found in {directory}; it holds {have}")
    bad = [s for s, f in zip(shards, files) if not is_corpus_file(f)]
    if bad:
        raise ValueError(f"data.shards: {bad} are not corpus files (expected one of {FILE_SUFFIXES})")
    return files


def resolve_source(spec: str, *, hub_config: str | None = "sample-10BT", smoke_path: Path | None = None,
                   shards: list[str] | None = None) -> Source:
    """Turn a source string into a :class:`Source`; errors name what was expected.

    shards: file names (relative paths) inside a directory source to read, in this order (None: all of
    its corpus files, sorted).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"expected a data source string (smoke, fineweb-edu, hf:<dataset>, shared:<path> or a "
                         f"path to .jsonl/.jsonl.xz/.parquet/.txt), got {spec!r}")
    spec = spec.strip()
    if shards is not None and (spec == "smoke" or spec == "fineweb-edu" or spec.startswith("hf:")):
        raise ValueError(f"data.shards selects files of a local directory source, not of {spec!r}; remove it")
    if spec == "smoke":
        from twell.data.smoke import SMOKE_LABEL, build_smoke_corpus

        return Source("smoke", spec, SMOKE_LABEL, files=[build_smoke_corpus(smoke_path)])
    if spec == "fineweb-edu" or spec.startswith("hf:"):
        name, cfg = FINEWEB_EDU, hub_config
        if spec.startswith("hf:"):
            parts = spec[3:].split(":")
            name = parts[0]
            cfg = parts[1] if len(parts) > 1 and parts[1] else (hub_config if name == FINEWEB_EDU else None)
        label = f"{name}" + (f" ({cfg})" if cfg else "")
        return Source("hub", spec, label, hub_dataset=name, hub_config=cfg)
    if spec.startswith("shared:"):
        root = shared_data_dir()
        if root is None:
            raise FileNotFoundError(f"data source {spec!r} needs the offline data directory: set TWELL_SHARED_DATA "
                                    "or place it at ../shared/data beside the checkout")
        path = root / spec[len("shared:"):]
    else:
        path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data path {str(path)!r} does not exist; expected a .jsonl/.jsonl.xz/.parquet/.txt "
                                "file, a directory of them, a prepared data directory (with meta.json), 'smoke' or "
                                "'fineweb-edu'")
    if shards is not None:
        files = resolve_shards(path, list(shards))
        return Source("files", spec, _shard_label(path, files, len(_corpus_files(path))), files=files, root=path)
    if path.is_dir():
        files = _corpus_files(path)
        if not files:
            raise FileNotFoundError(f"directory {path} holds no {'/'.join(FILE_SUFFIXES)} files")
        if path.name.startswith("gutenberg"):
            return Source("files", spec, _shard_label(path, files, len(files)), files=files, root=path)
        return Source("files", spec, f"local corpus {path.name}/ ({len(files)} files; not FineWeb-Edu)", files=files,
                      root=path)
    if not is_corpus_file(path):
        raise ValueError(f"unsupported data file {path.name!r}: expected one of {FILE_SUFFIXES}")
    return Source("files", spec, _label_for(path), files=[path])


def iter_documents(source: Source, *, text_field: str = "text", max_docs: int | None = None,
                   allow_network: bool | None = None, hub_split: str = "train") -> Iterator[tuple[str, str]]:
    """Yield ``(doc_id, text)`` for every non-empty document, in a fixed order."""
    for _, doc_id, text in iter_documents_from(source, text_field=text_field, max_docs=max_docs,
                                               allow_network=allow_network, hub_split=hub_split):
        yield doc_id, text


def iter_documents_from(source: Source, *, text_field: str = "text", max_docs: int | None = None,
                        allow_network: bool | None = None, hub_split: str = "train") -> Iterator[tuple[str, str, str]]:
    """Yield ``(origin, doc_id, text)``: :func:`iter_documents` with the file (shard) name each document came
    from (the dataset name for a hub source), for per-shard counts and per-shard validation rules."""
    n = 0
    it = _iter_hub(source, text_field, allow_network, hub_split) if source.kind == "hub" else _iter_files(source, text_field)
    for origin, doc_id, text in it:
        if not text:
            continue
        yield origin, doc_id, text
        n += 1
        if max_docs is not None and n >= max_docs:
            return


def _rows(f: Path, text_field: str) -> Iterator[tuple[str, str, str]]:
    rows = iter_jsonl_xz(f) if is_xz_shard(f) else iter_jsonl(f)
    for i, row in rows:
        if not isinstance(row, dict) or text_field not in row:
            raise ValueError(f"{f}:{i + 1}: expected a JSON object with a {text_field!r} field"
                             + (f", found keys {sorted(row)[:8]}" if isinstance(row, dict) else ""))
        text = row[text_field]
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{f}:{i + 1}: field {text_field!r} holds {type(text).__name__}, expected text")
        yield f.name, str(row.get("id", f"{f.name}:{i}")), text


def _iter_files(source: Source, text_field: str) -> Iterator[tuple[str, str, str]]:
    for f in source.files:
        if f.suffix == ".jsonl" or is_xz_shard(f):
            yield from _rows(f, text_field)
        elif f.suffix == ".parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(f)
            if text_field not in pf.schema_arrow.names:
                raise ValueError(f"{f}: expected a {text_field!r} column, found {pf.schema_arrow.names}")
            cols = [text_field] + (["id"] if "id" in pf.schema_arrow.names else [])
            i = 0
            for batch in pf.iter_batches(columns=cols, batch_size=1024):
                d = batch.to_pydict()
                for j, text in enumerate(d[text_field]):
                    doc_id = str(d["id"][j]) if "id" in d else f"{f.name}:{i}"
                    i += 1
                    yield f.name, doc_id, text
        else:
            yield f.name, f.name, f.read_text(encoding="utf-8", errors="replace")


def _iter_hub(source: Source, text_field: str, allow_network: bool | None, split: str) -> Iterator[tuple[str, str, str]]:
    from twell.data.network import network_allowed

    if not network_allowed(allow_network):
        raise RuntimeError(
            f"data source {source.spec!r} streams {source.label} from the Hugging Face hub, but the network is not "
            "allowed (set data.allow_network=true or TWELL_ALLOW_NETWORK=1, and unset HF_*_OFFLINE), or point "
            "--data at a local .jsonl/.parquet/.txt corpus"
        )
    try:
        import datasets  # lazy: not installed on every machine (e.g. the GPU box)
    except ImportError as exc:
        raise RuntimeError(f"streaming {source.label} needs the 'datasets' package (pip install datasets)") from exc
    ds = datasets.load_dataset(source.hub_dataset, name=source.hub_config, split=split, streaming=True)
    for i, row in enumerate(ds):
        yield source.hub_dataset, str(row.get("id", i)), row[text_field]
