"""Modules: the sparse-capable Llama feedforward block."""
from twell.nn.ffn import FFNStats, SparseFFN

__all__ = ["FFNStats", "SparseFFN"]
