"""twell.data on a sharded book corpus: .jsonl.xz shards, SHA256SUMS, held-out books, the unique-token check.

Every shard here is a FIXTURE written by the test (a few "books" of generated word salad, compressed with
lzma into tmp_path); the real Gutenberg shards are only looked at, briefly, when the offline data exists.
"""
import hashlib
import json
import lzma
import random

import numpy as np
import pytest

from twell.data import DataConfig, TokenBlocks, TrainOrder, check_token_budget, iter_documents, prepare_data, \
    resolve_source, verify_checksums
from twell.data.tokenizer import spread_sample
from twell.paths import shared_data_dir

WORDS = ("whale captain harpoon sea ship deck storm sail mast island chapter letter castle knight lady river "
         "forest village king queen road night morning the a of and to in was he she it").split()
N_SHARDS, BOOKS_PER_SHARD = 3, 6


def _book(rng, shard, i):
    """A FIXTURE "book": an id in the corpus's style and a few hundred words."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(150, 400)))
    return {"id": f"pg-fixture/Author {shard}/Book {shard}-{i}", "text": text}


def _write_xz(path, rows, raw_lines=()):
    body = "".join(json.dumps(r) + "\n" for r in rows) + "".join(raw_lines)
    path.write_bytes(lzma.compress(body.encode("utf-8")))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """FIXTURE corpus: books-NN.jsonl.xz shards, SHA256SUMS and shards.json, like corpus/gutenberg/."""
    rng = random.Random(7)
    d = tmp_path_factory.mktemp("books")
    shards = {}
    for s in range(1, N_SHARDS + 1):
        rows = [_book(rng, s, i) for i in range(BOOKS_PER_SHARD)]
        shards[f"books-{s:02d}.jsonl.xz"] = rows
        _write_xz(d / f"books-{s:02d}.jsonl.xz", rows)
    (d / "SHA256SUMS").write_text("".join(f"{hashlib.sha256((d / n).read_bytes()).hexdigest()}  {n}\n" for n in shards))
    (d / "shards.json").write_text(json.dumps([{"shard": n, "books": len(r), "characters": sum(len(b["text"]) for b in r)}
                                               for n, r in shards.items()]))
    return d, shards


def _cfg(d, **kw):
    base = dict(source=str(d), shards=["books-01.jsonl.xz", "books-02.jsonl.xz"], vocab_size=300,
                val_books={"shard": "books-03.jsonl.xz", "last": 2})
    base.update(kw)
    return DataConfig(**base)


def test_xz_shards_stream_the_documents_in_order(corpus):
    d, shards = corpus
    src = resolve_source(str(d), shards=["books-02.jsonl.xz", "books-01.jsonl.xz"])
    got = list(iter_documents(src))
    want = [(b["id"], b["text"]) for n in ("books-02.jsonl.xz", "books-01.jsonl.xz") for b in shards[n]]
    assert got == want
    assert "2 of 3 shards" in src.label
    every = resolve_source(str(d))  # a directory without shards: all of them, sorted
    assert [f.name for f in every.files] == sorted(shards)


def test_a_missing_shard_is_named_with_what_exists(corpus):
    d, _ = corpus
    with pytest.raises(FileNotFoundError, match=r"books-09\.jsonl\.xz.*books-01\.jsonl\.xz"):
        resolve_source(str(d), shards=["books-01.jsonl.xz", "books-09.jsonl.xz"])
    with pytest.raises(ValueError, match="more than once"):
        resolve_source(str(d), shards=["books-01.jsonl.xz", "books-01.jsonl.xz"])
    with pytest.raises(ValueError, match="list of file names"):
        DataConfig.from_dict({"source": str(d), "shards": "books-01.jsonl.xz"})


@pytest.mark.parametrize("damage, message", [
    ("truncated", r"line \d+: the xz stream ends early"),
    ("bad_json", r"line 3: not valid JSON"),
    ("no_text", r":3: expected a JSON object with a 'text' field"),
    ("garbage", r"line 1: the xz data cannot be decompressed"),
])
def test_a_corrupt_shard_names_the_shard_and_the_line(tmp_path, damage, message):
    rng = random.Random(damage)
    rows = [_book(rng, 1, i) for i in range(4)]
    path = tmp_path / "books-01.jsonl.xz"
    if damage == "truncated":
        full = lzma.compress("".join(json.dumps(r) + "\n" for r in rows * 20).encode())
        path.write_bytes(full[: len(full) // 2])
    elif damage == "bad_json":
        _write_xz(path, [], [json.dumps(rows[0]) + "\n", json.dumps(rows[1]) + "\n", '{"id": "x", "text": \n'])
    elif damage == "no_text":
        _write_xz(path, rows[:2] + [{"id": "x", "body": "no text field"}])
    else:
        path.write_bytes(b"this is not xz data at all" * 10)
    with pytest.raises(ValueError, match=message) as err:
        list(iter_documents(resolve_source(str(path))))
    assert "books-01.jsonl.xz" in str(err.value)
    if damage == "bad_json":  # found while tokenising (a saved tokenizer reads nothing first): no folder left
        from twell.data import train_bpe

        train_bpe([r["text"] for r in rows], 300).save_pretrained(str(tmp_path / "tok"))
        with pytest.raises(ValueError, match=message):
            prepare_data(DataConfig(source=str(path), tokenizer=str(tmp_path / "tok"), val_fraction=0.5),
                         out_dir=tmp_path / "p", progress=False)
        assert sorted(q.name for q in tmp_path.iterdir()) == ["books-01.jsonl.xz", "tok"]


def test_checksums_are_verified_and_a_mismatch_refused(corpus, tmp_path):
    d, shards = corpus
    files = [d / n for n in shards]
    checked = verify_checksums(files)
    assert all(c["verified"] and len(c["sha256"]) == 64 for c in checked.values())
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in files:
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / "SHA256SUMS").write_text((d / "SHA256SUMS").read_text())
    damaged = copy / "books-02.jsonl.xz"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\0")
    with pytest.raises(ValueError, match=r"books-02\.jsonl\.xz: sha256 .* does not match"):
        verify_checksums([copy / f.name for f in files])
    with pytest.raises(ValueError, match="does not match"):
        prepare_data(_cfg(copy, shards=["books-02.jsonl.xz"], val_books=None, val_fraction=0.3),
                     out_dir=tmp_path / "p", progress=False)
    (copy / "SHA256SUMS").unlink()  # nothing to check against: used, recorded as unverified
    assert verify_checksums([damaged]) == {"books-02.jsonl.xz": {"sha256": None, "verified": False}}


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    d, _ = corpus
    return prepare_data(_cfg(d), out_dir=tmp_path_factory.mktemp("prep") / "books", progress=False)


def _segments(prepared, split):
    tokens, eos = prepared.tokens(split), prepared.eos_id
    cuts = np.where(tokens == eos)[0]
    starts = np.concatenate([[0], cuts[:-1] + 1])
    tok = prepared.tokenizer()
    return [tok.decode(tokens[a:b].tolist()) for a, b in zip(starts, cuts)]


def test_validation_holds_out_whole_books_of_the_named_shard(prepared, corpus):
    _, shards = corpus
    meta = prepared.meta
    held = shards["books-03.jsonl.xz"][-2:]
    assert meta["split"]["kind"] == "last" and meta["split"]["val_ids"] == [b["id"] for b in held]
    assert meta["split"]["shard_trains"] is False
    # whole books: each held-out book is one validation document, decoded back to its full text
    assert _segments(prepared, "val") == [b["text"] for b in held]
    train_texts = [b["text"] for n in ("books-01.jsonl.xz", "books-02.jsonl.xz") for b in shards[n]]
    assert _segments(prepared, "train") == train_texts
    assert meta["n_val_docs"] == 2 and meta["n_train_docs"] == 2 * BOOKS_PER_SHARD


def test_meta_records_shards_books_characters_and_tokens(prepared, corpus):
    _, shards = corpus
    meta = prepared.meta
    assert meta["source"]["shards"] == ["books-01.jsonl.xz", "books-02.jsonl.xz"]
    by_name = {s["name"]: s for s in meta["shards"]}
    assert list(by_name) == ["books-01.jsonl.xz", "books-02.jsonl.xz", "books-03.jsonl.xz"]
    for name in ("books-01.jsonl.xz", "books-02.jsonl.xz"):
        s = by_name[name]
        assert s["verified"] and s["train_docs"] == BOOKS_PER_SHARD and s["val_docs"] == 0
        assert s["train_chars"] == sum(len(b["text"]) for b in shards[name])
    held = by_name["books-03.jsonl.xz"]
    assert held["val_docs"] == 2 and held["unused_docs"] == BOOKS_PER_SHARD - 2 and held["train_docs"] == 0
    for part in ("train", "val"):
        assert sum(s[f"{part}_tokens"] for s in meta["shards"]) == meta[f"n_{part}_tokens"]
        assert sum(s[f"{part}_chars"] for s in meta["shards"]) == meta[f"n_{part}_chars"]
    training = meta["tokenizer"]["training"]
    assert training["sample"] == "prefix" and training["docs"] == 2 * BOOKS_PER_SHARD  # the budget covers the corpus
    assert training["chars"] == meta["n_train_chars"] and training["files"] == meta["source"]["shards"]


def test_a_held_out_shard_that_also_trains_gives_its_other_books(corpus, tmp_path):
    d, shards = corpus
    p = prepare_data(_cfg(d, shards=["books-01.jsonl.xz", "books-03.jsonl.xz"]), out_dir=tmp_path / "p",
                     progress=False)
    assert p.meta["n_train_docs"] == 2 * BOOKS_PER_SHARD - 2 and p.meta["split"]["shard_trains"] is True
    assert set(_segments(p, "val")) == {b["text"] for b in shards["books-03.jsonl.xz"][-2:]}
    with pytest.raises(ValueError, match="lower data.val_books.last"):
        prepare_data(_cfg(d, val_books={"shard": "books-03.jsonl.xz", "last": 99}), out_dir=tmp_path / "q",
                     progress=False)
    with pytest.raises(ValueError, match="val_books must be a mapping"):
        DataConfig.from_dict({"val_books": {"shard": "books-03.jsonl.xz"}})


def test_a_copy_of_a_held_out_book_in_a_training_shard_is_dropped(corpus, tmp_path):
    d, shards = corpus
    for f in d.iterdir():
        if f.name != "SHA256SUMS":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    copy = shards["books-03.jsonl.xz"][-1]
    _write_xz(tmp_path / "books-01.jsonl.xz", shards["books-01.jsonl.xz"] + [copy])
    p = prepare_data(_cfg(tmp_path), out_dir=tmp_path / "p", progress=False)
    assert {s["name"]: s["dropped_docs"] for s in p.meta["shards"]}["books-01.jsonl.xz"] == 1
    assert copy["text"] not in _segments(p, "train")


def test_tokenizer_spread_sample_covers_every_training_book(corpus, tmp_path):
    d, shards = corpus
    train_chars = sum(len(b["text"]) for n in ("books-01.jsonl.xz", "books-02.jsonl.xz") for b in shards[n])
    budget = train_chars // 4
    p = prepare_data(_cfg(d, tokenizer_sample="spread", tokenizer_train_chars=budget), out_dir=tmp_path / "p",
                     progress=False)
    t = p.meta["tokenizer"]["training"]
    assert t["sample"] == "spread" and t["corpus_chars"] == train_chars and t["budget_chars"] == budget
    assert t["docs"] == 2 * BOOKS_PER_SHARD  # a piece of every training book, none of the held-out ones
    assert 0.9 * budget <= t["chars"] <= budget
    # the pieces: a quarter of each book, from a place of its own (not all its first quarter)
    docs = [(b["id"], b["text"]) for b in shards["books-01.jsonl.xz"]]
    pieces = list(spread_sample(docs, budget=sum(len(x) for _, x in docs) // 4, total_chars=sum(len(x) for _, x in docs)))
    assert all(piece in text for piece, (_, text) in zip(pieces, docs))
    assert any(not text.startswith(piece) for piece, (_, text) in zip(pieces, docs))
    assert p.meta["key"] != prepare_data(_cfg(d), out_dir=tmp_path / "q", progress=False).meta["key"]


def test_unique_token_budget_refuses_a_run_that_repeats_tokens():
    fits = check_token_budget(n_blocks=100, seq_len=64, steps=25, global_batch=4, max_epochs=1)
    assert fits["epochs"] == 1.0 and fits["tokens_needed"] == fits["tokens_available"] == 6400
    with pytest.raises(ValueError, match=r"26 x 4 x 64 .*would see tokens twice.*at most 25\b"):
        check_token_budget(n_blocks=100, seq_len=64, steps=26, global_batch=4, max_epochs=1)
    assert check_token_budget(n_blocks=100, seq_len=64, steps=260, global_batch=4, max_epochs=None)["epochs"] == 10.4
    with pytest.raises(ValueError, match="max_epochs"):
        DataConfig.from_dict({"max_epochs": 0})
    order = TrainOrder(TokenBlocks(np.arange(641, dtype=np.uint16), 64), seed=0, max_epochs=1)
    assert sorted(order.block_ids(0, 10).tolist()) == list(range(10))
    with pytest.raises(ValueError, match="past data.max_epochs = 1"):
        order.block_ids(8, 3)


def _write_config(path, d, steps):
    path.write_text(f"""base: tiny
data:
  source: {d}
  shards: [books-01.jsonl.xz, books-02.jsonl.xz]
  val_books: {{shard: books-03.jsonl.xz, last: 2}}
  vocab_size: 300
  max_epochs: 1
train:
  steps: {steps}
  seq_len: 32
  global_batch: 4
  micro_batch: 4
""")
    return path


def test_the_data_command_prepares_and_checks_the_run(corpus, tmp_path, capsys):
    from twell.data.__main__ import main as data_main

    d, _ = corpus
    out = tmp_path / "p"
    assert data_main(["--config", str(_write_config(tmp_path / "ok.yaml", d, 3)), "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["run"]["tokens_needed"] == 3 * 4 * 32 and printed["val_docs"] == 2
    assert printed["tokenizer_trained_on"]["docs"] == 2 * BOOKS_PER_SHARD
    blocks = (printed["train_tokens"] - 1) // 32
    too_many = blocks // 4 + 1
    assert data_main(["--config", str(_write_config(tmp_path / "long.yaml", d, too_many)), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "would see tokens twice" in err and f"at most {blocks // 4}" in err
    # --shards replaces data.shards (one shard fewer: a different prepared directory)
    assert data_main(["--config", str(tmp_path / "ok.yaml"), "--shards", "books-01.jsonl.xz",
                      "--out", str(tmp_path / "one")]) == 0
    assert json.loads(capsys.readouterr().out)["train_docs"] == BOOKS_PER_SHARD


def test_the_book_corpus_configs_name_their_shards_and_fit_one_pass():
    from twell.train.config import load_config

    sparse, dense = load_config("0p5b_books"), load_config("0p5b_books_dense")
    for cfg in (sparse, dense):
        cfg.validate()
        assert cfg.data.source == "shared:corpus/gutenberg" and cfg.data.max_epochs == 1
        assert cfg.data.tokenizer == "train" and cfg.data.val_books["shard"] not in cfg.data.shards
        assert cfg.train.steps * cfg.tokens_per_step >= 40_000_000
        assert (cfg.model.hidden_size, cfg.model.intermediate_size, cfg.model.num_layers) == (2048, 5632, 8)
    assert sparse.data == dense.data and sparse.train == dense.train  # one prepared dataset, the same run
    assert sparse.sparsity.l1_coef == 2e-5 and dense.sparsity.l1_coef == 0.0
    # Prepared with this config: 10.85M to 11.13M training tokens per shard (43.86M for the four): they hold
    # the run, which python -m twell.data checks exactly (data.max_epochs 1)
    assert len(sparse.data.shards) * 10_800_000 >= sparse.train.steps * sparse.tokens_per_step


REAL = shared_data_dir() / "corpus" / "gutenberg" if shared_data_dir() is not None else None


@pytest.mark.skipif(REAL is None or not REAL.is_dir(), reason="offline data corpus/gutenberg not present")
def test_real_gutenberg_shards_stream_and_match_their_checksums():
    from twell.data.shards import read_shard_index

    index = read_shard_index(REAL)
    assert len(index) == 12 and sum(s["books"] for s in index.values()) == 1607
    last = f"gutenberg-{len(index):02d}.jsonl.xz"
    assert verify_checksums([REAL / last])[last]["verified"]
    src = resolve_source("shared:corpus/gutenberg", shards=[last])
    first = next(iter_documents(src))
    assert first[0].startswith("pg-uga/") and len(first[1]) > 1000
