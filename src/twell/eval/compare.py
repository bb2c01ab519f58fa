"""Do two FFN paths of one checkpoint give the same per-example log-likelihoods?

The same lm-eval requests (built by the harness from a task, or given as (context, continuation)
pairs) are scored by lm-eval's ``HFLM.loglikelihood`` once per path. The tolerance follows the
project's rule (see shared/STYLE.md): measured against the dense path run in fp32, the sparse
path's error may be at most a small multiple of the error that the dense path makes in bf16 on the
same requests (``tol="auto"``), since TwELL stores activations in bf16.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from twell.eval.harness import check_limit, choose_batch_size, lm_eval_model, quiet_lm_eval, request_bar, warn_caller
from twell.eval.loading import SPARSE_LAST_PATHS, check_ffn_path, set_ffn_path, sparse_ffn_modules
from twell.eval.offline import resolve_offline
from twell.eval.tasks import AUTO, build_tasks, resolve_task_sources

PathSetter = Callable[[torch.nn.Module, str], None]
MIN_TOL = 1e-4  # nats; below this fp32 summation order alone can differ


@dataclass
class PathComparison:
    """Per-request log-likelihoods under two paths and whether they agree within ``tol``."""

    paths: tuple[str, str]
    n_requests: int
    max_abs_diff: float
    mean_abs_diff: float
    max_rel_diff: float
    tol: float
    tol_rule: str
    passed: bool
    floor_max_abs_diff: float | None = None  # tol="auto": max |bf16 first path - fp32 first path|
    error_vs_fp32: float | None = None  # tol="auto": max |second path - fp32 first path| (what is checked)
    decision_agreement: float | None = None  # share of documents whose highest-likelihood choice agrees
    n_docs: int | None = None
    observed_paths: dict[str, dict[str, int]] = field(default_factory=dict)
    loglikelihoods: dict[str, list[float]] = field(default_factory=dict)
    fixture: bool = False  # a FIXTURE model was compared (check_checkpoint_paths fills it in)
    fixture_data: bool = False  # on FIXTURE task files

    @property
    def fixture_note(self) -> str:
        what = [w for w, on in (("model", self.fixture), ("data", self.fixture_data)) if on]
        return f"FIXTURE {' and '.join(what)} (smoke run, not a result)" if what else ""

    def to_frame(self):
        """One-row DataFrame of the comparison (no per-request values)."""
        import pandas as pd

        a, b = self.paths
        ran = {p: ", ".join(f"{k} x{v}" for k, v in obs.items()) or "-" for p, obs in self.observed_paths.items()}
        return pd.DataFrame([{
            "paths": f"{a} vs {b}", "ran": f"{ran.get(a, '-')} | {ran.get(b, '-')}", "requests": self.n_requests,
            "docs": self.n_docs, "max_abs_diff": self.max_abs_diff, "mean_abs_diff": self.mean_abs_diff,
            "error_vs_fp32": self.error_vs_fp32, "bf16_floor": self.floor_max_abs_diff, "tol": self.tol,
            "same_answer": self.decision_agreement,
            "passed": self.passed, "fixture": self.fixture_note,
        }])

    def summary(self) -> str:
        a, b = self.paths
        agree = "" if self.decision_agreement is None else f", same answer on {self.decision_agreement:.1%} of {self.n_docs} docs"
        verdict = "PASS" if self.passed else "FAIL"
        verdict = f"{verdict} [{self.fixture_note}]" if self.fixture_note else verdict
        return (f"{verdict}: {a} vs {b} on {self.n_requests} requests: max |diff| {self.max_abs_diff:.3g} nats "
                f"(mean {self.mean_abs_diff:.3g}, max rel {self.max_rel_diff:.3g}); check: {self.tol_rule}{agree}")


def _count(limit, n: int) -> int:
    return n if limit is None else int(math.ceil(n * limit)) if limit < 1 else int(limit)


def _task_instances(tasks: Sequence[str], *, data_dir, data_files, limit, offline) -> list:
    sources = resolve_task_sources(tasks, data_dir=data_dir, data_files=data_files)
    built = build_tasks(sources, offline=offline)
    if not built.tasks:
        raise ValueError(f"no data for any of the tasks {list(tasks)}: {built.skipped}")
    instances = []
    for task in built.tasks.values():
        # lm-eval's rule: a limit below 1 is a fraction of the documents
        task.build_all_requests(limit=None if limit is None else _count(limit, len(task.eval_docs)), rank=0, world_size=1)
        instances += task.instances
    return instances


def _as_instances(requests: Any, *, data_dir, data_files, limit, offline) -> list:
    from lm_eval.api.instance import Instance

    if isinstance(requests, str):
        return _task_instances([requests], data_dir=data_dir, data_files=data_files, limit=limit, offline=offline)
    requests = list(requests)
    if not requests:
        raise ValueError("compare_paths needs at least one request")
    if all(isinstance(r, str) for r in requests):
        return _task_instances(requests, data_dir=data_dir, data_files=data_files, limit=limit, offline=offline)
    if all(isinstance(r, Instance) for r in requests):
        return requests[:_count(limit, len(requests))]
    pairs = requests[:_count(limit, len(requests))]
    out = []
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise TypeError(f"request {i}: expected a (context, continuation) pair of strings, got {pair!r}")
        out.append(Instance("loglikelihood", doc={}, arguments=(pair[0], pair[1]), idx=0, metadata=("pairs", i, 1)))
    return out


def _loglikelihoods(model, tokenizer, instances, batch_size, softmax_dtype, bar=None) -> np.ndarray:
    lm = lm_eval_model(model, tokenizer, bar=bar, batch_size=batch_size, softmax_dtype=softmax_dtype)
    return np.array([ll for ll, _ in lm.loglikelihood(instances)], dtype=np.float64)


def _run(setter, model, path, tokenizer, instances, bs, softmax_dtype, bar=None) -> np.ndarray:
    setter(model, path)
    return _loglikelihoods(model, tokenizer, instances, bs, softmax_dtype, bar)


def _in_dtype(model: torch.nn.Module, dtype: torch.dtype, fn):
    """Call ``fn()`` with the model's parameters cast to ``dtype``, then put the originals back.

    In place and lossless (the original tensors are kept), so path setters that hold references to
    the model's modules keep working and no second model is built.
    """
    originals = [(p, p.data) for p in model.parameters()]
    try:
        for p, data in originals:
            p.data = data.to(dtype)
        return fn()
    finally:
        for p, data in originals:
            p.data = data


def _decision_agreement(instances, a: np.ndarray, b: np.ndarray) -> tuple[float | None, int | None]:
    docs: dict[tuple, list[int]] = defaultdict(list)
    for i, inst in enumerate(instances):
        if inst.task_name != "pairs":
            docs[(inst.task_name, inst.doc_id)].append(i)
    docs = {k: v for k, v in docs.items() if len(v) > 1}
    if not docs:
        return None, None
    same = sum(int(np.argmax(a[idx]) == np.argmax(b[idx])) for idx in docs.values())
    return same / len(docs), len(docs)


def compare_paths(
    model: torch.nn.Module,
    tokenizer: Any,
    requests: str | Iterable[str] | Iterable[tuple[str, str]] | Iterable[Any],
    *,
    paths: tuple[str, str] = ("dense", "reference"),
    set_path: PathSetter | None = None,
    tol: float | str = "auto",
    floor_factor: float = 2.0,
    limit: int | None = None,
    data_dir=AUTO,
    data_files=None,
    offline: bool | None = None,
    batch_size: int | str = "auto",
    softmax_dtype: str | None = "float32",
    progress: Any = True,
) -> PathComparison:
    """Score the same requests under ``paths[0]`` and ``paths[1]`` and compare per request.

    requests: a task name or list of task names (requests built by lm-eval from the task's data,
        ``limit`` documents each), (context, continuation) pairs, or lm-eval Instances.
    set_path: ``set_path(model, path)`` switches the model; default :func:`twell.eval.loading.set_ffn_path`
        (then the path that actually ran is verified from ``SparseFFN.last_path``).
    tol: ``"auto"``: both paths are measured against ``paths[0]`` run in fp32, and the check passes
        when ``max |paths[1] - fp32| <= floor_factor x max |paths[0] in bf16 - fp32|`` (at least 1e-4),
        i.e. the sparse path is within a small multiple of plain bf16's own error. A number: passes
        when ``max |paths[1] - paths[0]| <= tol`` (nats). The auto rule compares two maxima, which are
        noisy over few requests: on random FIXTURE models, two equally accurate paths went past 2x in
        about 1 of 40 draws with ~50 requests and in none of 40 with ~200 (tests/test_eval_compare.py).
    softmax_dtype: lm-eval's HFLM option; float32 (default here) keeps the log-softmax of bf16
        logits from rounding each log-likelihood to a few tenths of a nat, which would hide differences.
    progress: one bar over the requests of each scoring in turn (True), none (False), or a tqdm bar to use.
    """
    if len(paths) != 2 or paths[0] == paths[1]:
        raise ValueError(f"paths must be two different path names, got {paths!r}")
    if tol != "auto" and not (isinstance(tol, (int, float)) and tol >= 0):
        raise ValueError(f"tol must be a non-negative number or 'auto', got {tol!r}")
    check_limit(limit)
    with quiet_lm_eval() as log, request_bar(progress, "FFN paths") as bar:
        return _compare(model, tokenizer, requests, paths=paths, set_path=set_path, tol=tol, floor_factor=floor_factor,
                        limit=limit, data_dir=data_dir, data_files=data_files, offline=offline, batch_size=batch_size,
                        softmax_dtype=softmax_dtype, bar=bar, log=log)


def _compare(model, tokenizer, requests, *, paths, set_path, tol, floor_factor, limit, data_dir, data_files, offline,
             batch_size, softmax_dtype, bar, log) -> PathComparison:
    instances = _as_instances(requests, data_dir=data_dir, data_files=data_files, limit=limit,
                              offline=resolve_offline(offline))
    device = str(next(model.parameters()).device)
    bs, _ = choose_batch_size(batch_size, device)
    setter = set_path or set_ffn_path
    saved = [(m, m.path) for m in sparse_ffn_modules(model)] if set_path is None else []
    lls: dict[str, np.ndarray] = {}
    observed: dict[str, dict[str, int]] = {}
    try:
        for path in paths:
            setter(model, path)
            bar.set_description(f"FFN path {path}")
            lls[path] = _loglikelihoods(model, tokenizer, instances, bs, softmax_dtype, bar)
            if path == paths[0]:  # the same requests each time: lm-eval's truncations are counted on the first
                truncated = log.truncation_note(len(instances))
            observed[path] = check_ffn_path(model, path) if set_path is None else {}
            if set_path is None and path != "dense" and not set(observed[path]) & SPARSE_LAST_PATHS:
                # "auto" may run every layer dense (an fp32 model): the check would compare dense with dense.
                raise RuntimeError(f"FFN path {path!r} ran no SparseFFN sparse ({observed[path]}), so there is no "
                                   "sparse path to check; load the model in bfloat16 or name 'reference' / 'kernel'")
        floor = err = None
        if tol == "auto":
            # The STYLE.md rule: the second path's error against an fp32 reference (the first path run in fp32)
            # must stay within floor_factor x the error plain bf16 makes against that same reference.
            if next(model.parameters()).dtype == torch.float32:
                reference = lls[paths[0]]
                bar.set_description(f"FFN path {paths[0]} in bf16")
                bf16 = _in_dtype(model, torch.bfloat16, lambda: _run(setter, model, paths[0], tokenizer, instances, bs,
                                                                     softmax_dtype, bar))
            else:
                bf16 = lls[paths[0]]
                bar.set_description(f"FFN path {paths[0]} in fp32")
                reference = _in_dtype(model, torch.float32, lambda: _run(setter, model, paths[0], tokenizer, instances,
                                                                         bs, softmax_dtype, bar))
            floor = float(np.max(np.abs(bf16 - reference)))
            err = float(np.max(np.abs(lls[paths[1]] - reference)))
            tol_value = max(floor_factor * floor, MIN_TOL)
            rule = (f"max |{paths[1]} - fp32 {paths[0]}| = {err:.3g} <= {floor_factor:g} x max |bf16 {paths[0]} - "
                    f"fp32 {paths[0]}| = {floor_factor:g} x {floor:.3g} (at least {MIN_TOL:g})")
        else:
            tol_value, rule = float(tol), "given: max |difference| <= tol"
    finally:
        for module, path in saved:
            module.path = path
    if truncated:
        warn_caller(f"FFN path check: {truncated}")
    a, b = lls[paths[0]], lls[paths[1]]
    diff = np.abs(a - b)
    agreement, n_docs = _decision_agreement(instances, a, b)
    checked = err if err is not None else float(diff.max())
    return PathComparison(
        paths=tuple(paths), n_requests=len(instances), max_abs_diff=float(diff.max()), mean_abs_diff=float(diff.mean()),
        max_rel_diff=float((diff / np.maximum(np.abs(a), 1e-12)).max()), tol=tol_value, tol_rule=rule,
        passed=bool(checked <= tol_value), floor_max_abs_diff=floor, error_vs_fp32=err,
        decision_agreement=agreement, n_docs=n_docs,
        observed_paths=observed, loglikelihoods={p: v.tolist() for p, v in lls.items()},
    )



def check_checkpoint_paths(
    name: str,
    spec: Any,
    *,
    paths: tuple[str, str] = ("dense", "auto"),
    tasks: Sequence[str] = ("commonsense_qa",),
    limit: int | None = 20,
    data_dir=AUTO,
    data_files=None,
    device: str | None = None,
    dtype: str | None = None,
    fixture_if_missing: bool = False,
    fixture_data_if_missing: bool = False,
    offline: bool | None = None,
    tol: float | str = "auto",
) -> PathComparison:
    """:func:`compare_paths` on one entry of a ``checkpoints`` mapping (loaded as evaluate_checkpoints does)."""
    from twell.eval.harness import load_named, with_fixture_data

    offline = resolve_offline(offline)
    tasks = list(tasks)
    if fixture_data_if_missing and offline:
        data_files = with_fixture_data(tasks, data_dir=data_dir, data_files=data_files)
    loaded = load_named(name, spec, ffn_path=paths[1], device=device, dtype=dtype,
                        fixture_if_missing=fixture_if_missing, offline=offline)
    result = compare_paths(loaded.model, loaded.tokenizer, tasks, paths=paths, limit=limit, data_dir=data_dir,
                           data_files=data_files, offline=offline, tol=tol)
    result.fixture = loaded.fixture
    result.fixture_data = any(src.fixture for src in resolve_task_sources(tasks, data_dir=data_dir, data_files=data_files))
    return result
