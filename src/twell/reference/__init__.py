"""Pure-PyTorch reference ops: the contract every CUDA kernel meets (same signatures)."""
from twell.reference.ffn import (
    check_ffn_args, check_gate_args, dense_gated_ffn, sparse_gated_ffn, twell_ffn, twell_gate, twell_gated_ffn,
)
from twell.reference.decode import DECODE_MAX_ROWS, check_decode_args, decode_gated_ffn
from twell.reference.hybrid import hybrid_gated_ffn, hybrid_mul, hybrid_sddmm, hybrid_spmm, hybrid_tmm

__all__ = [
    "DECODE_MAX_ROWS", "check_decode_args", "check_ffn_args", "check_gate_args", "decode_gated_ffn", "dense_gated_ffn", "hybrid_gated_ffn", "hybrid_mul", "hybrid_sddmm",
    "hybrid_spmm", "hybrid_tmm", "sparse_gated_ffn", "twell_ffn", "twell_gate", "twell_gated_ffn",
]
