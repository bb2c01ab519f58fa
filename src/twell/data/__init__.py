"""Corpora, tokenizers and token files for training.

- :func:`prepare_data` tokenises a source (smoke corpus, FineWeb-Edu streaming, local
  .jsonl/.parquet/.txt) once into memory-mapped token files with a held-out validation split.
- :class:`TokenBlocks`, :class:`TrainOrder`, :func:`val_shards` turn those files into batches.
- :func:`resolve_tokenizer` picks the hub tokenizer or trains a BPE, recording the choice.
"""
from twell.data.loader import TokenBlocks, TrainOrder, val_shards
from twell.data.network import hf_offline_env, network_allowed
from twell.data.prepare import DataConfig, PreparedData, is_prepared_dir, prepare_data
from twell.data.smoke import SMOKE_LABEL, build_smoke_corpus
from twell.data.sources import Source, iter_documents, resolve_source
from twell.data.tokenizer import SMOLLM2, TokenizerChoice, load_hub_tokenizer, resolve_tokenizer, train_bpe

__all__ = [
    "DataConfig", "PreparedData", "SMOKE_LABEL", "SMOLLM2", "Source", "TokenBlocks", "TokenizerChoice", "TrainOrder",
    "build_smoke_corpus", "hf_offline_env", "is_prepared_dir", "iter_documents", "load_hub_tokenizer",
    "network_allowed", "prepare_data", "resolve_source", "resolve_tokenizer", "train_bpe", "val_shards",
]
