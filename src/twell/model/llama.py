"""A transformers ``LlamaForCausalLM`` whose MLPs are :class:`twell.nn.SparseFFN` modules.

SparseFFN keeps the Llama parameter names (``gate_proj``, ``up_proj``, ``down_proj``), so the
state dict is exactly a Llama state dict: ``save_pretrained`` output loads in plain transformers.
The model knows nothing about parallelism, compile or checkpointing (see ``twell.train.parallel``).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from twell.model.config import ModelConfig
from twell.nn import SparseFFN
from twell.nn.ffn import call_input


def as_model_config(cfg: Any) -> ModelConfig:
    """Accept a ModelConfig, a ``model:`` mapping, or anything with a ``.model`` ModelConfig (a run config)."""
    if isinstance(cfg, ModelConfig):
        return cfg
    if isinstance(getattr(cfg, "model", None), ModelConfig):
        return cfg.model
    if isinstance(cfg, Mapping):
        return ModelConfig.from_dict(cfg)
    raise TypeError(f"expected a ModelConfig, a mapping of model fields or a run config, got {type(cfg).__name__}")


def build_model(cfg: Any, **hf_extra: Any):
    """A freshly initialised ``LlamaForCausalLM`` with SparseFFN MLPs, fp32, on the current default device
    (``MistralForCausalLM`` for arch mistral; a Llama with MiniCPM's scaling for arch minicpm).

    Initialisation is transformers' Llama initialisation (normal(0, init_std) for Linear and
    Embedding weights), so under the same torch seed every process builds identical weights.
    """
    from transformers import LlamaForCausalLM, MistralForCausalLM

    mc = as_model_config(cfg)
    model = (MistralForCausalLM if mc.arch == "mistral" else LlamaForCausalLM)(mc.to_hf_config(**hf_extra))
    swap_mlps(model, mc)
    if mc.activation in ("fatrelu", "drelu"):
        # what the MLPs compute, as the formats write it: plain transformers has no such activation and refuses
        # a saved copy instead of computing ReLU
        model.config.hidden_act = mc.activation
        if mc.activation == "fatrelu":
            model.config.hidden_act_param = mc.gate_threshold
    if mc.arch == "minicpm":
        from twell.model.minicpm import apply_minicpm_scaling

        apply_minicpm_scaling(model, mc.scale_emb, mc.scale_depth, mc.dim_model_base)
    return model


def swap_mlps(model: nn.Module, mc: ModelConfig, path: str = "auto") -> None:
    """Replace every decoder layer's MLP by a SparseFFN of kind ``mc.ffn`` (in place).

    Gated kinds wrap the existing Linear modules (no copy, same initialisation); the non-gated
    kind drops ``gate_proj`` and keeps ``up_proj``/``down_proj``.
    """
    for i, layer in enumerate(decoder_layers(model)):
        mlp = layer.mlp
        if isinstance(mlp, SparseFFN):
            continue
        if mc.activation in ("fatrelu", "drelu"):  # the transformers MLP was built with ReLU: its projections only
            ffn = SparseFFN(mc.hidden_size, mc.intermediate_size, activation=mc.activation,
                            threshold=mc.gate_threshold, path="dense")
            ffn.gate_proj, ffn.up_proj, ffn.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        elif mc.gated:
            ffn = SparseFFN.from_llama_mlp(mlp, activation=mc.activation, path="dense")
        else:
            ffn = SparseFFN(mc.hidden_size, mc.intermediate_size, gated=False, activation="relu", path="dense")
            ffn.up_proj, ffn.down_proj = mlp.up_proj, mlp.down_proj
        ffn.path = path if mc.sparse else "dense"
        ffn.layer_idx = i
        layer.mlp = ffn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a LlamaForCausalLM (``model.model.layers``), or a clear TypeError."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"expected a LlamaForCausalLM (model.model.layers), got {type(model).__name__}")
    return layers


def sparse_ffns(model: nn.Module) -> list[SparseFFN]:
    """The model's SparseFFN modules in layer order (works through FSDP/compile/checkpoint wrappers)."""
    return [m for m in model.modules() if isinstance(m, SparseFFN)]


def capture_ffn_inputs(model: nn.Module, ffns: list[SparseFFN], *args: Any, **kwargs: Any) -> list[torch.Tensor | None]:
    """Run ``model(*args, **kwargs)`` once without gradients and return, per layer of ``ffns``, every input it
    received flattened to rows and concatenated ([tokens, D], detached), or None where it was not called.
    The calibration forward of the per-layer path choices (``choose_union_paths``, ``choose_row_paths``)."""
    seen: list[list[torch.Tensor]] = [[] for _ in ffns]

    def keep(i):
        def hook(mod, args_, kwargs_):
            x = call_input(args_, kwargs_)
            seen[i].append(x.detach().reshape(-1, x.shape[-1]))
        return hook

    hooks = [f.register_forward_pre_hook(keep(i), with_kwargs=True) for i, f in enumerate(ffns)]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(xs) if xs else None for xs in seen]


def set_ffn_path(model: nn.Module, path: str) -> None:
    """Set the inference path ("auto", "dense", "reference", "kernel") of every SparseFFN layer."""
    ffns = sparse_ffns(model)
    if not ffns:
        raise ValueError("the model has no SparseFFN layers; build it with twell.model.build_model or load_pretrained")
    for i, ffn in enumerate(ffns):
        try:
            ffn.path = path
        except ValueError as exc:
            raise ValueError(f"layer {i}: {exc}") from None


def set_tracking(model: nn.Module, on: bool = True) -> None:
    """Make every SparseFFN record ``stats`` (needed for the L1 loss and the sparsity tracker)."""
    for ffn in sparse_ffns(model):
        ffn.track = on
        if not on:
            ffn.stats = None


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast the parameters to ``dtype`` and leave buffers alone, as ``from_pretrained(dtype=...)`` does.

    ``model.to(bf16)`` would also round RoPE's fp32 inverse frequencies to bf16 and shift every
    rotary angle (logits differ from transformers' by up to ~4e-3 on small models).
    """
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Total, embedding and non-embedding parameter counts (tied weights counted once)."""
    seen: set[int] = set()
    total = emb = 0
    emb_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        total += n
        if id(p) in emb_ids:
            emb += n
    return {"total": total, "embedding": emb, "non_embedding": total - emb}


@torch.no_grad()
def logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits [B, T, V] for int64 token ids [B, T] (no KV cache)."""
    return model(input_ids=input_ids, use_cache=False).logits.float()
