"""Corpora, tokenizers and token files for training.

- :func:`prepare_data` tokenises a source (smoke corpus, FineWeb-Edu streaming, local
  .jsonl/.jsonl.xz/.parquet/.txt, a sharded book corpus) once into memory-mapped token files with
  held-out validation documents (:mod:`twell.data.split`).
- :class:`TokenBlocks`, :class:`TrainOrder`, :func:`val_shards` turn those files into batches;
  :func:`check_token_budget` says whether a run would see a token twice (``data.max_epochs``).
- :func:`resolve_tokenizer` picks the hub tokenizer or trains a BPE, recording the choice.
"""
from twell.data.budget import check_run_budget, check_token_budget, token_budget
from twell.data.loader import TokenBlocks, TrainOrder, val_shards
from twell.data.network import hf_offline_env, network_allowed
from twell.data.prepare import DataConfig, PreparedData, is_prepared_dir, prepare_data
from twell.data.shards import iter_jsonl_xz, verify_checksums
from twell.data.smoke import SMOKE_LABEL, build_smoke_corpus
from twell.data.sources import Source, iter_documents, resolve_source
from twell.data.tokenizer import SMOLLM2, TokenizerChoice, load_hub_tokenizer, resolve_tokenizer, train_bpe

__all__ = [
    "DataConfig", "PreparedData", "SMOKE_LABEL", "SMOLLM2", "Source", "TokenBlocks", "TokenizerChoice", "TrainOrder",
    "build_smoke_corpus", "check_run_budget", "check_token_budget", "hf_offline_env", "is_prepared_dir",
    "iter_documents", "iter_jsonl_xz", "load_hub_tokenizer", "network_allowed", "prepare_data", "resolve_source",
    "resolve_tokenizer", "token_budget", "train_bpe", "val_shards", "verify_checksums",
]
