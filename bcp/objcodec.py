"""Safe encoding of non-tensor state into JSON (FORMAT.md, "Objects").

Plain JSON types stay as they are; everything else is a tagged object
``{"$bcp": TAG, ...}``. Decoding builds values from a fixed list of types and never
imports or calls anything named by the checkpoint; whatever the stored JSON, it
returns a value or raises FormatError naming the key (PickleNotAllowedError for a
refused pickle), never another exception. Pickle is available only when the caller
opts in on both save and load. Encodings nest at most MAX_OBJECT_DEPTH JSON levels,
so every reader can parse the manifest that holds them.
"""

from __future__ import annotations

import base64
import collections
import math
import pickle
from typing import Any

import numpy as np
import torch

from bcp.errors import CheckpointError, FormatError, PickleNotAllowedError, UnsupportedStateError
from bcp.metadata.manifest import MANIFEST_KEY, MAX_OBJECT_DEPTH
from bcp.tensor_io import byte_view, host_contiguous
from bcp.torch_dtypes import dtype_name, torch_dtype

TAG = "$bcp"
_NP_KINDS = "biufcmMSU"
_INT64_MAX = (1 << 63) - 1


def _b64(data: bytes | bytearray | memoryview) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def encode(value: Any, *, fqn: str, allow_pickle: bool = False) -> Any:
    """JSON-ready form of ``value``; UnsupportedStateError naming the key if it has none."""
    return _Encoder(fqn, allow_pickle).enc(value, "", 0)


def decode(doc: Any, *, fqn: str, allow_pickle: bool = False, where: str = MANIFEST_KEY) -> Any:
    """The value ``doc`` encodes; FormatError naming ``fqn`` and ``where`` (the manifest
    holding it) for anything FORMAT.md does not allow (PickleNotAllowedError for a
    pickle the caller did not allow)."""
    try:
        return _Decoder(fqn, allow_pickle, where).dec(doc, 0)
    except CheckpointError:
        raise
    except Exception as e:  # whatever a malformed value trips over is a format error
        raise FormatError(f"object {fqn!r} in {where}: malformed encoding ({type(e).__name__}: {e})") from e


class _Encoder:
    def __init__(self, fqn: str, allow_pickle: bool) -> None:
        self.fqn, self.allow_pickle = fqn, allow_pickle

    def nest(self, depth: int, where: str) -> int:
        """``depth`` (JSON arrays and objects around a value), refused past what readers parse."""
        if depth > MAX_OBJECT_DEPTH:
            raise UnsupportedStateError(
                f"cannot save the object at key {self.fqn!r}: nested deeper than {MAX_OBJECT_DEPTH} JSON levels "
                f"(at {where or 'its top'}); readers refuse such manifests"
            )
        return depth

    def enc(self, v: Any, where: str, depth: int) -> Any:
        """``depth``: JSON containers already around ``v``'s encoding."""
        t = type(v)
        if v is None or t is bool or t is int or t is str:
            return v
        if t is float:
            return v if math.isfinite(v) else {TAG: "float", "v": repr(v)}
        if t is list:
            d = self.nest(depth + 1, where)
            return [self.enc(x, f"{where}[{i}]", d) for i, x in enumerate(v)]
        if t is tuple:
            d = self.nest(depth + 2, where)
            return {TAG: "tuple", "v": [self.enc(x, f"{where}[{i}]", d) for i, x in enumerate(v)]}
        if t is dict or t is collections.OrderedDict:
            tag = "dict" if t is dict else "odict"
            if t is dict and all(type(k) is str for k in v) and TAG not in v:
                d = self.nest(depth + 1, where)
                return {k: self.enc(x, f"{where}[{k!r}]", d) for k, x in v.items()}
            d = self.nest(depth + 3, where)
            return {
                TAG: tag,
                "v": [[self.enc(k, f"{where}<key>", d), self.enc(x, f"{where}[{k!r}]", d)] for k, x in v.items()],
            }
        if t is set or t is frozenset:
            d = self.nest(depth + 2, where)
            return {TAG: t.__name__, "v": [self.enc(x, f"{where}<item>", d) for x in v]}
        if t is bytes or t is bytearray:
            return {TAG: t.__name__, "v": _b64(v)}
        if t is complex:
            return {TAG: "complex", "v": [repr(v.real), repr(v.imag)]}
        self.nest(depth + 2, where)  # every other encoding: a tagged object holding an array at most
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


class _Decoder:
    """Checks each tagged value's fields before building it (FORMAT.md, "Objects")."""

    def __init__(self, fqn: str, allow_pickle: bool, where: str) -> None:
        self.fqn, self.allow_pickle, self.where = fqn, allow_pickle, where
        self.named = f"{fqn!r} in {where}"  # for messages: the key and the file

    def bad(self, what: str) -> FormatError:
        return FormatError(f"object {self.named}: {what}")

    def nest(self, depth: int) -> int:
        if depth > MAX_OBJECT_DEPTH:
            raise self.bad(f"nested deeper than {MAX_OBJECT_DEPTH} JSON levels")
        return depth

    def items(self, v: Any, tag: str, depth: int) -> list:
        """The decoded items of a tag's ``v`` array (the array is one level below the tag)."""
        if type(v) is not list:
            raise self.bad(f"{tag!r} needs an array in 'v', not {type(v).__name__}")
        d = self.nest(depth + 1)
        return [self.dec(x, d) for x in v]

    def text(self, v: Any, what: str) -> str:
        if type(v) is not str:
            raise self.bad(f"{what} must be a string, not {type(v).__name__}")
        return v

    def shape(self, v: Any) -> list[int]:
        if type(v) is not list or any(type(n) is not int or not 0 <= n <= _INT64_MAX for n in v):
            raise self.bad(f"shape {v!r} is not a list of sizes")
        return v

    def torch_dtype(self, name: str) -> torch.dtype:
        try:
            return torch_dtype(name, fqn=self.fqn)
        except FormatError as e:
            raise self.bad(str(e)) from None

    def unb64(self, v: Any) -> bytes:
        return _unb64(self.text(v, "'v'"))

    def dec(self, d: Any, depth: int) -> Any:
        """``depth``: JSON containers around ``d`` within the value."""
        if d is None or type(d) in (bool, int, float, str):
            return d
        if type(d) is list:
            dd = self.nest(depth + 1)
            return [self.dec(x, dd) for x in d]
        if type(d) is not dict:
            raise self.bad(f"unexpected JSON value of type {type(d).__name__}")
        dd = self.nest(depth + 1)
        if TAG not in d:
            return {k: self.dec(x, dd) for k, x in d.items()}
        tag, v = d[TAG], d.get("v")
        if tag == "float":
            if v not in ("nan", "inf", "-inf"):
                raise self.bad(f"bad float {v!r}")
            return float(v)
        if tag == "tuple":
            return tuple(self.items(v, tag, dd))
        if tag in ("set", "frozenset"):
            items = self.items(v, tag, dd)
            return set(items) if tag == "set" else frozenset(items)
        if tag in ("dict", "odict"):
            pairs = self.items(v, tag, dd)
            if any(type(p) is not list or len(p) != 2 for p in pairs):
                raise self.bad(f"{tag!r} needs [key, value] pairs")
            return dict(pairs) if tag == "dict" else collections.OrderedDict(pairs)
        if tag == "bytes":
            return self.unb64(v)
        if tag == "bytearray":
            return bytearray(self.unb64(v))
        if tag == "complex":
            if type(v) is not list or len(v) != 2:
                raise self.bad(f"complex needs [real, imag], not {v!r}")
            return complex(float(self.text(v[0], "real part")), float(self.text(v[1], "imaginary part")))
        if tag == "tensor":
            return self.tensor(d)
        if tag == "dtype":
            return self.torch_dtype(self.text(v, "dtype"))
        if tag == "size":
            return torch.Size(self.shape(v))
        if tag == "device":
            return torch.device(self.text(v, "device"))
        if tag in ("ndarray", "npscalar"):
            return self.ndarray(d, scalar=tag == "npscalar")
        if tag == "pickle":
            if not self.allow_pickle:
                raise PickleNotAllowedError(
                    f"object {self.fqn!r} was pickled at save time ({self.where}); loading it runs code from the "
                    "checkpoint. Pass allow_pickle=True only if you trust where this checkpoint came from",
                    fqn=self.fqn,
                )
            return pickle.loads(self.unb64(v))  # allow_pickle: caller opted in explicitly
        raise self.bad(f"unknown tag {tag!r}")

    def tensor(self, d: dict) -> torch.Tensor:
        name = self.text(d.get("dtype"), "tensor dtype")
        dtype = self.torch_dtype(name)
        shape = self.shape(d.get("shape"))
        raw = bytearray(self.unb64(d.get("v")))
        if len(raw) != math.prod(shape) * dtype.itemsize:
            raise self.bad(f"tensor bytes do not match shape {shape} of {name}")
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape).clone()

    def ndarray(self, d: dict, *, scalar: bool) -> Any:
        name = self.text(d.get("dtype"), "numpy dtype")
        np_dtype = np.dtype(name)
        if np_dtype.kind not in _NP_KINDS or np_dtype.fields is not None or np_dtype.subdtype is not None:
            raise self.bad(f"numpy dtype {name!r} is not allowed")
        shape = self.shape(d.get("shape"))
        if scalar and shape:
            raise self.bad(f"a numpy scalar has shape [], not {shape}")
        if not np_dtype.itemsize:  # S0/U0: no bytes would back any element (numpy makes none such)
            raise self.bad(f"numpy dtype {name!r} has no item size")
        raw = self.unb64(d.get("v"))
        if len(raw) != math.prod(shape) * np_dtype.itemsize:
            raise self.bad(f"array bytes do not match shape {shape} of {name}")
        arr = np.frombuffer(raw, dtype=np_dtype).reshape(shape).copy() if raw else np.zeros(shape, dtype=np_dtype)
        self.check_elements(arr, name)
        return arr if not scalar else arr[()]

    def check_elements(self, arr: np.ndarray, name: str) -> None:
        """Refuse elements numpy holds but no Python value can be made of (reading one
        raises in the caller's code): code points past U+10FFFF in a str array, and a
        time in a unitless datetime/timedelta (only NaT has no unit)."""
        kind = arr.dtype.kind
        if kind == "U" and arr.size:
            points = arr.reshape(-1).view(arr.dtype.byteorder.replace("|", "=") + "u4")  # 0-d: no view
            if int(points.max()) > 0x10FFFF:
                raise self.bad(f"str array of {name} holds a code point past U+10FFFF")
        elif kind in "mM" and arr.size and np.datetime_data(arr.dtype)[0] == "generic" and not np.isnat(arr).all():
            raise self.bad(f"{name} has no time unit: its elements can only be NaT")
