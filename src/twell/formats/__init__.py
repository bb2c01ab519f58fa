"""Sparse activation formats: TwELL (inference) and hybrid ELL + dense backup (training)."""
from twell.formats.checks import check_tensor, check_tiling
from twell.formats.hybrid import Hybrid, HybridCapacityError, HybridStatus, pack_hybrid
from twell.formats.twell import TwELL, pack_twell, twell_nbytes, unpack_twell

__all__ = [
    "Hybrid", "HybridCapacityError", "HybridStatus", "TwELL", "check_tensor", "check_tiling",
    "pack_hybrid", "pack_twell", "twell_nbytes", "unpack_twell",
]
