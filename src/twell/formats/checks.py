"""Input checks shared by the formats, the reference ops and the kernel wrappers.

Errors name what was expected and what arrived, e.g.
``x: expected bfloat16 [M, 2048] contiguous, got float32 [4, 7]``.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

Dim = Union[int, str, None]  # an int must match; a str names a free dimension; None = any


# Names without the "torch." prefix, by lookup: messages are built with f-strings and lookups only,
# which dynamo traces (not str(), str.replace or str + str), so a check that fails inside
# torch.compile still carries its text.
_DTYPE_NAMES = {getattr(torch, n): n for n in ("bfloat16", "float16", "float32", "float64", "int8", "int16",
                                              "int32", "int64", "uint8", "uint32", "bool")}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype) or f"{dtype}"


def describe(t: torch.Tensor) -> str:
    layout = "" if t.is_contiguous() else " non-contiguous"
    return f"{_dtype_name(t.dtype)} {list(t.shape)} on {t.device}{layout}"


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    dtype: Optional[torch.dtype] = None,
    shape: Optional[Sequence[Dim]] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = False,
) -> None:
    """Raise TypeError/ValueError with a message naming the expectation when ``t`` does not fit.

    The message is built only on failure: torch.compile traces these checks, and with dynamic shapes
    a dimension is a SymInt that cannot be formatted while tracing."""
    def message(got: str, tail: str = "", not_a_tensor: bool = False) -> str:
        want = []
        if dtype is not None:
            want.append(_dtype_name(dtype))
        if shape is not None:
            want.append("[" + ", ".join("*" if d is None else f"{d}" for d in shape) + "]")
        if device is not None:
            want.append(f"on {device}")
        if contiguous:
            want.append("contiguous")
        expected = " ".join(want)
        if not_a_tensor:
            expected = f"a torch.Tensor ({expected})"
        return f"{name}: expected {expected}, got {got}{tail}"

    if not isinstance(t, torch.Tensor):
        raise TypeError(message(type(t).__name__, not_a_tensor=True))
    if dtype is not None and t.dtype != dtype:
        raise TypeError(message(describe(t)))
    if shape is not None:
        ok = t.dim() == len(shape) and all(
            not isinstance(d, (int, torch.SymInt)) or t.shape[i] == d for i, d in enumerate(shape)
        )
        if not ok:
            raise ValueError(message(describe(t)))
    if device is not None and t.device != torch.device(device):
        raise ValueError(message(describe(t), " (all inputs must be on one device)"))
    if contiguous and not t.is_contiguous():
        raise ValueError(message(describe(t), "; call .contiguous() first"))


def check_tiling(tile: int, compression: int) -> int:
    """Validate the TwELL tile width T and compression C; return the slots per tile, T // C."""
    for label, v in (("tile", tile), ("compression", compression)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{label} must be a positive int, got {v!r}")
    if tile % compression:
        raise ValueError(f"tile width T={tile} must be a multiple of the compression factor C={compression}")
    slots = tile // compression
    if slots < 2:
        raise ValueError(f"T/C = {tile}/{compression} leaves {slots} slot per tile; need >= 2 (count + 1 entry)")
    return slots


def leading_nonzeros(h: torch.Tensor, k: int, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, columns) of the first ``k`` nonzeros of each row of ``h`` along the last dimension,
    in ascending column order; slots past a row's count (``counts``, int) hold (0, column 0)."""
    nonzero = h != 0  # NaN counts as a nonzero
    order = torch.sort((~nonzero).to(torch.int8), dim=-1, stable=True).indices[..., :k]
    valid = torch.arange(order.shape[-1], device=h.device) < counts[..., None]
    vals = torch.where(valid, torch.gather(h, -1, order), torch.zeros((), dtype=h.dtype, device=h.device))
    cols = torch.where(valid, order, torch.zeros((), dtype=order.dtype, device=h.device))
    return vals, cols
