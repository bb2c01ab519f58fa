"""Tokenise a corpus once into flat token files that training memory-maps (nanoGPT style).

A prepared data directory holds::

    train.bin   tokens of the training documents, uint16 (vocab <= 65536) or uint32, EOS after each doc
    val.bin     the same for the held-out documents
    tokenizer/  the tokenizer (hub copy or trained here), loadable with AutoTokenizer
    meta.json   what was prepared from what (written last: its presence marks a complete directory)

Whole documents (for a book corpus, whole books) go to validation by a rule of
:mod:`twell.data.split`: a stable hash of their id (``val_fraction``, ``split_seed``), or the last N
documents of a named shard (``val_books``); either way the split is the same on every machine.
meta.json records the rule and the held-out ids, and per shard (input file) the documents,
characters and tokens of each split, with the shard's sha256 when a ``SHA256SUMS`` checked it.
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
from twell.config_util import dataclass_from_dict
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
    # A sharded corpus (e.g. shared:corpus/gutenberg): which files a run reads, so that it says what it saw.
    shards: list[str] | None = None  # files of a directory source, read in this order (None: all, sorted)
    val_books: dict | None = None  # {shard: <file>, last: N}: hold out that shard's last N documents (None: by hash)
    verify_checksums: bool = True  # check the shards against the SHA256SUMS beside them, where there is one
    # Passes over the training tokens a run may make: 1 = no token twice (a unique-token run); None: no limit.
    max_epochs: float | None = None
    # The text a trained tokenizer learns from: another corpus (None: the training documents) and how the
    # tokenizer_train_chars budget is drawn: prefix (the first documents) or spread (a share of every one).
    tokenizer_source: str | None = None
    tokenizer_shards: list[str] | None = None
    tokenizer_sample: str = "prefix"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "data") -> "DataConfig":
        return dataclass_from_dict(cls, d, where).check()

    def check(self) -> "DataConfig":
        """Raise ValueError naming the field for an inconsistent setting; normalises val_books. Returns self."""
        from twell.data.budget import check_max_epochs
        from twell.data.split import check_val_books
        from twell.data.tokenizer import SAMPLES

        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        for name in ("shards", "tokenizer_shards"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, str) or not all(isinstance(v, str) and v for v in value)
                                      or not value):
                raise ValueError(f"data.{name} must be a list of file names inside the source directory, e.g. "
                                 f"[gutenberg-01.jsonl.xz, gutenberg-02.jsonl.xz], got {value!r}")
        if self.tokenizer_shards is not None and self.tokenizer_source is None:
            raise ValueError("data.tokenizer_shards names files of data.tokenizer_source, which is unset; set it "
                             "(e.g. shared:corpus/gutenberg) or use data.shards for the training files")
        if self.tokenizer_sample not in SAMPLES:
            raise ValueError(f"data.tokenizer_sample must be one of {SAMPLES}, got {self.tokenizer_sample!r}")
        if self.tokenizer_train_chars <= 0:
            raise ValueError(f"data.tokenizer_train_chars must be positive, got {self.tokenizer_train_chars}")
        self.val_books = check_val_books(self.val_books)
        self.max_epochs = check_max_epochs(self.max_epochs)
        return self


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


def _tokenizer_identity(spec: str) -> str:
    """data.tokenizer for the key: a saved tokenizer directory by its content, so that a tokenizer
    replaced in place prepares the data again (hub / train / auto stand for themselves)."""
    path = Path(spec).expanduser()
    if spec in ("hub", "train", "auto") or not (path / "tokenizer.json").is_file():
        return spec
    return f"{spec}@sha256:{hashlib.sha256((path / 'tokenizer.json').read_bytes()).hexdigest()[:16]}"


def _key(cfg: DataConfig, source: Source, vocab_size: int, val_shard: Path | None = None,
         tokenizer_source: Source | None = None) -> str:
    material = {
        "v": FORMAT_VERSION, "source": source.identity(), "tokenizer": _tokenizer_identity(cfg.tokenizer),
        "hub_tokenizer": cfg.hub_tokenizer,
        "vocab_size": vocab_size, "val_fraction": cfg.val_fraction, "split_seed": cfg.split_seed,
        "text_field": cfg.text_field, "max_docs": cfg.max_docs, "max_tokens": cfg.max_tokens,
        "tokenizer_train_chars": cfg.tokenizer_train_chars, "hub_split": cfg.hub_split,
    }
    # Settings added later enter the key only when set, so that data prepared before them keeps its key.
    if cfg.val_books is not None:
        material["val_books"] = cfg.val_books
        if val_shard is not None and val_shard not in source.files:
            material["val_shard"] = Source("files", str(val_shard), val_shard.name, files=[val_shard]).identity()
    if tokenizer_source is not None:
        material["tokenizer_source"] = tokenizer_source.identity()
    if cfg.tokenizer_sample != "prefix":
        material["tokenizer_sample"] = cfg.tokenizer_sample
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]


def _val_shard_path(cfg: DataConfig, source: Source) -> Path | None:
    """The file data.val_books names: one of the source's files, else a file of the source's directory."""
    if cfg.val_books is None or source.kind != "files":
        return None
    name = cfg.val_books["shard"]
    for f in source.files:
        if f.name == name or f.as_posix().endswith("/" + name):
            return f
    candidate = (source.root or source.files[0].parent) / name
    if candidate.is_file():
        return candidate
    raise FileNotFoundError(f"data.val_books.shard {name!r} is neither one of the source's files nor in "
                            f"{candidate.parent}; name a shard of the corpus directory")


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
    cfg.check()
    if is_prepared_dir(cfg.source):
        return PreparedData.load(cfg.source)
    vocab = cfg.vocab_size or vocab_size or 49152
    source = resolve_source(cfg.source, hub_config=cfg.hub_config, shards=cfg.shards)
    if cfg.val_books is not None and source.kind != "files":
        raise ValueError(f"data.val_books holds out documents of a local shard, but data.source {cfg.source!r} is not "
                         "a local corpus; use data.val_fraction (a hash of the document id) for it")
    tok_source = (resolve_source(cfg.tokenizer_source, hub_config=cfg.hub_config, shards=cfg.tokenizer_shards)
                  if cfg.tokenizer_source is not None else None)
    key = _key(cfg, source, vocab, _val_shard_path(cfg, source), tok_source)
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


# A batch of documents is encoded together (the tokenizer's threads share it) up to this many characters:
# a few books, not 256 of them (the encodings of 90M characters take gigabytes).
BATCH_DOCS, BATCH_CHARS = 256, 8_000_000
MAX_LISTED_IDS = 2000  # held-out ids listed in meta.json up to this many (their digest always)


def _files_to_read(cfg: DataConfig, source: Source) -> list[Path]:
    """The source's files, plus the held-out shard of data.val_books when it is not one of them."""
    val_path = _val_shard_path(cfg, source)
    return list(source.files) + ([val_path] if val_path is not None and val_path not in source.files else [])


def _split_for(cfg: DataConfig, source: Source, progress: bool):
    """The validation rule (:mod:`twell.data.split`); the ``last`` rule reads its shard's ids first."""
    from twell.data.split import hash_split, last_of_shard

    if cfg.val_books is None:
        return hash_split(cfg.val_fraction, cfg.split_seed)
    path = _val_shard_path(cfg, source)
    return last_of_shard(path, cfg.val_books["last"], training=path in source.files, text_field=cfg.text_field,
                         progress=progress)


def _tokenizer_texts(cfg: DataConfig, source: Source, split, progress: bool):
    """(a callable giving the tokenizer's training texts, what to record about them)."""
    from twell.data.sources import iter_documents_from
    from twell.data.split import TRAIN
    from twell.data.tokenizer import prefix_sample, spread_sample
    from twell.progress import progress_bar

    tok_source = source
    if cfg.tokenizer_source is not None:
        tok_source = resolve_source(cfg.tokenizer_source, hub_config=cfg.hub_config, shards=cfg.tokenizer_shards)
    budget = cfg.tokenizer_train_chars

    def docs():  # the training documents only: no held-out text shapes the tokenizer
        for origin, doc_id, text in iter_documents_from(tok_source, text_field=cfg.text_field, max_docs=cfg.max_docs,
                                                        allow_network=cfg.allow_network, hub_split=cfg.hub_split):
            if split.role(origin, doc_id) == TRAIN:
                yield doc_id, text

    record = {"source": tok_source.label, "spec": tok_source.spec, "sample": cfg.tokenizer_sample,
              "budget_chars": budget}
    if tok_source.kind == "files":
        record["files"] = [f.name for f in tok_source.files]
    if cfg.tokenizer_sample == "prefix":
        return (lambda: prefix_sample((t for _, t in docs()), budget)), record
    if tok_source.kind == "hub":
        raise ValueError("data.tokenizer_sample=spread reads the corpus twice (its size, then the sample), which a "
                         "streamed hub dataset does not allow; use tokenizer_sample=prefix or a local corpus")
    total = sum(len(t) for _, t in progress_bar(docs(), progress=progress, desc="tokenizer: sizing the corpus",
                                               unit="doc", leave=False))
    record["corpus_chars"] = total

    def texts():
        bar = progress_bar(progress=progress, desc="tokenizer: reading its sample", unit="char", unit_scale=True,
                           total=min(budget, total), leave=False)
        for text in spread_sample(docs(), budget, total):
            bar.update(len(text))
            yield text
        bar.close()

    return texts, record


def _prepare(cfg: DataConfig, source: Source, vocab: int, key: str, target: Path, progress: bool) -> PreparedData:
    from twell.data.shards import read_shard_index, verify_checksums
    from twell.data.sources import iter_documents_from
    from twell.data.split import TRAIN, VAL
    from twell.progress import progress_bar

    assert {TRAIN, VAL} == {"train", "val"}  # the split's roles name the token files and the counts below
    _check_replaceable(target)  # before the (long) tokenising
    files = _files_to_read(cfg, source) if source.kind == "files" else []
    checks = verify_checksums(files) if cfg.verify_checksums else {}  # before anything reads them
    split = _split_for(cfg, source, progress)
    reading = Source(source.kind, source.spec, source.label, files=files or list(source.files),
                     hub_dataset=source.hub_dataset, hub_config=source.hub_config, root=source.root)

    def docs():
        return iter_documents_from(reading, text_field=cfg.text_field, max_docs=cfg.max_docs,
                                   allow_network=cfg.allow_network, hub_split=cfg.hub_split)

    train_texts, tok_record = _tokenizer_texts(cfg, source, split, progress)
    tok, choice = resolve_tokenizer(cfg.tokenizer, hub_name=cfg.hub_tokenizer, vocab_size=vocab,
                                    train_texts=train_texts, trained_on=tok_record["source"],
                                    allow_network=cfg.allow_network, training=tok_record)
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
    chars = {"train": 0, "val": 0}
    per_shard: dict[str, dict[str, Any]] = {}
    val_ids: list[str] = []
    max_id = 0
    stopped_at_max_tokens = False
    files_out = {s: (tmp / f"{s}.bin").open("wb") for s in counts}
    index = {}  # shards.json: documents per shard, for the bar's total
    for d in {f.parent for f in files}:
        index.update(read_shard_index(d))
    known = [index.get(f.name, {}).get("books") for f in files]
    total_docs = sum(known) if files and all(isinstance(k, int) for k in known) and cfg.max_docs is None else None

    def shard(origin: str) -> dict[str, Any]:
        if origin not in per_shard:
            per_shard[origin] = {"name": origin, **checks.get(origin, {}), "train_docs": 0, "val_docs": 0,
                                 "unused_docs": 0, "dropped_docs": 0, "train_chars": 0, "val_chars": 0,
                                 "train_tokens": 0, "val_tokens": 0}
        return per_shard[origin]

    for f in files:  # in reading order, shards without documents too
        shard(f.name)
    done = False
    try:
        batch: list[tuple[str, str, str, str]] = []  # origin, doc id, text, split

        def flush() -> bool:
            """Write the batch's documents in order; False once data.max_tokens training tokens are
            written (the documents after that one are dropped)."""
            nonlocal max_id, stopped_at_max_tokens
            encs = backend.encode_batch([t for _, _, t, _ in batch], add_special_tokens=False)
            more = True
            for (origin, doc_id, text, part), enc in zip(batch, encs):
                ids = np.asarray(enc.ids + [eos], dtype=np.int64)
                max_id = max(max_id, int(ids.max()))
                files_out[part].write(ids.astype(dtype).tobytes())
                counts[part][0] += len(ids)
                counts[part][1] += 1
                chars[part] += len(text)
                rec = shard(origin)
                rec[f"{part}_docs"] += 1
                rec[f"{part}_chars"] += len(text)
                rec[f"{part}_tokens"] += len(ids)
                if part == VAL:
                    val_ids.append(doc_id)
                if cfg.max_tokens is not None and counts["train"][0] >= cfg.max_tokens:
                    more, stopped_at_max_tokens = False, True
                    break
            batch.clear()
            return more

        bar = progress_bar(progress=progress, desc=f"tokenising {_slug(source)}", unit="doc",
                           total=total_docs)
        more, batch_chars, current = True, 0, None
        for origin, doc_id, text in docs():
            bar.update(1)
            if origin != current:  # the shard being read
                bar.set_postfix_str(origin, refresh=False)
                current = origin
            role = split.role(origin, doc_id)
            if role is None:  # the held-out shard's other documents, or a copy of a held-out document
                shard(origin)["unused_docs" if origin == split.shard else "dropped_docs"] += 1
                continue
            batch.append((origin, doc_id, text, role))
            batch_chars += len(text)
            if len(batch) >= BATCH_DOCS or batch_chars >= BATCH_CHARS:
                more, batch_chars = flush(), 0
                if not more:
                    break
        if batch and more:
            flush()
        bar.close()
        done = True
    finally:
        for f in files_out.values():
            f.close()
        backend.encode_special_tokens = special_as_text
        if not done:  # a damaged shard, an interrupt: no half-written folder stays behind
            shutil.rmtree(tmp, ignore_errors=True)
    for part, (n_tok, n_doc) in counts.items():
        if n_doc == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            if part == "train" and cfg.val_books is not None:
                raise ValueError(f"the training split of {source.label} is empty: data.shards holds no documents besides "
                                 f"the held-out ones of {split.shard}; add training shards")
            raise ValueError(_empty_split_message(part, source.label, counts["train"][1], counts["val"][1],
                                                  cfg.val_fraction))
    tok.save_pretrained(str(tmp / "tokenizer"))
    ids_digest = hashlib.sha256("\n".join(sorted(val_ids)).encode()).hexdigest()
    meta = {
        "format_version": FORMAT_VERSION,
        "key": key,
        "source": {"spec": source.spec, "label": source.label, "kind": source.kind,
                   "shards": list(cfg.shards) if cfg.shards is not None else None},
        "tokenizer": choice.to_dict(),
        "vocab_size": len(tok),
        "dtype": np.dtype(dtype).name,
        "max_token_id": max_id,
        "n_train_tokens": counts["train"][0], "n_train_docs": counts["train"][1],
        "n_val_tokens": counts["val"][0], "n_val_docs": counts["val"][1],
        "n_train_chars": chars["train"], "n_val_chars": chars["val"],
        "val_fraction": cfg.val_fraction, "split_seed": cfg.split_seed,
        "split": {**split.record(), "val_docs": len(val_ids), "val_ids_sha256": ids_digest,
                  "val_ids": val_ids if len(val_ids) <= MAX_LISTED_IDS else None},
        "shards": list(per_shard.values()),
        "stopped_at_max_tokens": stopped_at_max_tokens,
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
