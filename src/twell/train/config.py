"""Run configuration: declarative YAML files under configs/, with documented fields and one set of defaults.

A run config has five sections (every field is optional; the defaults below apply)::

    name: small            # defaults to the file name
    base: small            # optional: start from another config (name or path) and override it
    model:    {...}        # twell.model.ModelConfig
    data:     {...}        # twell.data.DataConfig
    optim:    {...}        # OptimConfig
    train:    {...}        # TrainConfig
    sparsity: {...}        # SparsityConfig

Overrides from the command line use dotted keys: ``--set train.steps=100 --set sparsity.l1_coef=0``
(values are parsed as YAML). Unknown sections or keys raise, naming the valid ones.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from twell.data.prepare import DataConfig
from twell.model.config import ModelConfig, dataclass_from_dict
from twell.paths import repo_root


def _from_dict(cls, d: Mapping[str, Any] | None, where: str):
    return dataclass_from_dict(cls, d, where)


@dataclass
class OptimConfig:
    """AdamW + linear warm-up + cosine decay (the paper: lr 1e-3, wd 0.1, betas 0.9/0.95, 600 warm-up, clip 1)."""

    lr: float = 1e-3
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio (0: to zero, as the paper's HF Trainer does)
    weight_decay: float = 0.1  # applied to matrices and embeddings, not to norm weights
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 600
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass
class TrainConfig:
    """Steps, batch geometry, precision, logging, evaluation and checkpoint cadence."""

    steps: int = 10_000
    seq_len: int = 2048
    global_batch: int = 512  # sequences per optimizer step, over all ranks and micro-batches
    micro_batch: int = 8  # sequences per forward on one rank (gradient accumulation fills the rest)
    precision: str = "bf16"  # bf16 (autocast / FSDP mixed precision, fp32 master weights) | fp32
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0  # model initialisation
    data_seed: int = 0  # order of training blocks
    log_every: int = 1  # JSONL record every N steps
    eval_every: int = 500  # validation every N steps (and at the end)
    eval_tokens: int | None = 2_000_000  # validation tokens per evaluation (None: the whole split)
    eval_micro_batch: int | None = None  # default: micro_batch
    ckpt_every: int = 1000  # training-state checkpoint every N steps (and at the end)
    keep_checkpoints: int = 2
    max_wall_seconds: float | None = None  # stop cleanly (checkpoint + export) before this many seconds
    stop_at_unix: float | None = None  # ... or before this absolute time (time.time())
    wall_reserve_s: float = 20.0  # seconds kept free before a wall-clock limit for the final save
    # torch.compile each decoder layer; auto: on a GPU (it shortened a 0.5B step by about a third, dense
    # and sparse alike, docs/training_kernels.md), not on a CPU
    compile: bool | str = "auto"
    activation_checkpointing: bool = False
    # The sparse training kernels (twell.nn.sparse_training): auto = used for a ReLU-gated model with
    # L1 > 0 on a GPU where the kernels build; always = required (an error where they cannot run);
    # never. (Not on/off: YAML reads those as booleans.)
    sparse_kernels: str = "auto"
    # a layer trains sparse at or below this active fraction (smoothed over steps); auto: the largest activity
    # at which the training op is measured faster than dense at this run's shape, timed before the first step
    # (twell.train.calibration)
    sparse_max_active: float | str = "auto"
    # ... and on forwards of at least this many tokens (micro_batch x seq_len): fewer train faster dense
    # (docs/routing.md, "Training")
    sparse_min_tokens: int = 8192
    # how the layers get their training routes: "activity" (the threshold above) or "timed": every
    # sparse_retime_every steps each layer's routes are timed on its own input of that step (dense, the op, and
    # with sparse_hot the op with the layer's hot neurons as dense columns; twell.train.calibration.time_layer),
    # one process only (the timing needs each layer's whole weights)
    sparse_routes: str = "activity"
    sparse_hot: float | None = None  # timed routes: hot neurons are those active on at least this fraction of rows
    sparse_retime_every: int = 500
    tf32: bool = True
    export_dtype: str | None = "bf16"  # dtype of the final Hugging Face export (None: keep fp32)
    export_max_shard: str = "2GB"
    progress: bool = True  # tqdm bar on rank 0


@dataclass
class SparsityConfig:
    """The L1 recipe and the sparsity tracker."""

    l1_coef: float = 2e-5  # times mean over layers of (|h| summed over hidden units, mean over tokens)
    l1_warmup_steps: int = 0  # linear warm-up of the coefficient from 0 (0: constant)
    dead_window_tokens: int | None = None  # a neuron silent for this many tokens is dead (None: one step's tokens)
    reinit_dead: bool = False  # re-initialise the gate rows of dead neurons (one process or FSDP2, same draws)
    reinit_every: int = 100  # ... every N steps
    position_bins: int = 32  # active neurons by token position: number of position bins logged
    positions_every: int = 100  # ... logged every N steps (averaged over those steps)


@dataclass
class RunConfig:
    name: str = "run"
    description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)

    SECTIONS = ("model", "data", "optim", "train", "sparsity")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunConfig":
        d = dict(d)
        d.pop("base", None)
        top = {"name", "description", *cls.SECTIONS}
        unknown = sorted(set(d) - top)
        if unknown:
            raise ValueError(f"unknown top-level key(s) {unknown} in the run config; expected some of {sorted(top)}")
        return cls(
            name=str(d.get("name", "run")),
            description=str(d.get("description", "")),
            model=ModelConfig.from_dict(d.get("model") or {}, "model"),
            data=DataConfig.from_dict(d.get("data") or {}, "data"),
            optim=_from_dict(OptimConfig, d.get("optim"), "optim"),
            train=_from_dict(TrainConfig, d.get("train"), "train"),
            sparsity=_from_dict(SparsityConfig, d.get("sparsity"), "sparsity"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description,
                **{s: dataclasses.asdict(getattr(self, s)) for s in self.SECTIONS}}

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch * self.train.seq_len

    def validate(self, world_size: int = 1) -> None:
        """Raise ValueError naming the field and the fix for inconsistent settings."""
        t, o, s, m = self.train, self.optim, self.sparsity, self.model
        for section in self.SECTIONS:  # NaN compares False with every bound below, so check it first
            for f in dataclasses.fields(getattr(self, section)):
                v = getattr(getattr(self, section), f.name)
                if isinstance(v, float) and not math.isfinite(v):
                    raise ValueError(f"{section}.{f.name} must be a finite number, got {v}")
        for name in ("steps", "seq_len", "global_batch", "micro_batch"):
            v = getattr(t, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"train.{name} must be a positive integer, got {v!r}")
        per_round = t.micro_batch * world_size
        if t.global_batch % per_round:
            raise ValueError(
                f"train.global_batch ({t.global_batch}) must be divisible by train.micro_batch ({t.micro_batch}) x "
                f"world size ({world_size}) = {per_round}"
            )
        if t.seq_len > m.max_position_embeddings:
            raise ValueError(f"train.seq_len ({t.seq_len}) exceeds model.max_position_embeddings "
                             f"({m.max_position_embeddings})")
        if t.precision not in ("bf16", "fp32"):
            raise ValueError(f"train.precision must be 'bf16' or 'fp32', got {t.precision!r}")
        if t.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"train.device must be auto, cpu or cuda, got {t.device!r}")
        if t.sparse_kernels not in ("auto", "always", "never"):
            raise ValueError(f"train.sparse_kernels must be auto, always or never, got {t.sparse_kernels!r}")
        if t.compile not in (True, False, "auto"):
            raise ValueError(f"train.compile must be true, false or auto, got {t.compile!r}")
        if isinstance(t.sparse_max_active, str):
            if t.sparse_max_active != "auto":
                raise ValueError(f"train.sparse_max_active is a fraction in [0, 1] or auto, got {t.sparse_max_active!r}")
        elif not 0 <= t.sparse_max_active <= 1:
            raise ValueError(f"train.sparse_max_active is a fraction in [0, 1] or auto, got {t.sparse_max_active}")
        if isinstance(t.sparse_min_tokens, bool) or not isinstance(t.sparse_min_tokens, int) or t.sparse_min_tokens < 0:
            raise ValueError(f"train.sparse_min_tokens must be an integer >= 0, got {t.sparse_min_tokens!r}")
        if t.sparse_routes not in ("activity", "timed"):
            raise ValueError(f"train.sparse_routes must be activity or timed, got {t.sparse_routes!r}")
        if t.sparse_routes == "timed" and world_size > 1:
            raise ValueError(f"train.sparse_routes timed runs on one process (it times each layer's whole weights), "
                             f"got a world size of {world_size}")
        if t.sparse_hot is not None:
            if isinstance(t.sparse_hot, bool) or not isinstance(t.sparse_hot, (int, float)) or not 0 < t.sparse_hot <= 1:
                raise ValueError(f"train.sparse_hot is a fraction in (0, 1] or null, got {t.sparse_hot!r}")
            if t.sparse_routes != "timed":
                raise ValueError("train.sparse_hot is chosen per layer by timing: it needs train.sparse_routes timed")
        if (isinstance(t.sparse_retime_every, bool) or not isinstance(t.sparse_retime_every, int)
                or t.sparse_retime_every < 1):
            raise ValueError(f"train.sparse_retime_every must be an integer >= 1, got {t.sparse_retime_every!r}")
        if t.export_dtype not in (None, "bf16", "fp32"):
            raise ValueError(f"train.export_dtype must be bf16, fp32 or null, got {t.export_dtype!r}")
        for name in ("eval_tokens", "eval_micro_batch"):  # None: the whole split / micro_batch
            v = getattr(t, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"train.{name} must be a positive integer or null, got {v!r}")
        if t.eval_tokens is not None and t.eval_tokens < t.seq_len:
            raise ValueError(f"train.eval_tokens ({t.eval_tokens}) is less than one block of train.seq_len "
                             f"({t.seq_len}) tokens")
        for name in ("log_every", "eval_every", "ckpt_every", "keep_checkpoints"):
            if getattr(t, name) <= 0:
                raise ValueError(f"train.{name} must be positive, got {getattr(t, name)}")
        if o.lr <= 0 or o.warmup_steps < 0 or not 0 <= o.min_lr_ratio <= 1 or o.grad_clip < 0:
            raise ValueError(f"optim: expected lr > 0, warmup_steps >= 0, 0 <= min_lr_ratio <= 1, grad_clip >= 0; got "
                             f"lr={o.lr}, warmup_steps={o.warmup_steps}, min_lr_ratio={o.min_lr_ratio}, "
                             f"grad_clip={o.grad_clip}")
        if s.l1_coef < 0 or s.l1_warmup_steps < 0:
            raise ValueError(f"sparsity.l1_coef and l1_warmup_steps must be >= 0, got {s.l1_coef}, {s.l1_warmup_steps}")
        for name, v in (("optim.warmup_steps", o.warmup_steps), ("sparsity.l1_warmup_steps", s.l1_warmup_steps)):
            if v > t.steps:  # the ramp never finishes; a warning, not an error: short trial runs of long configs do this
                warnings.warn(f"{name} ({v}) exceeds train.steps ({t.steps}): the run ends before its warm-up does, "
                              f"never reaching the configured value; lower {name} for a real run", stacklevel=2)
        if s.l1_coef > 0 and m.ffn == "silu_gated":
            raise ValueError("sparsity.l1_coef > 0 needs a ReLU FFN (model.ffn relu_gated or relu); the SiLU baseline "
                             "trains with l1_coef: 0")
        if s.position_bins <= 0 or s.positions_every <= 0 or s.reinit_every <= 0:
            raise ValueError("sparsity.position_bins, positions_every and reinit_every must be positive")


def config_path(name_or_path: str | Path) -> Path:
    """``tiny`` -> ``<repo>/configs/tiny.yaml``; a path is returned as is (must exist)."""
    p = Path(name_or_path).expanduser()
    if p.suffix in (".yaml", ".yml") or p.is_file():  # a folder named like a config ("runs/tiny") is not one
        if not p.is_file():
            raise FileNotFoundError(f"config file {str(p)!r} not found")
        return p
    cand = repo_root() / "configs" / f"{name_or_path}.yaml"
    if not cand.is_file():
        avail = sorted(q.stem for q in (repo_root() / "configs").glob("*.yaml"))
        raise FileNotFoundError(f"no config named {str(name_or_path)!r}; expected one of {avail} or a .yaml path")
    return cand


def _deep_merge(base: dict, over: Mapping) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(dict(out[k]), v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def load_raw(name_or_path: str | Path, _seen: tuple = ()) -> dict[str, Any]:
    """The config as a dict with ``base:`` chains resolved (child keys win)."""
    path = config_path(name_or_path).resolve()
    if path in _seen:
        raise ValueError(f"config inheritance loop: {' -> '.join(map(str, _seen + (path,)))}")
    with path.open() as f:
        d = yaml.safe_load(f) or {}
    if not isinstance(d, Mapping):
        raise ValueError(f"{path} must hold a mapping, got {type(d).__name__}")
    d = dict(d)
    d.setdefault("name", path.stem)
    base = d.pop("base", None)
    if base is None:
        return d
    base_ref = base if not str(base).endswith((".yaml", ".yml")) else str(path.parent / base)
    parent = load_raw(base_ref, _seen + (path,))
    parent.pop("name", None)
    return _deep_merge(parent, d)


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["train.steps=100", "sparsity.l1_coef=0"]`` -> nested dict (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, eq, raw = str(item).partition("=")
        parts = [p for p in key.strip().split(".") if p]
        if not eq or not parts:
            raise ValueError(f"bad override {item!r}; expected SECTION.KEY=VALUE, e.g. train.steps=100")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r} conflicts with another override of {p!r}")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    return out


def load_config(name_or_path: str | Path | Mapping[str, Any] | RunConfig,
                overrides: Iterable[str] | Mapping[str, Any] | None = None) -> RunConfig:
    """A validated-shape RunConfig from a config name, a YAML path or a dict, plus overrides."""
    if isinstance(name_or_path, RunConfig):
        raw = name_or_path.to_dict()
    elif isinstance(name_or_path, Mapping):
        raw = dict(name_or_path)
        if "base" in raw:
            base = load_raw(raw.pop("base"))
            base.pop("name", None)
            raw = _deep_merge(base, raw)
    else:
        raw = load_raw(name_or_path)
    if overrides:
        over = overrides if isinstance(overrides, Mapping) else parse_overrides(overrides)
        raw = _deep_merge(raw, over)
    return RunConfig.from_dict(raw)
