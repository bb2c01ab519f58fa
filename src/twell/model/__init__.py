"""Llama-style models built on transformers with SparseFFN MLPs, and Hugging Face save/load.

- :func:`build_model` (``ModelConfig`` -> ``LlamaForCausalLM`` with SparseFFN MLPs)
- :func:`load_pretrained` / :func:`save_pretrained` (Llama checkpoints with ReLU, FATReLU or dReLU gates;
  MiniCPM and Mistral formats load too: docs/models.md)
- :func:`cast_parameters` (dtype change that keeps RoPE buffers fp32)
- :func:`set_ffn_path`, :func:`set_tracking`, :func:`sparse_ffns` (per-layer FFN control)
- :func:`choose_union_paths`, :func:`choose_row_paths` (per-layer path choices timed on a calibration batch)
"""
from twell.model.config import FFN_KINDS, ModelConfig, from_hf_dict
from twell.model.hub import load_pretrained, read_state_dict, save_pretrained
from twell.model.llama import (build_model, cast_parameters, count_parameters, logits, set_ffn_path, set_tracking,
                               sparse_ffns, swap_mlps)
from twell.model.row_paths import choose_row_paths
from twell.model.union_paths import choose_union_paths

__all__ = [
    "FFN_KINDS", "ModelConfig", "build_model", "cast_parameters", "choose_row_paths", "choose_union_paths", "count_parameters",
    "from_hf_dict", "load_pretrained", "logits", "read_state_dict", "save_pretrained", "set_ffn_path", "set_tracking",
    "sparse_ffns", "swap_mlps",
]
