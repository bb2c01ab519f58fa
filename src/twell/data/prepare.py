"""Tokenise a corpus once into flat token files that training memory-maps (nanoGPT style).

A prepared data directory holds::

    train.bin   tokens of the training documents, uint16 (vocab <= 65536) or uint32, EOS after each doc
    val.bin     the same for the held-out documents
    tokenizer/  the tokenizer (hub copy or trained here), loadable with AutoTokenizer
    meta.json   what was prepared from what (written last: its presence marks a complete directory)

Documents go to validation by a stable hash of their id (``val_fraction``, ``split_seed``), so
the split is the same on every machine and for streaming sources.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from twell.data.sources import Source, iter_documents, resolve_source
from twell.data.tokenizer import SMOLLM2, resolve_tokenizer
from twell.model.config import dataclass_from_dict
from twell.paths import cache_dir

# 2: special-token strings inside a document are encoded as text (format 1 turned a document's literal
# "<|endoftext|>" into a document break).
FORMAT_VERSION = 2


@dataclass
class DataConfig:
    """The ``data:`` section of a run config."""

    source: str = "smoke"
    tokenizer: str = "train"  # train | hub | auto | path to a tokenizer directory
    hub_tokenizer: str = SMOLLM2
    vocab_size: int | None = None  # size of a trained tokenizer; None: the model's vocab_size
    val_fraction: float = 0.05
    split_seed: int = 0
    text_field: str = "text"
    max_docs: int | None = None
    max_tokens: int | None = None  # stop at the document that brings the training tokens to this many (streaming sources)
    tokenizer_train_chars: int = 200_000_000
    hub_config: str | None = "sample-10BT"
    hub_split: str = "train"
    allow_network: bool | None = None  # None: TWELL_ALLOW_NETWORK decides (default offline)
    prepared_dir: str | None = None  # where to write the token files; default <cache>/prepared/<key>

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "data") -> "DataConfig":
        cfg = dataclass_from_dict(cls, d, where)
        if not 0.0 < cfg.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {cfg.val_fraction}")
        return cfg


@dataclass
class PreparedData:
    """A prepared data directory (see module docstring)."""

    dir: Path
    meta: dict

    @property
    def train_path(self) -> Path:
        return self.dir / "train.bin"

    @property
    def val_path(self) -> Path:
        return self.dir / "val.bin"

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["tokenizer"]["eos_token_id"])

    @property
    def label(self) -> str:
        return self.meta["source"]["label"]

    @property
    def tokenizer_choice(self) -> dict:
        return dict(self.meta["tokenizer"])

    def tokens(self, split: str) -> np.memmap:
        """The split's tokens as a read-only memory map."""
        path = {"train": self.train_path, "val": self.val_path}[split]
        return np.memmap(path, dtype=self.dtype, mode="r")

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.dir / "tokenizer"))

    @classmethod
    def load(cls, path: str | Path) -> "PreparedData":
        d = Path(path)
        meta_path = d / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{d} is not a prepared data directory (no meta.json)")
        meta = json.loads(meta_path.read_text())
        for f in ("train.bin", "val.bin", "tokenizer/tokenizer.json"):
            if not (d / f).is_file():
                raise FileNotFoundError(f"prepared data directory {d} is incomplete: {f} is missing")
        want = {"train.bin": meta["n_train_tokens"], "val.bin": meta["n_val_tokens"]}
        for f, n in want.items():
            size = (d / f).stat().st_size
            if size != n * np.dtype(meta["dtype"]).itemsize:
                raise ValueError(f"{d / f} holds {size} bytes, meta.json promises {n} {meta['dtype']} tokens")
        return cls(d, meta)


def is_prepared_dir(spec: str) -> bool:
    p = Path(str(spec)).expanduser()
    return p.is_dir() and (p / "meta.json").is_file()


def _is_val(doc_id: str, seed: int, fraction: float) -> bool:
    h = hashlib.sha1(f"{seed}/{doc_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64 < fraction


def _tokenizer_identity(spec: str) -> str:
    """data.tokenizer for the key: a saved tokenizer directory by its content, so that a tokenizer
    replaced in place prepares the data again (hub / train / auto stand for themselves)."""
    path = Path(spec).expanduser()
    if spec in ("hub", "train", "auto") or not (path / "tokenizer.json").is_file():
        return spec
    return f"{spec}@sha256:{hashlib.sha256((path / 'tokenizer.json').read_bytes()).hexdigest()[:16]}"


def _key(cfg: DataConfig, source: Source, vocab_size: int) -> str:
    material = {
        "v": FORMAT_VERSION, "source": source.identity(), "tokenizer": _tokenizer_identity(cfg.tokenizer),
        "hub_tokenizer": cfg.hub_tokenizer,
        "vocab_size": vocab_size, "val_fraction": cfg.val_fraction, "split_seed": cfg.split_seed,
        "text_field": cfg.text_field, "max_docs": cfg.max_docs, "max_tokens": cfg.max_tokens,
        "tokenizer_train_chars": cfg.tokenizer_train_chars, "hub_split": cfg.hub_split,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]


def prepare_data(cfg: DataConfig | Mapping[str, Any] | str, *, vocab_size: int | None = None,
                 out_dir: str | Path | None = None, progress: bool = True, force: bool = False) -> PreparedData:
    """Tokenise ``cfg.source`` into a prepared data directory (reused when it already exists).

    vocab_size: the size of a trained tokenizer when ``cfg.vocab_size`` is None (the model's).
    A source that is itself a prepared directory is returned as is.
    """
    if isinstance(cfg, str):
        cfg = DataConfig(source=cfg)
    elif not isinstance(cfg, DataConfig):
        cfg = DataConfig.from_dict(cfg)
    if is_prepared_dir(cfg.source):
        return PreparedData.load(cfg.source)
    vocab = cfg.vocab_size or vocab_size or 49152
    source = resolve_source(cfg.source, hub_config=cfg.hub_config)
    key = _key(cfg, source, vocab)
    target = Path(out_dir or cfg.prepared_dir or cache_dir("prepared") / f"{_slug(source)}-{key}")
    if not force and (target / "meta.json").is_file():
        prepared = PreparedData.load(target)
        if prepared.meta.get("key") == key:
            return prepared
    return _prepare(cfg, source, vocab, key, target, progress)


def _slug(source: Source) -> str:
    if source.kind == "hub":
        return source.hub_dataset.split("/")[-1].lower()
    if source.kind == "smoke":
        return "smoke"
    return source.files[0].stem if len(source.files) == 1 else source.files[0].parent.name


def _check_replaceable(target: Path) -> None:
    """The target is replaced whole: refuse anything but an absent or empty folder or an earlier prepared one."""
    if not target.exists() or (target / "meta.json").is_file():
        return
    if not target.is_dir():
        raise FileExistsError(f"prepared data target {target} exists and is not a folder; choose another "
                              "data.prepared_dir / --out")
    entries = sorted(p.name for p in target.iterdir())
    if entries:
        raise FileExistsError(
            f"refusing to replace {target}: it is not a prepared data directory (no meta.json) and holds "
            f"{len(entries)} entries ({', '.join(entries[:5])}{', ...' if len(entries) > 5 else ''}); choose an empty "
            "or new folder for data.prepared_dir / --out")


def _empty_split_message(split: str, label: str, n_train: int, n_val: int, fraction: float) -> str:
    """The error for a corpus that left one split without documents, naming the setting and a value that works."""
    n = n_train + n_val
    if n == 0:
        return f"{label} holds no documents; check data.source (and data.text_field, data.max_docs)"
    if split == "train":
        return (f"the training split of {label} is empty: data.val_fraction = {fraction:g} sent all {n} documents to "
                "validation; lower it, e.g. --set data.val_fraction=0.05")
    # Documents go to validation by a hash of their id: ask for about 5 of them (none with probability < 1 %).
    nice = [f for f in (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5) if f > fraction and f * n >= 5]
    if not nice:
        return (f"the validation split of {label} is empty: the corpus has {n} documents, too few to hold some out "
                f"(data.val_fraction = {fraction:g}); use a larger corpus")
    return (f"the validation split of {label} is empty: data.val_fraction = {fraction:g} of its {n} documents "
            f"selected none (documents are assigned by a hash of their id); raise it, e.g. --set "
            f"data.val_fraction={nice[0]:g} (about {nice[0] * n:.0f} documents), or use a larger corpus")


def _prepare(cfg: DataConfig, source: Source, vocab: int, key: str, target: Path, progress: bool) -> PreparedData:
    from twell.progress import progress_bar

    _check_replaceable(target)  # before the (long) tokenising

    def docs():
        return iter_documents(source, text_field=cfg.text_field, max_docs=cfg.max_docs,
                              allow_network=cfg.allow_network, hub_split=cfg.hub_split)

    def train_texts():
        budget = cfg.tokenizer_train_chars
        for doc_id, text in docs():
            if _is_val(doc_id, cfg.split_seed, cfg.val_fraction):
                continue
            yield text[:budget]
            budget -= len(text)
            if budget <= 0:
                return

    tok, choice = resolve_tokenizer(cfg.tokenizer, hub_name=cfg.hub_tokenizer, vocab_size=vocab,
                                    train_texts=train_texts, trained_on=source.label, allow_network=cfg.allow_network)
    backend = tok.backend_tokenizer
    # A document that quotes a special token ("<|endoftext|>", "</s>") keeps it as text: the only EOS
    # in the stream is the one appended after each document.
    special_as_text = backend.encode_special_tokens
    backend.encode_special_tokens = True  # restored before the tokenizer is saved
    eos = choice.eos_token_id
    dtype = np.uint16 if len(tok) <= 2**16 else np.uint32
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts = {"train": [0, 0], "val": [0, 0]}  # tokens, docs
    max_id = 0
    files = {s: (tmp / f"{s}.bin").open("wb") for s in counts}
    try:
        batch: list[tuple[str, str]] = []

        def flush() -> bool:
            """Write the batch's documents in order; False once data.max_tokens training tokens are
            written (the documents after that one are dropped)."""
            nonlocal max_id
            encs = backend.encode_batch([t for _, t in batch], add_special_tokens=False)
            more = True
            for (doc_id, _), enc in zip(batch, encs):
                split = "val" if _is_val(doc_id, cfg.split_seed, cfg.val_fraction) else "train"
                ids = np.asarray(enc.ids + [eos], dtype=np.int64)
                max_id = max(max_id, int(ids.max()))
                files[split].write(ids.astype(dtype).tobytes())
                counts[split][0] += len(ids)
                counts[split][1] += 1
                bar.update(1)
                if cfg.max_tokens is not None and counts["train"][0] >= cfg.max_tokens:
                    more = False
                    break
            batch.clear()
            return more

        bar = progress_bar(progress=progress, desc=f"tokenising {source.label[:40]}", unit="doc")
        more = True
        for doc in docs():
            batch.append(doc)
            if len(batch) >= 256:
                more = flush()
                if not more:
                    break
        if batch and more:
            flush()
        bar.close()
    finally:
        for f in files.values():
            f.close()
        backend.encode_special_tokens = special_as_text
    for split, (n_tok, n_doc) in counts.items():
        if n_doc == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ValueError(_empty_split_message(split, source.label, counts["train"][1], counts["val"][1],
                                                  cfg.val_fraction))
    tok.save_pretrained(str(tmp / "tokenizer"))
    meta = {
        "format_version": FORMAT_VERSION,
        "key": key,
        "source": {"spec": source.spec, "label": source.label, "kind": source.kind},
        "tokenizer": choice.to_dict(),
        "vocab_size": len(tok),
        "dtype": np.dtype(dtype).name,
        "max_token_id": max_id,
        "n_train_tokens": counts["train"][0], "n_train_docs": counts["train"][1],
        "n_val_tokens": counts["val"][0], "n_val_docs": counts["val"][1],
        "val_fraction": cfg.val_fraction, "split_seed": cfg.split_seed,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        _check_replaceable(target)  # again: something may have been written there meanwhile
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if (target / "meta.json").is_file():  # another process prepared the same data meanwhile: keep its copy
        try:
            other = PreparedData.load(target)
        except Exception:
            other = None
        if other is not None and other.meta.get("key") == key:
            shutil.rmtree(tmp, ignore_errors=True)
            return other
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, target)
    return PreparedData.load(target)
