"""torch dtype <-> the format's dtype names (bcp.metadata.dtypes)."""

from __future__ import annotations

import torch

from bcp.errors import FormatError, UnsupportedStateError
from bcp.metadata.dtypes import DTYPE_ITEMSIZE

# Built from torch at import: a dtype this torch lacks (older releases) is simply absent.
_BY_NAME: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in DTYPE_ITEMSIZE if isinstance(getattr(torch, name, None), torch.dtype)
}
_BY_DTYPE: dict[torch.dtype, str] = {d: n for n, d in _BY_NAME.items()}


def dtype_name(dtype: torch.dtype, *, fqn: str = "?") -> str:
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise UnsupportedStateError(
            f"tensor at key {fqn!r} has dtype {dtype}, which bcp cannot store as raw bytes "
            "(quantized tensors are not supported; dequantize or save int_repr() and scales)"
        ) from None


def torch_dtype(name: str, *, fqn: str = "?") -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise FormatError(f"tensor {fqn!r} has dtype {name!r}, which this torch ({torch.__version__}) lacks") from None


def torch_dtype_or_none(name: str) -> torch.dtype | None:
    """:func:`torch_dtype`, None for a name this torch lacks (the caller's general path reports it)."""
    return _BY_NAME.get(name)
