"""Which documents are held out for validation: whole documents (for a book corpus, whole books), by rule.

Two rules, both deterministic and the same on every machine:

- ``hash`` (``data.val_books`` unset): a document is held out when a stable hash of its id, seeded by
  ``data.split_seed``, falls below ``data.val_fraction``. Adding or removing other documents never
  moves one across the split; works for streaming sources.
- ``last`` (``data.val_books: {shard: <file>, last: N}``): the last N documents of the named shard.
  The validation set then does not depend on which training shards a run reads; when that shard is not
  among ``data.shards`` it is read only for those N documents, the rest of it stays unused (``unused``).

A document of a training shard whose id is that of a held-out document (a duplicate) is dropped, so
that no validation text is trained on.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRAIN, VAL = "train", "val"


def hash_is_val(doc_id: str, seed: int, fraction: float) -> bool:
    h = hashlib.sha1(f"{seed}/{doc_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64 < fraction


def check_val_books(value: Any) -> dict | None:
    """``data.val_books`` as ``{"shard": str, "last": int}`` (or None); ValueError naming the fix."""
    if value is None:
        return None
    example = "e.g. val_books: {shard: gutenberg-12.jsonl.xz, last: 16}"
    if not isinstance(value, Mapping) or set(value) != {"shard", "last"}:
        raise ValueError(f"data.val_books must be a mapping with keys shard and last ({example}), got {value!r}")
    shard, last = value["shard"], value["last"]
    if not isinstance(shard, str) or not shard.strip():
        raise ValueError(f"data.val_books.shard must be a shard file name ({example}), got {shard!r}")
    if isinstance(last, bool) or not isinstance(last, int) or last <= 0:
        raise ValueError(f"data.val_books.last must be a positive number of documents ({example}), got {last!r}")
    return {"shard": shard.strip(), "last": int(last)}


@dataclass
class ValSplit:
    """The resolved rule: ``role(origin, doc_id)`` is ``"train"``, ``"val"`` or None (not used)."""

    kind: str  # hash | last
    fraction: float | None = None
    seed: int | None = None
    shard: str | None = None  # the held-out shard's file name (last)
    count: int | None = None
    shard_is_training: bool = False  # whether the held-out shard's other documents train
    val_ids: frozenset = field(default_factory=frozenset)

    def role(self, origin: str, doc_id: str) -> str | None:
        if self.kind == "hash":
            return VAL if hash_is_val(doc_id, self.seed, self.fraction) else TRAIN
        if origin == self.shard:
            if doc_id in self.val_ids:
                return VAL
            return TRAIN if self.shard_is_training else None
        return None if doc_id in self.val_ids else TRAIN

    def record(self) -> dict:
        """The rule as stored in meta.json."""
        if self.kind == "hash":
            return {"kind": "hash", "val_fraction": self.fraction, "split_seed": self.seed,
                    "what": "held out when the first 8 bytes of sha1(f'{split_seed}/{id}') / 2^64 < val_fraction"}
        return {"kind": "last", "shard": self.shard, "last": self.count, "shard_trains": self.shard_is_training,
                "what": f"the last {self.count} documents of {self.shard}"}


def hash_split(fraction: float, seed: int) -> ValSplit:
    return ValSplit("hash", fraction=fraction, seed=seed)


def last_of_shard(path: Path, count: int, *, training: bool, text_field: str = "text",
                  progress: bool = True) -> ValSplit:
    """The ``last`` rule for shard ``path``: reads it once for its documents' ids (a few seconds a shard).

    training: whether that shard is also one of the training shards (its other documents then train).
    """
    from twell.data.sources import Source, iter_documents
    from twell.progress import progress_bar

    docs = iter_documents(Source("files", str(path), path.name, files=[path]), text_field=text_field)
    ids = [doc_id for doc_id, _ in progress_bar(docs, progress=progress, desc=f"ids of {path.name}", unit="doc",
                                                leave=False)]
    if len(ids) < count or (training and len(ids) == count):
        left = " and leave some to train on" if training else ""
        raise ValueError(f"data.val_books asks for the last {count} documents of {path.name}, which holds {len(ids)}; "
                         f"lower data.val_books.last{left}")
    held = ids[-count:]
    if len(set(held)) != len(held):
        raise ValueError(f"{path.name}: the last {count} documents repeat an id; held-out documents are told apart "
                         "by id, so the shard's ids must be unique")
    return ValSplit("last", shard=path.name, count=count, shard_is_training=training, val_ids=frozenset(held))
