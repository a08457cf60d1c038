"""The catalog's schema and tensor table: what every other part of the catalog shares.

Rows name their tensor by an index into a :class:`TensorTable` (save order); the
Arrow encoding, the validation, the v2 sections and the :class:`~.core.Catalog`
itself all build on it, so it sits at the bottom of the package with nothing of the
catalog below it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

CATALOG_SCHEMA = pa.schema(
    [
        pa.field("fqn", pa.string(), nullable=False),
        pa.field("key_path", pa.string(), nullable=False),
        pa.field("dtype", pa.string(), nullable=False),
        pa.field("global_shape", pa.list_(pa.int64()), nullable=False),
        pa.field("offsets", pa.list_(pa.int64()), nullable=False),
        pa.field("lengths", pa.list_(pa.int64()), nullable=False),
        pa.field("file", pa.string(), nullable=False),
        pa.field("byte_offset", pa.int64(), nullable=False),
        pa.field("nbytes", pa.int64(), nullable=False),
        pa.field("checksums", pa.list_(pa.uint32()), nullable=False),
        pa.field("writer_rank", pa.int32(), nullable=False),
    ],
    metadata={"bcp.catalog.version": "1"},
)

#: Largest tensor (and fragment) in bytes the format accepts: element counts times
#: item sizes are computed in int64, and this keeps every such product exact.
MAX_TENSOR_BYTES = 1 << 62


class TensorTable:
    """The catalog's tensors in save order: name, key path, dtype, shape. Rows refer to
    a tensor by its index here."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self.key_paths: list[str] = []
        self.dtypes: list[str] = []
        self.shapes: list[tuple[int, ...]] = []

        self._arrays: TensorArrays | None = None

    def add(self, fqn: str, key_path: str, dtype: str, shape: tuple[int, ...]) -> int:
        code = self.index.setdefault(fqn, len(self.names))
        if code == len(self.names):
            self.names.append(fqn)
            self.key_paths.append(key_path)
            self.dtypes.append(dtype)
            self.shapes.append(shape)
            self._arrays = None
        return code

    def __len__(self) -> int:
        return len(self.names)

    @property
    def arrays(self) -> TensorArrays:
        """The table as numpy columns (built once; every section's checks use them)."""
        if self._arrays is None:
            self._arrays = TensorArrays(self)
        return self._arrays


class TensorArrays:
    """A TensorTable's shapes, strides, key paths and dtypes as numpy arrays."""

    def __init__(self, tensors: TensorTable) -> None:
        self.ndim = np.array([len(s) for s in tensors.shapes], dtype=np.int64)
        self.starts = np.concatenate([np.zeros(1, np.int64), np.cumsum(self.ndim)])
        self.shape = np.fromiter((d for s in tensors.shapes for d in s), np.int64, int(self.starts[-1]))
        #: row-major element strides (flat like ``shape``): suffix products of the shape
        self.strides = np.ones(len(self.shape), dtype=np.int64)
        for t, shape in enumerate(tensors.shapes):
            acc, base = 1, int(self.starts[t])
            for d in range(len(shape) - 1, -1, -1):
                self.strides[base + d] = min(acc, MAX_TENSOR_BYTES)  # exact below 2**62 elements
                acc *= shape[d]
        self.key_paths: dict[str, int] = {}
        self.kp = np.fromiter((self.key_paths.setdefault(v, len(self.key_paths)) for v in tensors.key_paths), np.int64)
        self.dtypes: dict[str, int] = {}
        self.dt = np.fromiter((self.dtypes.setdefault(v, len(self.dtypes)) for v in tensors.dtypes), np.int64)
