"""twell.data: sources, smoke corpus, tokenizer choice, token files, deterministic sharded batches."""
import json
import random
import re
import shutil

import numpy as np
import pytest
import torch

from twell.data import (DataConfig, PreparedData, TokenBlocks, TrainOrder, build_smoke_corpus, iter_documents,
                        network_allowed, prepare_data, resolve_source, resolve_tokenizer, val_shards)

WORDS = ("sparse dense neuron token layer model train gate relu value kernel tile matrix row column vector "
         "python docs fixture the a of and to in is").split()


def _docs(n, rng):
    """Fixture documents (random English-like word salad), clearly not a real corpus."""
    return [{"id": f"fixture-{i}", "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))}
            for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(1234)
    d = tmp_path_factory.mktemp("corpus")
    docs = _docs(120, rng)
    with (d / "docs.jsonl").open("w") as f:
        for doc in docs:
            f.write(json.dumps(doc) + "\n")
    return d, docs


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    d, _ = corpus
    return prepare_data(DataConfig(source=str(d / "docs.jsonl"), vocab_size=320, val_fraction=0.2),
                        out_dir=tmp_path_factory.mktemp("prep") / "p", progress=False)


def test_smoke_corpus_is_labelled_and_reproducible(tmp_path):
    a = build_smoke_corpus(tmp_path / "a.jsonl")
    b = build_smoke_corpus(tmp_path / "b.jsonl")
    assert a.read_bytes() == b.read_bytes()
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert sum(len(r["text"]) for r in rows) >= 100_000 and all(r["source"] == "smoke" for r in rows)
    from twell.data import SMOKE_LABEL

    assert "smoke corpus" in SMOKE_LABEL and "not FineWeb-Edu" in SMOKE_LABEL


def test_jsonl_parquet_txt_give_the_same_documents(tmp_path, corpus):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, docs = corpus
    docs = docs[:7]
    pq.write_table(pa.table({"id": [d["id"] for d in docs], "text": [d["text"] for d in docs]}), tmp_path / "d.parquet")
    txt = tmp_path / "txt"
    txt.mkdir()
    for i, d in enumerate(docs):
        (txt / f"{i:02d}.txt").write_text(d["text"])
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    want = [d["text"] for d in docs]
    for spec in (tmp_path / "d.jsonl", tmp_path / "d.parquet", txt):
        got = [t for _, t in iter_documents(resolve_source(str(spec)))]
        assert got == want, spec
    ids = [i for i, _ in iter_documents(resolve_source(str(tmp_path / "d.parquet")))]
    assert ids == [d["id"] for d in docs]
    assert len(list(iter_documents(resolve_source(str(tmp_path / "d.jsonl")), max_docs=3))) == 3


def test_bad_sources_raise(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_source(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported data file"):
        resolve_source(str(tmp_path / "x.csv"))
    (tmp_path / "bad.jsonl").write_text('{"body": "no text field"}\n')
    with pytest.raises(ValueError, match="'text' field"):
        list(iter_documents(resolve_source(str(tmp_path / "bad.jsonl"))))
    with pytest.raises(ValueError, match="val_fraction"):
        DataConfig.from_dict({"val_fraction": 0})
    with pytest.raises(ValueError, match="unknown key"):
        DataConfig.from_dict({"sorce": "smoke"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="network is not allowed"):
        next(iter_documents(resolve_source("fineweb-edu"), allow_network=True))


def test_network_policy(monkeypatch):
    for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TWELL_ALLOW_NETWORK"):
        monkeypatch.delenv(v, raising=False)
    assert network_allowed() is False  # default offline
    assert network_allowed(True) is True
    monkeypatch.setenv("TWELL_ALLOW_NETWORK", "1")
    assert network_allowed() is True and network_allowed(False) is False
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert network_allowed(True) is False  # the HF offline variables always win


def test_tokenizer_choice_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    texts = lambda: (" ".join(random.choices(WORDS, k=50)) for _ in range(200))  # noqa: E731
    with pytest.raises(RuntimeError, match="not in the local Hugging Face cache"):
        resolve_tokenizer("hub", hub_name="twell-tests/not-cached-tokenizer", train_texts=texts)
    tok, choice = resolve_tokenizer("auto", hub_name="twell-tests/not-cached-tokenizer", vocab_size=300,
                                    train_texts=texts, trained_on="fixture")
    assert choice.kind == "trained" and "unavailable" in choice.reason and choice.trained_on == "fixture"
    assert len(tok) == choice.vocab_size <= 300 and tok.decode(tok.encode("sparse relu gate")) == "sparse relu gate"
    with pytest.raises(ValueError, match="data.tokenizer must be"):
        resolve_tokenizer("/nonexistent/tokenizer/dir")


def test_prepared_files_pack_documents_with_eos(prepared, corpus):
    _, docs = corpus
    meta = prepared.meta
    assert prepared.dtype == np.uint16 and meta["tokenizer"]["kind"] == "trained"
    tok = prepared.tokenizer()
    eos = prepared.eos_id
    train, val = prepared.tokens("train"), prepared.tokens("val")
    assert len(train) == meta["n_train_tokens"] and len(val) == meta["n_val_tokens"]
    assert int((train == eos).sum()) == meta["n_train_docs"] and int((val == eos).sum()) == meta["n_val_docs"]
    assert meta["n_train_docs"] + meta["n_val_docs"] == len(docs) and meta["n_val_docs"] > 0
    # The token stream is the documents in order, each followed by EOS; validation documents are not in it.
    first_end = int(np.argmax(train == eos))
    decoded_first = tok.decode(train[:first_end].tolist())
    train_texts = [d["text"] for d in docs]
    assert decoded_first in train_texts
    val_texts = {tok.decode(seg.tolist()) for seg in np.split(val, np.where(val == eos)[0] + 1) if len(seg) > 1
                 for seg in [seg[:-1]]}
    train_set = {tok.decode(seg[:-1].tolist()) for seg in np.split(train, np.where(train == eos)[0] + 1) if len(seg)}
    assert val_texts and not (val_texts & train_set)
    assert meta["max_token_id"] < prepared.vocab_size


def test_prepare_is_cached_and_deterministic(prepared, corpus, tmp_path):
    d, _ = corpus
    cfg = DataConfig(source=str(d / "docs.jsonl"), vocab_size=320, val_fraction=0.2)
    again = prepare_data(cfg, out_dir=prepared.dir, progress=False)
    assert again.meta == prepared.meta  # reused, not rebuilt
    fresh = prepare_data(cfg, out_dir=tmp_path / "fresh", progress=False)
    assert fresh.meta["key"] == prepared.meta["key"]
    assert fresh.train_path.read_bytes() == prepared.train_path.read_bytes()
    assert fresh.val_path.read_bytes() == prepared.val_path.read_bytes()
    assert PreparedData.load(fresh.dir).vocab_size == prepared.vocab_size
    # A prepared directory given as the source is used as is.
    assert prepare_data(str(fresh.dir)).dir == fresh.dir


def test_prepare_keeps_quoted_special_tokens_as_text_and_stops_at_max_tokens(corpus, tmp_path, monkeypatch):
    """A document that quotes the EOS string stays one document (one EOS, its text decodes back), and
    data.max_tokens stops at the document that reaches it, not at the end of a 256-document batch."""
    monkeypatch.setenv("TWELL_CACHE", str(tmp_path / "cache"))
    _, docs = corpus
    quoted = [dict(d, text=f"{d['text']} <|endoftext|> {d['text']}") if i % 3 == 0 else d for i, d in enumerate(docs)]
    src = tmp_path / "quoted.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in quoted))
    p = prepare_data(DataConfig(source=str(src), vocab_size=320, val_fraction=0.2), progress=False)
    assert p.eos_id == p.tokenizer().convert_tokens_to_ids("<|endoftext|>")
    train, val = p.tokens("train"), p.tokens("val")
    assert int((train == p.eos_id).sum()) == p.meta["n_train_docs"] and int((val == p.eos_id).sum()) == p.meta["n_val_docs"]
    assert p.meta["n_train_docs"] + p.meta["n_val_docs"] == len(docs)
    first = p.tokenizer().decode(train[:int(np.argmax(train == p.eos_id))].tolist())
    assert first in {d["text"] for d in quoted}
    # The saved tokenizer still maps the string to EOS (lm-eval and users see the usual tokenizer).
    assert p.tokenizer()("<|endoftext|>", add_special_tokens=False)["input_ids"] == [p.eos_id]
    full = p.meta["n_train_tokens"]
    capped = prepare_data(DataConfig(source=str(src), vocab_size=320, val_fraction=0.2, max_tokens=full // 10),
                          progress=False)
    per_doc = full / p.meta["n_train_docs"]
    assert full // 10 <= capped.meta["n_train_tokens"] < full // 10 + 4 * per_doc


def test_prepared_data_follows_a_tokenizer_replaced_in_place(corpus, tmp_path, monkeypatch):
    """data.tokenizer=<dir>: the cache is keyed on the tokenizer's content, not its path."""
    from twell.data import train_bpe

    monkeypatch.setenv("TWELL_CACHE", str(tmp_path / "cache"))
    d, docs = corpus
    tok_dir = tmp_path / "tok"
    train_bpe([x["text"] for x in docs], 300).save_pretrained(str(tok_dir))
    cfg = DataConfig(source=str(d / "docs.jsonl"), tokenizer=str(tok_dir), val_fraction=0.2)
    first = prepare_data(cfg, progress=False)
    assert prepare_data(cfg, progress=False).dir == first.dir  # unchanged: reused
    shutil.rmtree(tok_dir)
    train_bpe([x["text"] for x in docs], 340).save_pretrained(str(tok_dir))
    again = prepare_data(cfg, progress=False)
    assert again.dir != first.dir and again.vocab_size == 340 != first.vocab_size


def test_prepare_replaces_only_empty_or_prepared_folders(corpus, tmp_path, capsys):
    from twell.data.__main__ import main as data_main

    d, _ = corpus
    mine = tmp_path / "mine"  # a folder of the user's, named as data.prepared_dir / --out by mistake
    mine.mkdir()
    shutil.copy(d / "docs.jsonl", mine / "docs.jsonl")
    (mine / "notes.txt").write_text("keep me\n")
    cfg = DataConfig(source=str(mine / "docs.jsonl"), vocab_size=320, val_fraction=0.2, prepared_dir=str(mine))
    with pytest.raises(FileExistsError, match=rf"{re.escape(str(mine))}\b.*not a prepared data directory"):
        prepare_data(cfg, progress=False)
    assert sorted(p.name for p in mine.iterdir()) == ["docs.jsonl", "notes.txt"]
    assert data_main(["--config", "tiny", "--data", str(mine / "docs.jsonl"), "--out", str(mine)]) == 2
    assert "not a prepared data directory" in capsys.readouterr().err
    assert sorted(p.name for p in mine.iterdir()) == ["docs.jsonl", "notes.txt"]
    # An empty folder is filled; a prepared folder made with other settings is rebuilt in place.
    (tmp_path / "empty").mkdir()
    first = prepare_data(DataConfig(source=str(d / "docs.jsonl"), vocab_size=320, val_fraction=0.2),
                         out_dir=tmp_path / "empty", progress=False)
    again = prepare_data(DataConfig(source=str(d / "docs.jsonl"), vocab_size=320, val_fraction=0.3),
                         out_dir=first.dir, progress=False)
    assert again.dir == first.dir and again.meta["key"] != first.meta["key"]


def test_truncated_token_file_is_detected(prepared, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(prepared.dir, broken)
    with open(broken / "train.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match="meta.json promises"):
        PreparedData.load(broken)


def test_blocks_and_targets():
    tokens = np.arange(1000, dtype=np.uint16)
    L = random.randint(5, 40)
    blocks = TokenBlocks(tokens, L)
    assert blocks.n_blocks == 999 // L
    ids = np.array([0, blocks.n_blocks - 1, 3])
    x, y = blocks.get(ids)
    assert x.dtype == torch.int64 and x.shape == (3, L)
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x[0, 0]) == 0 and int(x[1, 0]) == (blocks.n_blocks - 1) * L
    with pytest.raises(ValueError, match="fewer than one block"):
        TokenBlocks(np.arange(5, dtype=np.uint16), 8)


def test_train_order_is_a_permutation_per_epoch_and_deterministic():
    blocks = TokenBlocks(np.arange(10_000, dtype=np.uint16), 37)
    n = blocks.n_blocks
    a, b = TrainOrder(blocks, seed=3), TrainOrder(blocks, seed=3)
    ids = a.block_ids(0, 3 * n)
    assert np.array_equal(ids, b.block_ids(0, 3 * n))
    for e in range(3):
        assert sorted(ids[e * n:(e + 1) * n].tolist()) == list(range(n))
    assert not np.array_equal(ids[:n], ids[n:2 * n])  # reshuffled each epoch
    assert not np.array_equal(ids[:n], TrainOrder(blocks, seed=4).block_ids(0, n))
    start = random.randint(0, 2 * n)  # any window of the order can be asked for directly (resume)
    assert np.array_equal(a.block_ids(start, 50), ids[start:start + 50])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_and_micro_batches_cover_the_global_batch(world):
    blocks = TokenBlocks(np.arange(20_000, dtype=np.uint16), 16)
    order = TrainOrder(blocks, seed=0)
    gb, mb = 16, 2
    accum = gb // (world * mb)
    for step in (0, 7, 123):
        got = [order.micro_batch(step, m, rank=r, world=world, micro_batch=mb, global_batch=gb)[0]
               for r in range(world) for m in range(accum)]
        single = [order.micro_batch(step, m, rank=0, world=1, micro_batch=mb, global_batch=gb)[0]
                  for m in range(gb // mb)]
        key = lambda xs: sorted(tuple(row.tolist()) for x in xs for row in x)  # noqa: E731
        assert key(got) == key(single)


def test_val_shards_equal_on_every_rank():
    blocks = TokenBlocks(np.arange(3000, dtype=np.uint16), 10)
    per_rank = [list(val_shards(blocks, max_tokens=None, rank=r, world=3, micro_batch=4)) for r in range(3)]
    assert len({len(p) for p in per_rank}) == 1
    seen = sorted(int(x[i, 0]) for p in per_rank for x, _ in p for i in range(x.shape[0]))
    assert len(seen) == len(set(seen)) == (blocks.n_blocks // 12) * 12
    with pytest.raises(ValueError, match="validation split"):
        list(val_shards(TokenBlocks(np.arange(50, dtype=np.uint16), 10), max_tokens=None, rank=0, world=2,
                        micro_batch=4))


def test_prepare_keeps_a_copy_another_process_finished_first(corpus, tmp_path, monkeypatch):
    """Two runs preparing the same data at once (train_small_gpu.sh both): the one that finishes second
    keeps the first one's folder, which the first may already be reading, instead of replacing it."""
    import twell.data.prepare as prep

    d, _ = corpus
    cfg = DataConfig(source=str(d / "docs.jsonl"), vocab_size=320, val_fraction=0.2)
    target = tmp_path / "p"
    first = prepare_data(cfg, out_dir=target, progress=False)
    ino = first.train_path.stat().st_ino
    source = prep.resolve_source(cfg.source)
    again = prep._prepare(cfg, source, 320, first.meta["key"], target, progress=False)  # the slower peer
    assert again.dir == target and again.train_path.stat().st_ino == ino
    assert not list(tmp_path.glob(".p.*.tmp"))


def test_cache_dir_reads_twell_cache_like_the_other_paths(tmp_path, monkeypatch):
    """TWELL_CACHE: ~ expanded; empty means the default (data/cache), not the current directory."""
    from twell.paths import cache_dir, repo_root

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TWELL_CACHE", "~/cache")
    assert cache_dir("tok", create=False) == tmp_path / "cache" / "tok"
    monkeypatch.setenv("TWELL_CACHE", "")
    assert cache_dir("tok", create=False) == repo_root() / "data" / "cache" / "tok"
