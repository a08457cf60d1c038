"""Safe encoding of non-tensor state into JSON (FORMAT.md, "Objects").

Plain JSON types stay as they are; everything else is a tagged object
``{"$bcp": TAG, ...}``. Decoding builds values from a fixed list of types and never
imports or calls anything named by the checkpoint. Pickle is available only when the
caller opts in on both save and load.
"""

from __future__ import annotations

import base64
import collections
import math
import pickle
from typing import Any

import numpy as np
import torch

from .errors import FormatError, PickleNotAllowedError, UnsupportedStateError
from .tensor_io import byte_view, host_contiguous
from .torch_dtypes import dtype_name, torch_dtype

TAG = "$bcp"
_NP_KINDS = "biufcmMSU"


def _b64(data) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def encode(value: Any, *, fqn: str, allow_pickle: bool = False) -> Any:
    """JSON-ready form of ``value``; UnsupportedStateError naming the key if it has none."""
    return _Encoder(fqn, allow_pickle).enc(value, "")


def decode(doc: Any, *, fqn: str, allow_pickle: bool = False) -> Any:
    try:
        return _decode(doc, fqn, allow_pickle)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, (FormatError, UnsupportedStateError)):
            raise
        raise FormatError(f"object {fqn!r}: malformed encoding ({type(e).__name__}: {e})") from e


class _Encoder:
    def __init__(self, fqn: str, allow_pickle: bool) -> None:
        self.fqn, self.allow_pickle = fqn, allow_pickle

    def enc(self, v: Any, where: str) -> Any:
        t = type(v)
        if v is None or t is bool or t is int or t is str:
            return v
        if t is float:
            return v if math.isfinite(v) else {TAG: "float", "v": repr(v)}
        if t is list:
            return [self.enc(x, f"{where}[{i}]") for i, x in enumerate(v)]
        if t is tuple:
            return {TAG: "tuple", "v": [self.enc(x, f"{where}[{i}]") for i, x in enumerate(v)]}
        if t is dict or t is collections.OrderedDict:
            tag = "dict" if t is dict else "odict"
            if t is dict and all(type(k) is str for k in v) and TAG not in v:
                return {k: self.enc(x, f"{where}[{k!r}]") for k, x in v.items()}
            return {
                TAG: tag,
                "v": [[self.enc(k, f"{where}<key>"), self.enc(x, f"{where}[{k!r}]")] for k, x in v.items()],
            }
        if t is set or t is frozenset:
            return {TAG: t.__name__, "v": [self.enc(x, f"{where}<item>") for x in v]}
        if t is bytes or t is bytearray:
            return {TAG: t.__name__, "v": _b64(v)}
        if t is complex:
            return {TAG: "complex", "v": [repr(v.real), repr(v.imag)]}
        if isinstance(v, torch.Tensor) and t in (torch.Tensor, torch.nn.Parameter):
            c = host_contiguous(v)
            return {
                TAG: "tensor",
                "dtype": dtype_name(c.dtype, fqn=self.fqn + where),
                "shape": list(c.shape),
                "v": _b64(byte_view(c)),
            }
        if t is torch.dtype:
            return {TAG: "dtype", "v": dtype_name(v, fqn=self.fqn + where)}
        if t is torch.Size:
            return {TAG: "size", "v": list(v)}
        if t is torch.device:
            return {TAG: "device", "v": str(v)}
        if isinstance(v, (np.ndarray, np.generic)) and v.dtype.kind in _NP_KINDS:
            arr = np.asarray(v)  # tobytes() is C-order for any layout
            return {
                TAG: "ndarray" if t is np.ndarray else "npscalar",
                "dtype": arr.dtype.str,
                "shape": list(arr.shape),
                "v": _b64(arr.tobytes()),
            }
        if self.allow_pickle:
            return {TAG: "pickle", "v": _b64(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL))}
        raise UnsupportedStateError(
            f"cannot save the object at key {self.fqn!r}{' (at ' + where + ')' if where else ''}: "
            f"type {t.__module__}.{t.__qualname__} has no safe encoding. Convert it to plain types "
            "(dict, list, tuple, str, int, float, bool, None, bytes, tensors, numpy arrays) or pass "
            "allow_pickle=True to both save and load (loading then runs code stored in the checkpoint)"
        )


def _decode(d: Any, fqn: str, allow_pickle: bool) -> Any:
    if d is None or isinstance(d, (bool, int, float, str)):
        return d
    if isinstance(d, list):
        return [_decode(x, fqn, allow_pickle) for x in d]
    if not isinstance(d, dict):
        raise FormatError(f"object {fqn!r}: unexpected JSON value {d!r}")
    if TAG not in d:
        return {k: _decode(x, fqn, allow_pickle) for k, x in d.items()}
    tag = d[TAG]
    v: Any = d.get("v")  # a JSON value, checked by the branch of its tag
    if tag == "float":
        if v not in ("nan", "inf", "-inf"):
            raise FormatError(f"object {fqn!r}: bad float {v!r}")
        return float(v)
    if tag == "tuple":
        return tuple(_decode(x, fqn, allow_pickle) for x in v)
    if tag in ("dict", "odict"):
        pairs = [(_decode(k, fqn, allow_pickle), _decode(x, fqn, allow_pickle)) for k, x in v]
        return dict(pairs) if tag == "dict" else collections.OrderedDict(pairs)
    if tag in ("set", "frozenset"):
        items = [_decode(x, fqn, allow_pickle) for x in v]
        return set(items) if tag == "set" else frozenset(items)
    if tag == "bytes":
        return _unb64(v)
    if tag == "bytearray":
        return bytearray(_unb64(v))
    if tag == "complex":
        return complex(float(v[0]), float(v[1]))
    if tag == "tensor":
        dtype = torch_dtype(d["dtype"], fqn=fqn)
        shape = [int(n) for n in d["shape"]]
        raw = bytearray(_unb64(v))
        numel = math.prod(shape)
        if len(raw) != numel * dtype.itemsize:
            raise FormatError(f"object {fqn!r}: tensor bytes do not match shape {shape} of {d['dtype']}")
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape).clone()
    if tag == "dtype":
        return torch_dtype(v, fqn=fqn)
    if tag == "size":
        return torch.Size(int(n) for n in v)
    if tag == "device":
        return torch.device(v)
    if tag in ("ndarray", "npscalar"):
        np_dtype = np.dtype(d["dtype"])
        if np_dtype.kind not in _NP_KINDS or np_dtype.fields is not None:
            raise FormatError(f"object {fqn!r}: numpy dtype {d['dtype']!r} is not allowed")
        arr = np.frombuffer(_unb64(v), dtype=np_dtype).reshape([int(n) for n in d["shape"]]).copy()
        return arr if tag == "ndarray" else arr[()]
    if tag == "pickle":
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"object {fqn!r} was pickled at save time; loading it runs code from the checkpoint. "
                "Pass allow_pickle=True only if you trust where this checkpoint came from",
                fqn=fqn,
            )
        return pickle.loads(_unb64(v))  # allow_pickle: caller opted in explicitly
    raise FormatError(f"object {fqn!r}: unknown tag {tag!r}")
