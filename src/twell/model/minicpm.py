"""MiniCPM's scaling on a transformers Llama: the three places where MiniCPM differs from Llama.

With ``L`` layers and width ``D``, MiniCPM computes

- the input: ``embed_tokens(ids) * scale_emb``;
- each block: ``h + attn(norm(h)) * s`` and ``h + mlp(norm(h)) * s`` with ``s = scale_depth / sqrt(L)``;
- the logits: ``lm_head(norm(h) / (D / dim_model_base))``.

The parameters keep their Llama names (a MiniCPM checkpoint's keys), so the embedding and the head are
subclasses of their modules with one multiplication more, and the block outputs are scaled by forward
hooks on each layer's ``self_attn`` and ``mlp`` (a ``SparseFFN``), which leave the MLP's own paths as
they are. docs/models.md#minicpm-s-1b.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class ScaledEmbedding(nn.Embedding):
    """``nn.Embedding`` whose output is multiplied by ``scale`` (MiniCPM's ``scale_emb``)."""

    scale: float = 1.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:g}"


class ScaledHead(nn.Linear):
    """``nn.Linear`` applied to its input divided by ``width`` (MiniCPM's ``hidden_size / dim_model_base``)."""

    width: float = 1.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h / self.width, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, divided by {self.width:g}"


class ScaleOutput:
    """Forward hook multiplying a module's output (or its first element, for attention) by ``scale``."""

    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, module, args, out):
        if isinstance(out, tuple):
            return (out[0] * self.scale, *out[1:])
        return out * self.scale

    def __repr__(self) -> str:
        return f"ScaleOutput({self.scale:g})"


def _as(cls, module: nn.Module, **attrs) -> nn.Module:
    """``module`` re-typed as its subclass ``cls`` (same parameters, same state-dict keys) with ``attrs``."""
    if type(module) not in cls.__mro__:
        raise TypeError(f"expected a {cls.__mro__[1].__name__}, got {type(module).__name__}")
    module.__class__ = cls
    for k, v in attrs.items():
        setattr(module, k, v)
    return module


def apply_minicpm_scaling(model: nn.Module, scale_emb: float, scale_depth: float, dim_model_base: int) -> nn.Module:
    """Make a ``LlamaForCausalLM`` compute MiniCPM (in place; the parameters are not changed)."""
    from twell.model.llama import decoder_layers

    layers = decoder_layers(model)
    _as(ScaledEmbedding, model.model.embed_tokens, scale=float(scale_emb))
    _as(ScaledHead, model.lm_head, width=model.config.hidden_size / dim_model_base)
    hook = ScaleOutput(scale_depth / math.sqrt(len(layers)))
    for layer in layers:
        layer.self_attn.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)
    return model
