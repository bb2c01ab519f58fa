"""Downstream evaluation with lm-eval: the paper's seven zero-shot tasks, dense versus sparse.

- :mod:`twell.eval.tasks`: the tasks and their data source (local files of the hub schema, or the hub).
- :mod:`twell.eval.loading`: load a checkpoint, choose and verify the FFN path.
- :mod:`twell.eval.harness`: run lm-eval on a model object, one :class:`EvalRun` record per model.
- :mod:`twell.eval.compare`: same per-example log-likelihoods on two FFN paths?
- :mod:`twell.eval.tables`: dense/sparse table (CSV, markdown) and bar chart.
- :mod:`twell.eval.fixtures`: FIXTURE task files and a tiny random model for tests and smoke runs.

Importing this package does not import lm-eval (that takes seconds); the functions do.
"""
from twell.eval.errors import CheckpointLoadError, TaskDataError, TaskSchemaError, UnknownTaskError
from twell.eval.tasks import PAPER_TASKS, TASK_SPECS, resolve_task_sources, split_file_candidates

__all__ = [
    "PAPER_TASKS", "TASK_SPECS", "resolve_task_sources", "split_file_candidates",
    "CheckpointLoadError", "TaskDataError", "TaskSchemaError", "UnknownTaskError",
    "EvalRun", "TaskResult", "evaluate_model", "evaluate_loaded", "evaluate_checkpoints",
    "LoadedModel", "load_checkpoint", "fixture_model", "set_ffn_path",
    "PathComparison", "compare_paths", "comparison_table", "write_comparison",
]


def __getattr__(name):  # lazy: the harness pulls in lm-eval, transformers and datasets
    if name in ("EvalRun", "TaskResult", "evaluate_model", "evaluate_loaded", "evaluate_checkpoints"):
        from twell.eval import harness

        return getattr(harness, name)
    if name in ("LoadedModel", "load_checkpoint", "fixture_model", "set_ffn_path"):
        from twell.eval import loading

        return getattr(loading, name)
    if name in ("PathComparison", "compare_paths"):
        from twell.eval import compare

        return getattr(compare, name)
    if name in ("comparison_table", "write_comparison"):
        from twell.eval import tables

        return getattr(tables, name)
    raise AttributeError(f"module 'twell.eval' has no attribute {name!r}")
