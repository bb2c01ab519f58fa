"""Load a checkpoint for evaluation and choose / verify which FFN path runs.

Checkpoints go through ``twell.model.load_pretrained`` so the project's ``SparseFFN`` modules
(and on a GPU the TwELL kernels) are what lm-eval evaluates; ``loader="transformers"`` loads a
non-project causal LM with plain ``transformers.AutoModelForCausalLM`` (dense MLPs only). Which
loader ran is recorded in :class:`LoadedModel`.

FFN paths: ``"dense"``, ``"reference"`` (pure-PyTorch TwELL), ``"kernel"`` (CUDA TwELL),
``"auto"`` (kernel when available, else reference). After a forward each ``SparseFFN`` reports
the path it ran in ``last_path``; :func:`check_ffn_path` turns a mismatch into an error.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from twell.eval.errors import CheckpointLoadError
from twell.eval.offline import hf_offline, resolve_offline
from twell.model import load_pretrained, sparse_ffns
from twell.model import set_ffn_path as set_project_ffn_path
from twell.model.hub import resolve_dtype

LOADERS = ("auto", "twell", "transformers")
FFN_PATHS = ("dense", "reference", "kernel", "auto")
# SparseFFN.last_path values that each requested path may produce. "auto" runs a layer dense where no
# sparse path fits it (an fp32 model, a layer above SparseFFN.auto_max_active): the run records it.
EXPECTED_LAST_PATHS = {
    "dense": {"dense"},
    "reference": {"twell-reference"},
    "kernel": {"twell-kernel"},
    "auto": {"twell-reference", "twell-kernel", "dense"},
}
SPARSE_LAST_PATHS = EXPECTED_LAST_PATHS["reference"] | EXPECTED_LAST_PATHS["kernel"]
# eval's name for twell.model.sparse_ffns (compare.py and the tests use it).
sparse_ffn_modules = sparse_ffns


@dataclass
class LoadedModel:
    """A model ready for lm-eval, with a record of how it was obtained."""

    model: Any
    tokenizer: Any
    name: str
    source: str  # checkpoint path or hub id ("<in-process fixture>" for fixtures)
    loader: str  # "twell.model.load_pretrained", "transformers.AutoModelForCausalLM" or "fixture"
    ffn_path: str | None  # requested FFN path (None: plain transformers MLP, always dense)
    fixture: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def device(self) -> str:
        return str(next(self.model.parameters()).device)

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).replace("torch.", "")


def resolve_device(device: str | None) -> str:
    """``None`` or ``"auto"``: ``"cuda"`` when available, else ``"cpu"``."""
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available on this machine")
    return str(device)


# -- FFN path ------------------------------------------------------------------------------------
def set_ffn_path(model: torch.nn.Module, path: str) -> None:
    """``twell.model.set_ffn_path`` that also accepts plain transformers models, for ``"dense"`` only.

    A model without ``SparseFFN`` modules can only run dense: ``"dense"`` is a no-op for it and any
    other path raises, so a sparse evaluation never silently runs dense.
    """
    if path not in FFN_PATHS:
        raise ValueError(f"unknown FFN path {path!r}; expected one of {FFN_PATHS}")
    if not sparse_ffns(model):
        if path != "dense":
            raise ValueError(f"{type(model).__name__} has no twell SparseFFN modules, so FFN path {path!r} cannot run; "
                             "load it with twell.model.load_pretrained (loader='twell') or use path 'dense'")
        return
    if path in ("reference", "kernel"):  # the TwELL paths take bf16 activations only
        dtypes = {str(p.dtype).replace("torch.", "") for m in sparse_ffns(model) for p in m.parameters()}
        if dtypes != {"bfloat16"}:
            raise ValueError(f"FFN path {path!r} needs a bfloat16 model, this one is {', '.join(sorted(dtypes))}: "
                             "load it with dtype='bfloat16'")
    set_project_ffn_path(model, path)


def observed_ffn_paths(model: torch.nn.Module) -> dict[str, int]:
    """``{last_path: number of SparseFFN modules}`` after the last forward (empty for plain models)."""
    counts: dict[str, int] = {}
    for module in sparse_ffns(model):
        key = str(module.last_path)
        counts[key] = counts.get(key, 0) + 1
    return counts


def forget_ffn_paths(model: torch.nn.Module) -> None:
    """Clear every SparseFFN's ``last_path``, so what ran before a run cannot pass for that run's path."""
    for module in sparse_ffns(model):
        module.last_path = None


def check_ffn_path(model: torch.nn.Module, requested: str | None) -> dict[str, int]:
    """Raise when the FFN modules ran another path than ``requested``; returns the observed counts."""
    observed = observed_ffn_paths(model)
    if requested is None or not observed:
        if requested not in (None, "dense") and not observed:
            raise RuntimeError(f"FFN path {requested!r} was requested but the model has no SparseFFN modules")
        return observed
    unexpected = set(observed) - EXPECTED_LAST_PATHS[requested]
    if unexpected:
        raise RuntimeError(f"FFN path {requested!r} was requested but SparseFFN modules ran {observed} "
                           f"(expected only {sorted(EXPECTED_LAST_PATHS[requested])})")
    return observed


# -- checkpoints ---------------------------------------------------------------------------------
def _load_with_transformers(source: str, dtype: torch.dtype | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype if dtype is not None else "auto")
    tokenizer = AutoTokenizer.from_pretrained(source)
    return model, tokenizer


def load_checkpoint(
    source: str | os.PathLike,
    *,
    name: str | None = None,
    ffn_path: str = "auto",
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    loader: str = "auto",
    offline: bool | None = None,
) -> LoadedModel:
    """Load ``source`` (checkpoint directory or hub id) for evaluation on ``device``.

    loader: ``"twell"`` or ``"auto"`` (the same: ``twell.model.load_pretrained``), or
        ``"transformers"`` (plain ``AutoModelForCausalLM``, for non-project checkpoints). A plain
        transformers model runs dense only: ffn_path ``"reference"`` or ``"kernel"`` then raises,
        ``"auto"`` is recorded as dense.
    A hub id is downloaded when online; offline only the local Hugging Face cache is used.
    Raises CheckpointLoadError naming the checkpoint when it cannot be loaded.
    """
    if loader not in LOADERS:
        raise ValueError(f"unknown loader {loader!r}; expected one of {LOADERS}")
    if ffn_path not in FFN_PATHS:
        raise ValueError(f"unknown FFN path {ffn_path!r}; expected one of {FFN_PATHS}")
    source = str(source)
    name = name or Path(source).name or source
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype)
    offline = resolve_offline(offline)
    local = Path(source).expanduser().exists()
    if not local and (source.startswith((".", "/", "~")) or source.count("/") != 1):
        raise CheckpointLoadError(f"checkpoint {name!r}: {source} does not exist (expected a checkpoint directory "
                                  "or a hub id 'owner/name')")
    if local:
        source = str(Path(source).expanduser().resolve())

    notes: list[str] = []
    use_project = loader != "transformers"
    used = "twell.model.load_pretrained" if use_project else "transformers.AutoModelForCausalLM"
    try:
        with hf_offline(offline):
            if use_project:
                model, tokenizer = load_pretrained(source, ffn_path=ffn_path, device=device, dtype=torch_dtype,
                                                   # offline: never; else TWELL_ALLOW_NETWORK decides
                                                   allow_network=False if offline else None)
            else:
                model, tokenizer = _load_with_transformers(source, torch_dtype)
    except Exception as err:  # noqa: BLE001 - re-raised with the checkpoint named
        raise CheckpointLoadError(f"checkpoint {name!r} at {source} could not be loaded with {used}: "
                                  f"{type(err).__name__}: {err}") from err
    if tokenizer is None:
        raise CheckpointLoadError(f"checkpoint {name!r} at {source} ships no tokenizer; lm-eval needs one")
    model = model.to(device).eval()
    fixture = (Path(source) / "FIXTURE_README.txt").is_file() if local else False
    if fixture:  # written by twell.eval.fixtures.save_fixture_checkpoint: a random model, not a result
        notes.append("FIXTURE checkpoint (FIXTURE_README.txt): a tiny random model, its numbers are not results")
    requested: str | None = ffn_path
    if not sparse_ffns(model):
        if ffn_path in ("reference", "kernel"):
            raise ValueError(f"checkpoint {name!r} loaded with {used} has no twell SparseFFN modules, so FFN path "
                             f"{ffn_path!r} cannot run; load it with loader='twell' or use ffn_path='dense'")
        if ffn_path == "auto":
            notes.append("no SparseFFN modules: the model runs its dense MLP")
        requested = None if ffn_path == "auto" else "dense"
    else:
        set_ffn_path(model, ffn_path)
    return LoadedModel(model, tokenizer, name, source, used, requested, fixture=fixture, notes=notes)


def fixture_model(name: str = "fixture", *, ffn_path: str = "dense", device: str | None = None,
                  dtype: str | torch.dtype | None = "bfloat16", seed: int = 0) -> LoadedModel:
    """A FIXTURE tiny random model (see :mod:`twell.eval.fixtures`) wrapped as a :class:`LoadedModel`.

    bf16 by default because the TwELL paths take bf16 activations; the same seed gives the same
    weights, so a dense and a sparse fixture run evaluate one model on two FFN paths.
    """
    from twell.eval.fixtures import build_fixture_model

    model, tokenizer = build_fixture_model(seed=seed, dtype=resolve_dtype(dtype) or torch.float32)
    model = model.to(resolve_device(device)).eval()
    set_ffn_path(model, ffn_path)
    notes = ["FIXTURE: tiny randomly initialised model built in-process, not a trained checkpoint"]
    return LoadedModel(model, tokenizer, name, "<in-process fixture>", "fixture", ffn_path, fixture=True, notes=notes)
