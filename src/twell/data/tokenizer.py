"""Tokenizers: the hub tokenizer the paper uses (SmolLM2's 49152-token BPE) or one trained here.

``resolve_tokenizer`` returns the tokenizer and a record of the choice (stored with the prepared
data and with every checkpoint):

- ``hub``:   load ``hub_name`` from the local Hugging Face cache, else download it when the
             network is allowed (:mod:`twell.data.network`); an error otherwise.
- ``train``: train a byte-level BPE with ``tokenizers`` on the training documents (or on another
             corpus: ``data.tokenizer_source``), at most ``data.tokenizer_train_chars`` characters of them:
             the first ones (``data.tokenizer_sample: prefix``) or an equal share of every document
             (``spread``, see :func:`spread_sample`). The record says how many documents and characters
             it saw.
- ``auto``:  ``hub`` when it can be had without breaking the offline rule, else ``train``.
- a directory path: a saved tokenizer (``tokenizer.json``), used as is.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M"
EOS = "<|endoftext|>"


@dataclass
class TokenizerChoice:
    kind: str  # hub | trained | local
    name: str
    vocab_size: int
    eos_token: str
    eos_token_id: int
    reason: str
    trained_on: str | None = None
    training: dict | None = None  # a trained tokenizer: what it saw (docs, chars, sample rule, budget)

    def to_dict(self) -> dict:
        return asdict(self)


def load_hub_tokenizer(name: str = SMOLLM2, *, allow_network: bool | None = None):
    """The hub tokenizer from the local cache, or downloaded when the network is allowed."""
    from transformers import AutoTokenizer

    from twell.data.network import network_allowed

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as cached_exc:  # not in the cache
        if not network_allowed(allow_network):
            raise RuntimeError(
                f"hub tokenizer {name!r} is not in the local Hugging Face cache and the network is not allowed "
                "(data.allow_network / TWELL_ALLOW_NETWORK=1; HF_*_OFFLINE must be unset); use data.tokenizer=train"
            ) from cached_exc
        return AutoTokenizer.from_pretrained(name)


def train_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2):
    """A byte-level BPE (GPT-2 style pre-tokenisation, ``<|endoftext|>`` = id 0) as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"expected a BPE vocab_size >= 300 (256 bytes + special + merges), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS)


SAMPLES = ("prefix", "spread")


def prefix_sample(texts: Iterable[str], budget: int) -> Iterator[str]:
    """The first ``budget`` characters of the documents, in order (the last one cut)."""
    for text in texts:
        if budget <= 0:
            return
        yield text[:budget]
        budget -= len(text)


def spread_sample(docs: Iterable[tuple[str, str]], budget: int, total_chars: int) -> Iterator[str]:
    """From every document a contiguous slice of ``budget / total_chars`` of its length (all of it when the
    budget covers the corpus), starting at a place fixed by a hash of its id and moved to a word boundary:
    the sample covers every book of a corpus whose beginnings (title pages, contents) are not typical."""
    frac = 1.0 if total_chars <= budget else budget / total_chars
    for doc_id, text in docs:
        if frac >= 1.0:
            yield text
            continue
        n = int(len(text) * frac)
        if n <= 0:
            continue
        room = len(text) - n
        start = int.from_bytes(hashlib.sha1(doc_id.encode()).digest()[:8], "big") % (room + 1)
        if start:  # begin after a space, so that the first word is whole
            space = text.find(" ", start, start + 200)
            start = space + 1 if space >= 0 else start
        yield text[start:start + n]


class _Counted:
    """An iterable of texts that counts what the trainer drew from it."""

    def __init__(self, texts: Iterable[str]):
        self.texts, self.docs, self.chars = texts, 0, 0

    def __iter__(self) -> Iterator[str]:
        for text in self.texts:
            self.docs += 1
            self.chars += len(text)
            yield text


def _choice(tok, kind: str, name: str, reason: str, trained_on: str | None = None,
            training: dict | None = None) -> TokenizerChoice:
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {name!r} has no EOS token; documents are packed with an EOS between them")
    return TokenizerChoice(kind=kind, name=name, vocab_size=len(tok), eos_token=tok.eos_token,
                           eos_token_id=int(tok.eos_token_id), reason=reason, trained_on=trained_on, training=training)


def resolve_tokenizer(mode: str, *, hub_name: str = SMOLLM2, vocab_size: int = 49152,
                      train_texts: Callable[[], Iterable[str]] | None = None, trained_on: str | None = None,
                      allow_network: bool | None = None, training: dict[str, Any] | None = None):
    """(tokenizer, TokenizerChoice) following ``mode`` (hub | train | auto | path to a tokenizer dir).

    training: facts about the training text to record (sample rule, budget); the documents and
    characters the trainer drew are counted and added.
    """
    if mode in ("hub", "auto"):
        try:
            tok = load_hub_tokenizer(hub_name, allow_network=allow_network)
            return tok, _choice(tok, "hub", hub_name, f"data.tokenizer={mode}: hub tokenizer available")
        except Exception as exc:
            if mode == "hub":
                raise
            reason = f"data.tokenizer=auto: hub tokenizer {hub_name!r} unavailable ({str(exc).splitlines()[0][:160]})"
    elif mode == "train":
        reason = "data.tokenizer=train"
    else:
        path = Path(mode).expanduser()
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"data.tokenizer must be hub, train, auto or a directory with tokenizer.json, got {mode!r}")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
        return tok, _choice(tok, "local", str(path), "data.tokenizer points at a saved tokenizer")
    if train_texts is None:
        raise ValueError("training a tokenizer needs the training documents (train_texts)")
    counted = _Counted(train_texts())
    tok = train_bpe(counted, vocab_size)
    record = {**(training or {}), "docs": counted.docs, "chars": counted.chars}
    return tok, _choice(tok, "trained", f"bpe{vocab_size}", reason, trained_on=trained_on, training=record)
