"""The model's shape as a handful of plain values, and its translation to a transformers LlamaConfig.

``ffn`` picks the feedforward block:

- ``relu_gated``     h = relu(x Wg^T) * (x Wu^T)        (the paper's sparse model; a plain Llama with ReLU)
- ``relu``           h = relu(x Wu^T)                   (non-gated ablation; no ``gate_proj``)
- ``silu_gated``     h = silu(x Wg^T) * (x Wu^T)        (the standard dense Llama baseline)
- ``fatrelu_gated``  FATReLU on the gate, threshold ``gate_threshold`` (ProSparse, MiniCPM-S)
- ``drelu_gated``    h = relu(x Wg^T) * relu(x Wu^T)    (dReLU: TurboSparse-Mistral)

``arch`` picks the transformers model around the MLPs: ``llama``, ``mistral`` (a Llama with a sliding
attention window, ``sliding_window``) or ``minicpm`` (a Llama with MiniCPM's scaling: ``scale_emb``,
``scale_depth``, ``dim_model_base``; twell.model.minicpm). docs/models.md lists the public formats.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from twell.config_util import dataclass_from_dict  # also imported from here by older callers

import math

FFN_KINDS = ("relu_gated", "relu", "silu_gated", "fatrelu_gated", "drelu_gated")
ARCHS = ("llama", "mistral", "minicpm")
MINICPM_KEYS = ("scale_emb", "scale_depth", "dim_model_base")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # a checkpoint's own, carried to transformers as written


@dataclass
class ModelConfig:
    """Llama shape. Defaults are the paper's 0.5B model (hidden 2048, intermediate 5632, 8 layers)."""

    vocab_size: int = 49152
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_layers: int = 8
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int | None = None  # None: hidden_size // num_heads
    ffn: str = "relu_gated"
    rope_theta: float = 1e5
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    attn_implementation: str = "sdpa"
    bos_token_id: int = 0
    eos_token_id: int = 0
    gate_threshold: float = 0.0  # FATReLU's threshold (ffn fatrelu_gated only)
    arch: str = "llama"
    sliding_window: int | None = None  # arch mistral: keys a query attends to, itself included (None: all)
    scale_emb: float | None = None  # arch minicpm: embeddings times scale_emb,
    scale_depth: float | None = None  # each block's output times scale_depth / sqrt(num_layers),
    dim_model_base: int | None = None  # the last hidden state divided by hidden_size / dim_model_base

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.ffn not in FFN_KINDS:
            raise ValueError(f"model.ffn must be one of {FFN_KINDS}, got {self.ffn!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"model.{name} must be a positive integer, got {v!r}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads}), "
                "or set model.head_dim"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_heads ({self.num_heads}) must be a multiple of model.num_kv_heads "
                             f"({self.num_kv_heads})")
        t = self.gate_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"model.gate_threshold must be a finite number >= 0, got {t!r}")
        if t and self.ffn != "fatrelu_gated":
            raise ValueError(f"model.gate_threshold={t} is FATReLU's: it needs model.ffn fatrelu_gated, got {self.ffn}")
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch must be one of {ARCHS}, got {self.arch!r}")
        if self.sliding_window is not None and (self.arch != "mistral" or self.sliding_window < 1):
            raise ValueError(f"model.sliding_window ({self.sliding_window}) needs model.arch mistral and a positive "
                             "number of tokens")
        given = [k for k in MINICPM_KEYS if getattr(self, k) is not None]
        if self.arch == "minicpm" and len(given) != len(MINICPM_KEYS):
            raise ValueError(f"model.arch minicpm needs {list(MINICPM_KEYS)}, got only {given}")
        if self.arch != "minicpm" and given:
            raise ValueError(f"{given} are MiniCPM's scaling parameters: they need model.arch minicpm")
        if self.arch == "minicpm" and (self.scale_emb <= 0 or self.scale_depth <= 0 or self.dim_model_base <= 0):
            raise ValueError(f"MiniCPM's {list(MINICPM_KEYS)} must be positive, got "
                             f"{[getattr(self, k) for k in MINICPM_KEYS]}")

    @property
    def gated(self) -> bool:
        return self.ffn != "relu"

    @property
    def activation(self) -> str:
        """SparseFFN's activation: relu, silu, fatrelu or drelu."""
        return {"silu_gated": "silu", "fatrelu_gated": "fatrelu", "drelu_gated": "drelu"}.get(self.ffn, "relu")

    @property
    def sparse(self) -> bool:
        """Whether the MLPs' sparse paths can run (a ReLU-family gate)."""
        return self.activation != "silu"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "model") -> "ModelConfig":
        return dataclass_from_dict(cls, d, where)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_hf_config(self, **extra: Any):
        """A ``transformers.LlamaConfig`` (``MistralConfig`` for arch mistral); ``extra`` becomes additional
        (serialised) attributes, or replaces the token ids (a checkpoint's list of eos ids, its pad id).
        The transformers MLP is built with ReLU for the ReLU variants: SparseFFN replaces it
        (twell.model.llama.swap_mlps), and the built model's ``hidden_act`` then names the variant."""
        from transformers import LlamaConfig, MistralConfig

        clash = sorted(set(extra) & {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                                     "tie_word_embeddings", "rope_theta", "twell_ffn"})
        if clash:
            raise ValueError(f"to_hf_config: {clash} come from the ModelConfig, not from extra")
        ids = {"bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id}
        ids.update({k: extra.pop(k) for k in TOKEN_IDS if k in extra})
        arch = {}
        if self.arch == "mistral":
            arch = {"sliding_window": self.sliding_window}
        elif self.arch == "minicpm":
            arch = {k: getattr(self, k) for k in MINICPM_KEYS}
        cfg = (MistralConfig if self.arch == "mistral" else LlamaConfig)(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads,
            hidden_act="silu" if self.activation == "silu" else "relu",
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_embeddings,
            initializer_range=self.init_std,
            rope_theta=float(self.rope_theta),
            use_cache=False,
            twell_ffn=self.ffn,
            **({} if self.arch == "mistral" else {"attention_bias": False, "mlp_bias": False}),
            **arch,
            **ids,
            **extra,
        )
        cfg._attn_implementation = self.attn_implementation
        theta = rope_theta_of(cfg)
        if theta is None or abs(theta - float(self.rope_theta)) > 1e-6 * float(self.rope_theta):
            raise RuntimeError(f"transformers did not keep rope_theta={self.rope_theta} (got {theta})")
        return cfg


def rope_theta_of(hf_config) -> float | None:
    """RoPE base of a LlamaConfig across transformers 4.x (``rope_theta``) and 5.x (``rope_parameters``)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, Mapping) and "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(hf_config, "rope_theta", None)
    return None if theta is None else float(theta)


# model_type of each format load_pretrained reads -> arch (docs/models.md). "bamboo" is TurboSparse-Mistral's
# (its remote modelling code: a Mistral whose MLP is dReLU although config.json says hidden_act relu).
MODEL_TYPES = {"llama": "llama", "llama_sparse_relu": "llama", "minicpm": "minicpm", "mistral": "mistral",
               "bamboo": "mistral"}


def _number(d: Mapping[str, Any], key: str, why: str, *, positive: bool = False) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v <= 0):
        raise ValueError(f"config.json: {why} needs {key} to be a {'positive' if positive else 'non-negative'} number, "
                         f"got {v!r}")
    return v


def from_hf_dict(d: Mapping[str, Any]) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, notes) from a config.json dict of a Llama-family checkpoint.

    Understands plain Llama configs (``hidden_act`` relu/silu), configs written by this project
    (``twell_ffn``), the paper's released configs (``model_type`` ``llama_sparse_relu`` with
    ``sparsity_*`` fields, whose MLP is always ReLU whatever ``hidden_act`` says), FATReLU configs
    (``hidden_act: fatrelu`` with its threshold in ``hidden_act_param``: ProSparse-Llama-2, MiniCPM-S),
    MiniCPM (``model_type: minicpm``: ``scale_emb``, ``scale_depth``, ``dim_model_base``) and
    TurboSparse-Mistral (``model_type: bamboo``: dReLU, GQA, a sliding window). What cannot be computed
    exactly raises a ValueError naming the config key (docs/models.md).
    """
    notes: dict[str, Any] = {}
    mt = str(d.get("model_type", "llama"))
    sparse_family = mt.endswith("_sparse_relu") or any(str(k).startswith("sparsity_") for k in d)
    if mt not in MODEL_TYPES and not sparse_family:
        raise ValueError(f"unsupported model_type {mt!r}: load_pretrained reads {sorted(MODEL_TYPES)} "
                         "(Llama, MiniCPM, Mistral and TurboSparse's bamboo; docs/models.md)")
    arch = MODEL_TYPES.get(mt, "llama")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if d.get(k) is None]
    if missing:
        raise ValueError(f"config.json of a {mt} checkpoint lacks {missing}")
    intermediate = d["intermediate_size"]
    threshold = 0.0
    act = d.get("hidden_act", "silu")
    if "twell_ffn" in d:
        ffn = d["twell_ffn"]
        if ffn == "fatrelu_gated":
            threshold = _number(d, "hidden_act_param", "twell_ffn fatrelu_gated (FATReLU)")
    elif sparse_family:
        ffn = "relu_gated" if d.get("sparsity_gated_mlp", True) else "relu"
        intermediate = d.get("sparsity_new_intermediate_size") or intermediate
        notes["converted_from"] = f"{mt} (sparsity_* config: ReLU MLP regardless of hidden_act={d.get('hidden_act')!r})"
    elif mt == "bamboo":
        if act != "relu":
            raise ValueError(f"unsupported hidden_act {act!r} for model_type 'bamboo': its MLP is dReLU, "
                             "relu(gate) * relu(up), with hidden_act 'relu'")
        ffn = "drelu_gated"
        notes["converted_from"] = "bamboo (TurboSparse: dReLU MLP, relu on gate and up; FFN predictor weights dropped)"
    elif act == "relu":
        ffn = "relu_gated"
    elif act == "fatrelu":
        ffn = "fatrelu_gated"
        threshold = _number(d, "hidden_act_param", "hidden_act fatrelu (FATReLU: the gate passes where it is above "
                            "the threshold)")
    elif act == "drelu":  # this project's own name, written by save_pretrained for dReLU models
        ffn = "drelu_gated"
    elif act == "silu":
        ffn = "silu_gated"
    else:
        raise ValueError(f"unsupported hidden_act {act!r}: twell models use 'relu', 'fatrelu' (with hidden_act_param) "
                         "or the bamboo model_type's dReLU (sparse), or 'silu' (dense)")
    scales: dict[str, Any] = {}
    if arch == "minicpm":
        for key in ("num_experts",):
            if d.get(key):
                raise ValueError(f"unsupported {key}={d[key]}: MiniCPM's mixture of experts is not a SparseFFN model")
        scales = {"scale_emb": _number(d, "scale_emb", "MiniCPM", positive=True),
                  "scale_depth": _number(d, "scale_depth", "MiniCPM", positive=True),
                  "dim_model_base": _number(d, "dim_model_base", "MiniCPM", positive=True)}
        if not float(scales["dim_model_base"]).is_integer():
            raise ValueError(f"config.json: dim_model_base must be an integer, got {scales['dim_model_base']!r}")
        scales["dim_model_base"] = int(scales["dim_model_base"])
    elif any(k in d for k in MINICPM_KEYS):
        raise ValueError(f"config.json has MiniCPM's {[k for k in MINICPM_KEYS if k in d]} but model_type {mt!r}: "
                         "only model_type 'minicpm' applies them")
    window = None
    if arch == "mistral":
        window = d.get("sliding_window")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"config.json: sliding_window must be null or a positive integer, got {window!r}")
    elif d.get("sliding_window") is not None and d.get("use_sliding_window", True):
        raise ValueError(f"unsupported sliding_window={d['sliding_window']} for model_type {mt!r}: only the "
                         "Mistral formats (mistral, bamboo) attend through a window")
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), Mapping) else {}
    theta = d.get("rope_theta") if d.get("rope_theta") is not None else params.get("rope_theta")
    # Checked whatever else the config says: a top-level rope_theta beside a llama3 / yarn RoPE is common.
    for key, spec in (("rope_parameters", params), ("rope_scaling", d.get("rope_scaling") or {})):
        rtype = spec.get("rope_type", spec.get("type", "default")) if isinstance(spec, Mapping) else spec
        if rtype != "default":
            raise ValueError(f"unsupported {key} {spec!r}; only the default RoPE is supported")
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag):
            raise ValueError(f"unsupported {flag}=True; twell models are bias-free like the paper's")
    n_heads = d["num_attention_heads"]
    head_dim = d.get("head_dim")
    if head_dim == d["hidden_size"] // n_heads:
        head_dim = None
    # ModelConfig keeps one eos id (what training needs); load_pretrained hands the checkpoint's own
    # bos / eos (a list included) / pad ids to the transformers config.
    eos = d.get("eos_token_id", 0)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    cfg = ModelConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=intermediate,
        num_layers=d["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=d.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        ffn=ffn,
        rope_theta=float(theta if theta is not None else 10000.0),
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        # transformers' LlamaConfig / MistralConfig default; MiniCPM's own config class ties by default
        tie_embeddings=d.get("tie_word_embeddings", arch == "minicpm"),
        init_std=d.get("initializer_range", 0.02),
        bos_token_id=d.get("bos_token_id") if d.get("bos_token_id") is not None else 0,
        eos_token_id=eos if eos is not None else 0,
        gate_threshold=float(threshold),
        arch=arch,
        sliding_window=window,
        **scales,
    )
    return cfg, notes
