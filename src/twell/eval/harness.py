"""Run lm-eval on a model object: the paper's zero-shot tasks, local or hub data, one record per run.

The model object itself is handed to lm-eval's ``HFLM`` wrapper, so whatever FFN modules it holds
(dense, the pure-PyTorch TwELL reference, the CUDA kernels) are what gets evaluated; the FFN path
that actually ran is read back from the modules and stored in the record. Metrics and standard
errors are lm-eval's own (``acc``/``acc_norm`` with the closed-form standard error of a mean).

Progress is one bar (:mod:`twell.progress`), advanced by lm-eval's requests as they finish; while
lm-eval runs, its own bars and those of ``datasets`` are off, the libraries' loggers are at WARNING,
and lm-eval's warnings that say nothing to the reader are dropped (see :func:`quiet_lm_eval`).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import math
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch

from twell.eval.loading import (SPARSE_LAST_PATHS, LoadedModel, check_ffn_path, fixture_model, forget_ffn_paths,
                                load_checkpoint, observed_ffn_paths, set_ffn_path)
from twell.eval.offline import hf_offline, resolve_offline
from twell.eval.tasks import AUTO, PAPER_TASKS, build_tasks, resolve_task_sources

# lm-eval's "auto" batch size doubles down from max_batch_size on CUDA out-of-memory errors; on a
# CPU there is no such signal (it would just swap), so a fixed size is used there.
CPU_BATCH_SIZE = 8
METRICS = ("acc", "acc_norm")
# Loggers held at WARNING while lm-eval runs (their INFO lines are lm-eval's and the libraries' bookkeeping).
QUIET_LOGGERS = ("lm_eval", "transformers", "datasets", "huggingface_hub", "accelerate")
# lm-eval's warnings about what the harness does on purpose (a model object, in one process): nothing to act on.
_EXPECTED_LM_EVAL_WARNINGS = ("`pretrained` model kwarg is not of type `str`",
                              "Passed an already-initialized model through `pretrained`")
# lm-eval warns once per request cut to the model's context; these are counted and reported once.
_TRUNCATION = re.compile(r"Combined length of context .* exceeds model's maximum length \((\d+)\)")


class _LmEvalLog(logging.Filter):
    """On lm-eval's HF model logger: drops the expected warnings, counts the truncated requests."""

    def __init__(self) -> None:
        super().__init__()
        self.truncated = 0
        self.max_length: int | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(_EXPECTED_LM_EVAL_WARNINGS):
            return False
        cut = _TRUNCATION.match(message)
        if cut:
            self.truncated += 1
            self.max_length = int(cut.group(1))
            return False
        return True

    def truncation_note(self, n_requests: int | None = None) -> str | None:
        """One sentence for the truncated requests, or None when there were none."""
        if not self.truncated:
            return None
        of = f" of {n_requests}" if n_requests else ""
        return (f"{self.truncated}{of} lm-eval requests were longer than the model's context of {self.max_length} "
                f"tokens and were scored on their last {self.max_length} tokens (lm-eval cuts from the left)")


def warn_caller(message: str) -> None:
    """A UserWarning shown at the first caller outside ``twell.eval`` (a notebook cell, a script)."""
    here = Path(__file__).resolve().parent
    level, frame = 2, sys._getframe(1)
    while frame is not None and Path(frame.f_code.co_filename).resolve().parent == here:
        level, frame = level + 1, frame.f_back
    warnings.warn(message, stacklevel=level)


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[_LmEvalLog]:
    """While lm-eval builds and runs tasks: its and the libraries' INFO logging, its warnings about a model
    object, its per-task bars and ``datasets``' bars are off; everything is restored on exit.

    Yields the filter on lm-eval's HF model logger; its ``truncation_note()`` sums up the requests cut to
    the model's context (lm-eval warns once per request). Warnings from lm-eval or the libraries
    that do not match these are kept.
    """
    import datasets
    import lm_eval.api.task as lm_eval_task
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from tqdm import tqdm as text_tqdm

    levels = {}
    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.WARNING:
            levels[logger] = logger.level
            logger.setLevel(logging.WARNING)
    log = _LmEvalLog()
    hf_logger = logging.getLogger("lm_eval.models.huggingface")
    hf_logger.addFilter(log)
    # HF_DATASETS_DISABLE_PROGRESS_BARS=0 asks for the bars (datasets would warn on disabling them).
    own_datasets_bars = (not are_progress_bars_disabled()
                         and datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS is not False)
    if own_datasets_bars:
        disable_progress_bars()
    # Task.build_all_requests draws a text bar per task and has no option to turn it off.
    task_tqdm = getattr(lm_eval_task, "tqdm", None)
    if task_tqdm is text_tqdm:
        lm_eval_task.tqdm = functools.partial(text_tqdm, disable=True)
    try:
        yield log
    finally:
        if task_tqdm is text_tqdm:
            lm_eval_task.tqdm = task_tqdm
        if own_datasets_bars:
            enable_progress_bars()
        hf_logger.removeFilter(log)
        for logger, level in levels.items():
            logger.setLevel(level)


@functools.cache
def _progress_hflm() -> type:
    from lm_eval.api.model import CacheHook
    from lm_eval.models.huggingface import HFLM

    class BarHook(CacheHook):
        """lm-eval calls ``add_partial`` once per finished request: one step of the bar."""

        def __init__(self, bar) -> None:
            super().__init__(None)
            self.bar = bar

        def add_partial(self, attr, req, res) -> None:
            self.bar.update(1)

    class ProgressHFLM(HFLM):
        """lm-eval's HFLM without its own bars: each call restarts ``bar`` at its number of requests."""

        def __init__(self, *args, bar=None, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.bar = bar
            self.n_requests = 0
            if bar is not None:
                self.set_cache_hook(BarHook(bar))

        def _restart(self, requests) -> None:
            self.n_requests += len(requests)
            if self.bar is not None:
                self.bar.reset(total=len(requests))

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            self._restart(requests)
            return super().loglikelihood(requests, disable_tqdm=True)

        def generate_until(self, requests, disable_tqdm: bool = False):
            self._restart(requests)
            return super().generate_until(requests, disable_tqdm=True)

    return ProgressHFLM


def lm_eval_model(model: torch.nn.Module, tokenizer: Any, *, bar=None, **kwargs):
    """lm-eval's ``HFLM`` around a model object (``kwargs`` are HFLM's); with ``bar`` (a tqdm), its
    log-likelihood and generation calls advance that bar per request instead of drawing bars of their own."""
    return _progress_hflm()(pretrained=model, tokenizer=tokenizer, backend="causal", bar=bar, **kwargs)


@contextlib.contextmanager
def request_bar(progress: Any, desc: str) -> Iterator[Any]:
    """``progress``: a bar to use as it is, or True / False for a bar of our own (closed on exit)."""
    if progress is not None and not isinstance(progress, bool):
        yield progress
        return
    from twell.progress import progress_bar

    bar = progress_bar(progress=bool(progress), desc=desc, unit="request")
    try:
        yield bar
    finally:
        bar.close()


@dataclass
class TaskResult:
    """One task of one run. ``status`` is ``"ok"`` or ``"skipped"`` (then ``reason`` says why)."""

    task: str
    status: str
    source: str = ""  # "local", "hub" or "fixture-data" (FIXTURE files: the score means nothing)
    reason: str = ""
    files: dict[str, str | list[str]] = field(default_factory=dict)  # split -> path, or its parquet shards
    dropped_splits: list[str] = field(default_factory=list)
    n: int | None = None  # documents scored
    n_total: int | None = None  # documents in the scored split
    num_fewshot: int | None = None
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # {"acc": {"value", "stderr"}}
    # With log_samples: per document {"doc_id", "loglikelihoods": [per choice], "acc", "acc_norm"?}.
    samples: list[dict[str, Any]] | None = None


@dataclass
class EvalRun:
    """Everything needed to read (and re-create) one model's evaluation."""

    name: str
    source: str
    loader: str
    ffn_path: str | None
    ffn_paths_observed: dict[str, int]
    device: str
    dtype: str
    batch_size: str
    batch_size_note: str
    limit: int | float | None
    offline: bool
    fixture: bool
    notes: list[str]
    versions: dict[str, str]
    seconds: float
    tasks: dict[str, TaskResult]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EvalRun":
        data = dict(data)
        data["tasks"] = {k: TaskResult(**v) for k, v in data["tasks"].items()}
        return cls(**data)

    def save_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str))
        return path

    @classmethod
    def load_json(cls, path: str | Path) -> "EvalRun":
        """Read an EvalRun JSON, plain or gzipped (``.json.gz``: the committed seven-task logs, a few MB each)."""
        path = Path(path)
        if path.suffix == ".gz":
            import gzip

            with gzip.open(path, "rt") as f:
                return cls.from_dict(json.load(f))
        return cls.from_dict(json.loads(path.read_text()))


def check_limit(limit) -> None:
    """``limit``: None (everything), a count >= 1, or a fraction in (0, 1) as in lm-eval; else ValueError."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0
                              or (limit >= 1 and limit != int(limit))):
        raise ValueError(f"limit must be None, a whole number of documents >= 1, or a fraction in (0, 1); got {limit!r}")


def choose_batch_size(batch_size: int | str, device: str) -> tuple[int | str, str]:
    """(batch size for HFLM, a sentence saying how it was chosen)."""
    if isinstance(batch_size, str) and batch_size.startswith("auto"):
        if str(device).startswith("cuda"):
            return batch_size, "lm-eval auto batch size (largest that fits, searched down from max_batch_size)"
        return CPU_BATCH_SIZE, f"fixed {CPU_BATCH_SIZE} on CPU (lm-eval's auto search needs CUDA out-of-memory errors)"
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1 or 'auto', got {batch_size!r}")
    return int(batch_size), f"fixed {int(batch_size)} (requested)"


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):  # lm-eval writes "N/A" when a stderr cannot be computed
        return math.nan


def _versions() -> dict[str, str]:
    import datasets
    import lm_eval
    import transformers

    return {"lm_eval": getattr(lm_eval, "__version__", "?"), "transformers": transformers.__version__,
            "torch": torch.__version__, "datasets": datasets.__version__}


def evaluate_model(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    name: str = "model",
    tasks: Iterable[str] = PAPER_TASKS,
    data_dir: str | Path | None = AUTO,
    data_files: Mapping[str, Any] | None = None,
    limit: int | float | None = None,
    batch_size: int | str = "auto",
    max_batch_size: int = 64,
    offline: bool | None = None,
    num_fewshot: int = 0,
    ffn_path: str | None = None,
    source: str = "<model object>",
    loader: str = "caller",
    fixture: bool = False,
    notes: Iterable[str] = (),
    softmax_dtype: str | None = None,
    log_samples: bool = False,
    progress: Any = True,
) -> EvalRun:
    """Evaluate a causal LM object with lm-eval on ``tasks`` (zero-shot by default).

    model/tokenizer: any transformers causal LM and its tokenizer, already on its device.
    ffn_path: when given, set on the project's FFN modules first and verified after the run.
    limit: documents per task (lm-eval's ``limit``; for smoke runs only). Tasks without data are
    returned with status "skipped" and the reason, never with a score.
    softmax_dtype: lm-eval's HFLM option (None = the model's dtype, lm-eval's default).
    log_samples: keep per-document log-likelihoods and 0/1 scores (for paired comparisons).
    progress: True for a progress bar over lm-eval's requests (off where ``TQDM_DISABLE`` is set), False
        for none, or a tqdm bar to restart and advance (:func:`evaluate_checkpoints` passes one).
    """
    from lm_eval import simple_evaluate

    check_limit(limit)
    start = time.perf_counter()
    offline = resolve_offline(offline)
    sources = resolve_task_sources(tasks, data_dir=data_dir, data_files=data_files, num_fewshot=num_fewshot)
    if ffn_path is not None:
        set_ffn_path(model, ffn_path)
    forget_ffn_paths(model)
    device = str(next(model.parameters()).device)
    bs, bs_note = choose_batch_size(batch_size, device)

    results: dict[str, Any] = {"results": {}, "n-samples": {}, "configs": {}, "config": {}}
    lm = None
    with quiet_lm_eval() as log, request_bar(progress, f"evaluating {name}") as bar:
        built = build_tasks(sources, offline=offline)
        if built.tasks:
            lm = lm_eval_model(model, tokenizer, bar=bar, batch_size=bs, max_batch_size=max_batch_size,
                               softmax_dtype=softmax_dtype)
            with hf_offline(offline):
                # num_fewshot=None lets lm-eval apply its own default of 0 shots without warning about an override.
                results = simple_evaluate(lm, tasks=list(built.tasks.values()), task_manager=built.task_manager,
                                          limit=limit, num_fewshot=num_fewshot or None, log_samples=log_samples)
    used = results["config"].get("batch_sizes") or []
    if used:
        bs_note += f"; lm-eval chose {used}"
    truncated = log.truncation_note(lm.n_requests if lm is not None else None)
    if truncated:
        notes = [*notes, truncated]
        warn_caller(f"{name}: {truncated}")
    # With every task skipped no forward ran: there is no path to check (the skipped tasks are the result).
    observed = check_ffn_path(model, ffn_path) if built.tasks else observed_ffn_paths(model)
    if ffn_path == "auto" and observed and not set(observed) & SPARSE_LAST_PATHS:
        from twell.model import sparse_ffns

        why = sorted({f.auto_note for f in sparse_ffns(model) if f.auto_note})
        notes = [*notes, f"FFN path 'auto' ran every SparseFFN dense ({observed}): "
                         + ("; ".join(why) if why else "no reason recorded by the layers")]
        warnings.warn(f"{name}: {notes[-1]}", stacklevel=2)

    out: dict[str, TaskResult] = {}
    for src in sources:
        if src.task in built.skipped:
            out[src.task] = TaskResult(src.task, "skipped", src.kind, reason=built.skipped[src.task])
            continue
        res = results["results"][src.task]
        counts = results["n-samples"].get(src.task, {})
        shots = results["configs"].get(src.task, {}).get("num_fewshot")
        if shots != num_fewshot:
            raise RuntimeError(f"task {src.task!r} ran with num_fewshot={shots}, expected {num_fewshot}")
        metrics = {m: {"value": _float(res[f"{m},none"]), "stderr": _float(res.get(f"{m}_stderr,none"))}
                   for m in METRICS if f"{m},none" in res}
        samples = None
        if log_samples:
            samples = [{"doc_id": int(d["doc_id"]), "loglikelihoods": [float(r[0]) for r in d["filtered_resps"]],
                        **{m: float(d[m]) for m in metrics if m in d}}
                       for d in sorted(results["samples"][src.task], key=lambda d: d["doc_id"])]
        out[src.task] = TaskResult(src.task, "ok", "fixture-data" if src.fixture else src.kind, reason=src.note, files=dict(src.files),
                                   dropped_splits=list(src.dropped_splits), n=counts.get("effective"),
                                   n_total=counts.get("original"), num_fewshot=shots, metrics=metrics,
                                   samples=samples)
    return EvalRun(
        name=name, source=source, loader=loader, ffn_path=ffn_path, ffn_paths_observed=observed,
        device=device, dtype=str(next(model.parameters()).dtype).replace("torch.", ""), batch_size=str(bs),
        batch_size_note=bs_note, limit=limit, offline=offline, fixture=fixture, notes=list(notes),
        versions=_versions(), seconds=round(time.perf_counter() - start, 2), tasks=out,
    )


def evaluate_loaded(loaded: LoadedModel, **kwargs) -> EvalRun:
    """:func:`evaluate_model` for a :class:`LoadedModel`, carrying over its provenance."""
    return evaluate_model(loaded.model, loaded.tokenizer, name=loaded.name, ffn_path=loaded.ffn_path,
                          source=loaded.source, loader=loaded.loader, fixture=loaded.fixture,
                          notes=loaded.notes, **kwargs)


def _repo_relative(path: Any) -> Any:
    """A relative checkpoint path is taken from the repository root when it exists there."""
    if path is None:
        return None
    from twell.paths import repo_root

    candidate = repo_root() / str(path)
    return str(candidate) if not Path(str(path)).is_absolute() and candidate.exists() else str(path)


def load_named(name: str, spec: str | Mapping[str, Any] | None, *, ffn_paths: Mapping[str, str] | None = None,
               ffn_path: str | None = None, device: str | None = None, dtype: str | None = None,
               fixture_if_missing: bool = False, offline: bool | None = None) -> LoadedModel:
    """Load one entry of a ``checkpoints`` mapping (see :func:`evaluate_checkpoints`)."""
    spec = {"path": spec} if not isinstance(spec, Mapping) else dict(spec)
    if "path" not in spec:
        raise ValueError(f"checkpoint {name!r}: expected a path or a mapping with 'path', got {spec!r}")
    path = _repo_relative(spec["path"])
    ffn_path = (ffn_path or spec.get("ffn_path") or (ffn_paths or {}).get(name)
                or ("dense" if "dense" in name else "auto"))
    dtype = spec.get("dtype", dtype)
    if fixture_if_missing and (path is None or not Path(path).expanduser().exists()):
        message = (f"checkpoint {name!r} not found at {path}: evaluating a FIXTURE tiny random model instead "
                   "(smoke run; the numbers below are not results)")
        warnings.warn(message, stacklevel=3)
        print(f"!!! {message}")
        return fixture_model(name, ffn_path=ffn_path, device=device, dtype=dtype or "bfloat16")
    if path is None:
        raise ValueError(f"checkpoint {name!r} has no path")
    return load_checkpoint(path, name=name, ffn_path=ffn_path, device=device, dtype=dtype,
                           loader=spec.get("loader", "auto"), offline=offline)


def fixture_data_files(tasks: Iterable[str], *, data_dir: str | Path | None = AUTO,
                       data_files: Mapping[str, Any] | None = None, root: str | Path | None = None) -> dict[str, Any]:
    """``data_files`` entries pointing at FIXTURE files for the tasks that have no local data.

    For smoke runs offline: every task then runs through lm-eval, and its result is marked
    ``source="fixture-data"`` (the score means nothing). Files go to ``root`` (default
    ``<cache>/eval/fixture_data``).
    """
    from twell.eval.fixtures import write_fixture_task_data
    from twell.paths import cache_dir

    sources = resolve_task_sources(tasks, data_dir=data_dir, data_files=data_files)
    missing = [s.task for s in sources if s.kind == "hub"]
    if not missing:
        return {}
    root = write_fixture_task_data(Path(root) if root is not None else cache_dir("eval", "fixture_data"))
    return {s.task: dict(s.files) for s in resolve_task_sources(missing, data_dir=root)}


def with_fixture_data(tasks: Iterable[str], *, data_dir: str | Path | None = AUTO,
                      data_files: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``data_files`` plus FIXTURE files for every task without local data, announced loudly."""
    extra = fixture_data_files(tasks, data_dir=data_dir, data_files=data_files)
    if extra:
        message = f"no local data for {sorted(extra)}: using FIXTURE task files for them (smoke run, not results)"
        warnings.warn(message, stacklevel=3)
        print(f"!!! {message}")
    return {**extra, **(data_files or {})}


def evaluate_checkpoints(
    checkpoints: Mapping[str, str | Mapping[str, Any]],
    *,
    tasks: Iterable[str] = PAPER_TASKS,
    data_dir: str | Path | None = AUTO,
    data_files: Mapping[str, Any] | None = None,
    ffn_paths: Mapping[str, str] | None = None,
    device: str | None = None,
    dtype: str | None = None,
    fixture_if_missing: bool = False,
    fixture_data_if_missing: bool = False,
    offline: bool | None = None,
    progress: bool = True,
    **eval_kwargs,
) -> dict[str, EvalRun]:
    """Load and evaluate each named checkpoint in turn (one model in memory at a time).

    checkpoints: ``{name: path_or_hub_id}`` or ``{name: {"path": ..., "ffn_path": ..., "loader": ..., "dtype": ...}}``;
        a relative path is looked up under the repository root first.
    ffn_paths: ``{name: path}``; default ``"dense"`` for a name containing "dense", else ``"auto"``.
    fixture_if_missing: a checkpoint path that does not exist is replaced by a FIXTURE tiny random
        model (smoke runs only; the run is marked ``fixture=True`` and a warning is printed).
    fixture_data_if_missing: offline, tasks without local data run on FIXTURE files instead of being
        skipped (smoke runs only; marked ``source="fixture-data"``).
    progress: one bar (see :mod:`twell.progress`) over each checkpoint's lm-eval requests in turn.
    Other keyword arguments go to :func:`evaluate_model` (limit, batch_size, log_samples, ...).
    """
    offline = resolve_offline(offline)
    tasks = list(tasks)
    if fixture_data_if_missing and offline:
        data_files = with_fixture_data(tasks, data_dir=data_dir, data_files=data_files)
    runs: dict[str, EvalRun] = {}
    with request_bar(progress, "evaluating") as bar:
        for i, (name, spec) in enumerate(checkpoints.items()):
            bar.set_description(f"evaluating {name} ({i + 1}/{len(checkpoints)})")
            loaded = load_named(name, spec, ffn_paths=ffn_paths, device=device, dtype=dtype,
                                fixture_if_missing=fixture_if_missing, offline=offline)
            runs[name] = evaluate_loaded(loaded, tasks=tasks, data_dir=data_dir, data_files=data_files,
                                         offline=offline, progress=bar, **eval_kwargs)
            del loaded
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return runs
