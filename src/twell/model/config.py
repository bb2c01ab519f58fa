"""The model's shape as a handful of plain values, and its translation to a transformers LlamaConfig.

``ffn`` picks the feedforward block:

- ``relu_gated``  h = relu(x Wg^T) * (x Wu^T)   (the paper's sparse model; a plain Llama with ReLU)
- ``relu``        h = relu(x Wu^T)              (non-gated ablation; no ``gate_proj``)
- ``silu_gated``  h = silu(x Wg^T) * (x Wu^T)   (the standard dense Llama baseline)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from twell.config_util import dataclass_from_dict  # also imported from here by older callers

FFN_KINDS = ("relu_gated", "relu", "silu_gated")
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

    @property
    def gated(self) -> bool:
        return self.ffn != "relu"

    @property
    def activation(self) -> str:
        return "silu" if self.ffn == "silu_gated" else "relu"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "model") -> "ModelConfig":
        return dataclass_from_dict(cls, d, where)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_hf_config(self, **extra: Any):
        """A ``transformers.LlamaConfig``; ``extra`` becomes additional (serialised) attributes, or
        replaces the token ids (a checkpoint's list of eos ids, its pad id)."""
        from transformers import LlamaConfig

        clash = sorted(set(extra) & {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                                     "tie_word_embeddings", "rope_theta", "twell_ffn"})
        if clash:
            raise ValueError(f"to_hf_config: {clash} come from the ModelConfig, not from extra")
        ids = {"bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id}
        ids.update({k: extra.pop(k) for k in TOKEN_IDS if k in extra})
        cfg = LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads,
            hidden_act=self.activation,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_embeddings,
            initializer_range=self.init_std,
            rope_theta=float(self.rope_theta),
            attention_bias=False,
            mlp_bias=False,
            use_cache=False,
            twell_ffn=self.ffn,
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


def from_hf_dict(d: Mapping[str, Any]) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, notes) from a config.json dict of a Llama-family checkpoint.

    Understands plain Llama configs (``hidden_act`` relu/silu), configs written by this project
    (``twell_ffn``) and the paper's released configs (``model_type`` ``llama_sparse_relu`` with
    ``sparsity_*`` fields, whose MLP is always ReLU whatever ``hidden_act`` says).
    """
    notes: dict[str, Any] = {}
    mt = str(d.get("model_type", "llama"))
    sparse_family = mt.endswith("_sparse_relu") or any(str(k).startswith("sparsity_") for k in d)
    if mt not in ("llama", "llama_sparse_relu") and not sparse_family:
        raise ValueError(f"expected a Llama-family checkpoint (model_type 'llama' or 'llama_sparse_relu'), got {mt!r}")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if d.get(k) is None]
    if missing:
        raise ValueError(f"config.json of a Llama checkpoint lacks {missing}")
    intermediate = d["intermediate_size"]
    if "twell_ffn" in d:
        ffn = d["twell_ffn"]
    elif sparse_family:
        ffn = "relu_gated" if d.get("sparsity_gated_mlp", True) else "relu"
        intermediate = d.get("sparsity_new_intermediate_size") or intermediate
        notes["converted_from"] = f"{mt} (sparsity_* config: ReLU MLP regardless of hidden_act={d.get('hidden_act')!r})"
    else:
        act = d.get("hidden_act", "silu")
        if act == "relu":
            ffn = "relu_gated"
        elif act == "silu":
            ffn = "silu_gated"
        else:
            raise ValueError(f"unsupported hidden_act {act!r}: twell models use 'relu' (sparse) or 'silu' (dense)")
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
        tie_embeddings=d.get("tie_word_embeddings", False),  # transformers' LlamaConfig default
        init_std=d.get("initializer_range", 0.02),
        bos_token_id=d.get("bos_token_id") if d.get("bos_token_id") is not None else 0,
        eos_token_id=eos if eos is not None else 0,
    )
    return cfg, notes
