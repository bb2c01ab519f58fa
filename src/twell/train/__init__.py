"""Sparse LLM training: the ReLU + L1 recipe, the sparsity tracker, and one loop for CPU, GPU and FSDP2.

- :func:`run` (``python -m twell.train``): train a config, return a :class:`RunResult`.
- :func:`load_config` / :class:`RunConfig`: YAML configs under configs/ with dotted overrides.
- :func:`sparse_lm_loss`, :class:`SparsityTracker`: the recipe pieces, usable on their own.
- :func:`read_metrics`: a run's JSONL log grouped by record kind (plots: ``twell.train.plots``).
"""
from twell.train.config import OptimConfig, RunConfig, SparsityConfig, TrainConfig, load_config, parse_overrides
from twell.train.loop import RunResult, Trainer, run
from twell.train.metrics import MetricsLog, read_metrics
from twell.train.recipe import l1_penalty, sparse_lm_loss
from twell.train.schedule import l1_coef_at, lr_at
from twell.train.tracker import SparsityTracker, reinit_dead_gates

__all__ = [
    "MetricsLog", "OptimConfig", "RunConfig", "RunResult", "SparsityConfig", "SparsityTracker", "TrainConfig", "Trainer",
    "l1_coef_at", "l1_penalty", "load_config", "lr_at", "parse_overrides", "read_metrics", "reinit_dead_gates", "run",
    "sparse_lm_loss",
]
