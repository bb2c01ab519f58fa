"""Load a checkpoint for evaluation and choose / verify which FFN path runs.

Project checkpoints go through ``twell.model.load_pretrained`` so the project's ``SparseFFN``
modules (and on a GPU the TwELL kernels) are what lm-eval evaluates. Other causal LMs load with
``transformers.AutoModelForCausalLM``. Which loader ran is recorded in :class:`LoadedModel`;
while ``twell.model.load_pretrained`` does not exist yet, ``loader="auto"`` uses transformers and
says so in ``LoadedModel.note``.

FFN paths: ``"dense"``, ``"reference"`` (pure-PyTorch TwELL), ``"kernel"`` (CUDA TwELL),
``"auto"`` (kernel when available, else reference). After a forward each ``SparseFFN`` reports
the path it ran in ``last_path``; :func:`check_ffn_path` turns a mismatch into an error.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from twell.eval.errors import CheckpointLoadError
from twell.eval.offline import hf_offline, resolve_offline

LOADERS = ("auto", "twell", "transformers")
FFN_PATHS = ("dense", "reference", "kernel", "auto")
# SparseFFN.last_path values that each requested path may produce.
EXPECTED_LAST_PATHS = {
    "dense": {"dense"},
    "reference": {"twell-reference"},
    "kernel": {"twell-kernel"},
    "auto": {"twell-reference", "twell-kernel"},
}
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


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


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from ``"bfloat16"``/``"bf16"``/``"float32"``/...; ``None`` and ``"auto"`` give None."""
    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return None if dtype == "auto" else dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)} or a torch.dtype")
    return _DTYPES[dtype]


# -- FFN path ------------------------------------------------------------------------------------
def sparse_ffn_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The project's ``twell.nn.SparseFFN`` modules inside ``model`` (empty for plain models)."""
    try:
        from twell.nn import SparseFFN
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, SparseFFN)]


def _project_function(name: str) -> Callable | None:
    try:
        import twell.model as project_model
    except ImportError:
        return None
    return getattr(project_model, name, None)


def set_ffn_path(model: torch.nn.Module, path: str) -> None:
    """Select the FFN path of every project FFN module (``twell.model.set_ffn_path`` when it exists).

    A model without ``SparseFFN`` modules can only run dense: ``"dense"`` is a no-op for it and any
    other path raises, so a sparse evaluation never silently runs dense.
    """
    if path not in FFN_PATHS:
        raise ValueError(f"unknown FFN path {path!r}; expected one of {FFN_PATHS}")
    modules = sparse_ffn_modules(model)
    if not modules:
        if path != "dense":
            raise ValueError(f"{type(model).__name__} has no twell SparseFFN modules, so FFN path {path!r} cannot run; "
                             "load it with twell.model.load_pretrained (loader='twell') or use path 'dense'")
        return
    project_setter = _project_function("set_ffn_path")
    if project_setter is not None:
        project_setter(model, path)
    else:
        for module in modules:
            module.path = path


def observed_ffn_paths(model: torch.nn.Module) -> dict[str, int]:
    """``{last_path: number of SparseFFN modules}`` after the last forward (empty for plain models)."""
    counts: dict[str, int] = {}
    for module in sparse_ffn_modules(model):
        key = str(module.last_path)
        counts[key] = counts.get(key, 0) + 1
    return counts


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

    loader: ``"twell"`` (``twell.model.load_pretrained``), ``"transformers"`` or ``"auto"`` (twell's
        when it exists). A plain transformers model runs dense only: ffn_path ``"reference"`` or
        ``"kernel"`` then raises, ``"auto"`` is recorded as dense.
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

    project_loader = _project_function("load_pretrained")
    notes: list[str] = []
    if loader == "twell" and project_loader is None:
        raise CheckpointLoadError(f"checkpoint {name!r}: loader='twell' requested but twell.model.load_pretrained "
                                  "does not exist in this checkout")
    use_project = loader == "twell" or (loader == "auto" and project_loader is not None)
    if loader == "auto" and project_loader is None:
        notes.append("twell.model.load_pretrained is not available: loaded with plain transformers (dense MLPs)")
    used = "twell.model.load_pretrained" if use_project else "transformers.AutoModelForCausalLM"
    try:
        with hf_offline(offline):
            if use_project:
                kwargs = {"allow_network": not offline} if "allow_network" in inspect.signature(project_loader).parameters else {}
                model, tokenizer = project_loader(source, ffn_path=ffn_path, device=device, dtype=torch_dtype, **kwargs)
            else:
                model, tokenizer = _load_with_transformers(source, torch_dtype)
    except Exception as err:  # noqa: BLE001 - re-raised with the checkpoint named
        raise CheckpointLoadError(f"checkpoint {name!r} at {source} could not be loaded with {used}: "
                                  f"{type(err).__name__}: {err}") from err
    if tokenizer is None:
        raise CheckpointLoadError(f"checkpoint {name!r} at {source} ships no tokenizer; lm-eval needs one")
    model = model.to(device).eval()
    requested: str | None = ffn_path
    if not sparse_ffn_modules(model):
        if ffn_path in ("reference", "kernel"):
            raise ValueError(f"checkpoint {name!r} loaded with {used} has no twell SparseFFN modules, so FFN path "
                             f"{ffn_path!r} cannot run; load it with loader='twell' or use ffn_path='dense'")
        if ffn_path == "auto":
            notes.append("no SparseFFN modules: the model runs its dense MLP")
        requested = None if ffn_path == "auto" else "dense"
    else:
        set_ffn_path(model, ffn_path)
    return LoadedModel(model, tokenizer, name, source, used, requested, notes=notes)


def fixture_model(name: str = "fixture", *, ffn_path: str = "dense", device: str | None = None,
                  dtype: str | torch.dtype | None = "bfloat16", seed: int = 0) -> LoadedModel:
    """A FIXTURE tiny random model (see :mod:`twell.eval.fixtures`) wrapped as a :class:`LoadedModel`.

    bf16 by default because the TwELL paths take bf16 activations; the same seed gives the same
    weights, so a dense and a sparse fixture run evaluate one model on two FFN paths.
    """
    from twell.eval.fixtures import build_fixture_model

    model, tokenizer = build_fixture_model(seed=seed, dtype=resolve_dtype(dtype) or torch.float32)
    model = model.to(resolve_device(device)).eval()
    requested: str | None = ffn_path
    notes = ["FIXTURE: tiny randomly initialised model built in-process, not a trained checkpoint"]
    if sparse_ffn_modules(model):
        set_ffn_path(model, ffn_path)
    elif ffn_path != "dense":
        raise ValueError(f"fixture model has no SparseFFN modules (twell.nn missing), FFN path {ffn_path!r} cannot run")
    return LoadedModel(model, tokenizer, name, "<in-process fixture>", "fixture", requested, fixture=True, notes=notes)
