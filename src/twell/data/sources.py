"""Where documents come from: one ``(doc_id, text)`` stream for every kind of source.

Source strings (``data.source`` in a run config, or ``--data``):

- ``smoke``: the smoke corpus built from installed packages (see :mod:`twell.data.smoke`).
- ``fineweb-edu`` or ``hf:<dataset>[:<config>]``: a hub dataset streamed with ``datasets``
  (imported only here, only then; needs the network).
- ``shared:<relative path>``: a file under the offline data directory (``twell.paths.shared_data_dir``).
- a path to a ``.jsonl`` / ``.parquet`` / ``.txt`` file, or a directory of them (sorted, recursive).
  JSONL and Parquet rows hold one document each (``text`` field, optional ``id``); a ``.txt``
  file is one document.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from twell.jsonl import iter_jsonl
from twell.paths import shared_data_dir

FILE_SUFFIXES = (".jsonl", ".parquet", ".txt")
FINEWEB_EDU = "HuggingFaceFW/fineweb-edu"


@dataclass
class Source:
    """A resolved source: ``kind`` is smoke, hub or files."""

    kind: str
    spec: str
    label: str
    files: list[Path] = field(default_factory=list)
    hub_dataset: str | None = None
    hub_config: str | None = None

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
    return f"local corpus {path.name} (not FineWeb-Edu)"


def resolve_source(spec: str, *, hub_config: str | None = "sample-10BT", smoke_path: Path | None = None) -> Source:
    """Turn a source string into a :class:`Source`; errors name what was expected."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"expected a data source string (smoke, fineweb-edu, hf:<dataset>, shared:<path> or a "
                         f"path to .jsonl/.parquet/.txt), got {spec!r}")
    spec = spec.strip()
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
        raise FileNotFoundError(f"data path {str(path)!r} does not exist; expected a .jsonl/.parquet/.txt file, a "
                                "directory of them, a prepared data directory (with meta.json), 'smoke' or 'fineweb-edu'")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in FILE_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"directory {path} holds no {'/'.join(FILE_SUFFIXES)} files")
        return Source("files", spec, f"local corpus {path.name}/ ({len(files)} files; not FineWeb-Edu)", files=files)
    if path.suffix not in FILE_SUFFIXES:
        raise ValueError(f"unsupported data file {path.name!r}: expected one of {FILE_SUFFIXES}")
    return Source("files", spec, _label_for(path), files=[path])


def iter_documents(source: Source, *, text_field: str = "text", max_docs: int | None = None,
                   allow_network: bool | None = None, hub_split: str = "train") -> Iterator[tuple[str, str]]:
    """Yield ``(doc_id, text)`` for every non-empty document, in a fixed order."""
    n = 0
    it = _iter_hub(source, text_field, allow_network, hub_split) if source.kind == "hub" else _iter_files(source, text_field)
    for doc_id, text in it:
        if not text:
            continue
        yield doc_id, text
        n += 1
        if max_docs is not None and n >= max_docs:
            return


def _iter_files(source: Source, text_field: str) -> Iterator[tuple[str, str]]:
    for f in source.files:
        if f.suffix == ".jsonl":
            for i, row in iter_jsonl(f):
                if not isinstance(row, dict) or text_field not in row:
                    raise ValueError(f"{f}:{i + 1}: expected a JSON object with a {text_field!r} field")
                yield str(row.get("id", f"{f.name}:{i}")), row[text_field]
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
                    yield doc_id, text
        else:
            yield f.name, f.read_text(encoding="utf-8", errors="replace")


def _iter_hub(source: Source, text_field: str, allow_network: bool | None, split: str) -> Iterator[tuple[str, str]]:
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
        yield str(row.get("id", i)), row[text_field]
