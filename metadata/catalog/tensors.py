"""The catalog's schema and tensor table: what every other part of the catalog shares.

Rows name their tensor by an index into a :class:`TensorTable` (save order); the
Arrow encoding, the validation, the v2 sections and the :class:`~.core.Catalog`
itself all build on it, so it sits at the bottom of the package with nothing of the
catalog below it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

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

    #: each tensor's shape; a table decoded from a head holds its shapes only as
    #: :attr:`arrays` until this is first read (``__getattr__`` makes the tuples then:
    #: a plain attribute after that, nothing made per tensor for a load that never asks)
    shapes: list[tuple[int, ...]]

    def __init__(self) -> None:
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self.key_paths: list[str] = []
        self.dtypes: list[str] = []
        self.shapes = []

        self._arrays: TensorArrays | None = None
        self._name_array: pa.Array | None = None

    @classmethod
    def from_columns(
        cls,
        names: list[str],
        key_paths: list[str],
        dtypes: list[str],
        arrays: TensorArrays,
        *,
        index: dict[str, int] | None = None,
        name_array: pa.Array | None = None,
    ) -> TensorTable:
        """A table of distinct ``names`` (the caller checked) with their key paths,
        dtypes and shapes as ``arrays``: no Python object per dimension. ``index``
        (name -> position) and ``name_array`` (the names as an Arrow string array), when
        the caller has them already, are kept rather than built again."""
        table = cls()
        table.names, table.key_paths, table.dtypes = names, key_paths, dtypes
        table.index = dict(zip(names, range(len(names)), strict=True)) if index is None else index
        del table.shapes
        table._arrays = arrays
        table._name_array = name_array
        return table

    @property
    def name_array(self) -> pa.Array:
        """The names as an Arrow string array (a section's rows are matched against it
        in Arrow): the head's own column when decoded from one, else built once."""
        if self._name_array is None or len(self._name_array) != len(self.names):
            self._name_array = pa.array(self.names, pa.string())
        return self._name_array

    def __getattr__(self, name: str) -> list[tuple[int, ...]]:
        if name != "shapes" or self.__dict__.get("_arrays") is None:
            raise AttributeError(name)
        self.shapes = self.__dict__["_arrays"].shape_tuples()
        return self.shapes

    @classmethod
    def of_distinct(cls, rows: Sequence[tuple[str, str, str, tuple[int, ...]]]) -> TensorTable:
        """A table of ``rows`` (name, key path, dtype, shape) whose names are distinct
        (the caller's guarantee): what :meth:`add` of each gives, by C loops."""
        table = cls()
        if rows:
            names, key_paths, dtypes, shapes = map(list, zip(*rows, strict=True))
            table.names, table.key_paths, table.dtypes, table.shapes = names, key_paths, dtypes, shapes
            table.index = dict(zip(names, range(len(names)), strict=True))
        return table

    def add(self, fqn: str, key_path: str, dtype: str, shape: tuple[int, ...]) -> int:
        code = self.index.setdefault(fqn, len(self.names))
        if code == len(self.names):
            self.shapes.append(shape)
            self.names.append(fqn)
            self.key_paths.append(key_path)
            self.dtypes.append(dtype)
            self._arrays = None
            self._name_array = None
        return code

    def __len__(self) -> int:
        return len(self.names)

    @property
    def arrays(self) -> TensorArrays:
        """The table as numpy columns (built once; every section's checks use them)."""
        if self._arrays is None:
            shapes = self.shapes
            ndim = np.fromiter(map(len, shapes), np.int64, len(shapes))
            flat = np.fromiter(itertools.chain.from_iterable(shapes), np.int64, int(ndim.sum()))
            self._arrays = TensorArrays(ndim, flat, self.key_paths, self.dtypes)
        return self._arrays


def codes_of_first_use(values: Sequence[str]) -> tuple[np.ndarray, dict[str, int]]:
    """Each of ``values`` as the code of its distinct string in order of first use, and
    those strings to their codes: C loops, no Python step a value (10,000 tensors)."""
    codes = dict(zip(dict.fromkeys(values), itertools.count()))
    return np.fromiter(map(codes.__getitem__, values), np.int64, len(values)), codes


def first_seen(codes: np.ndarray, values: Sequence[str]) -> tuple[np.ndarray, dict[str, int]]:
    """``codes`` into ``values`` (distinct strings) renumbered in order of first use, and
    the used strings to their new codes: the same codes a pass over the rows would give."""
    if not len(codes):
        return np.zeros(0, np.int64), {}
    reach = np.maximum.accumulate(codes)
    if codes[0] == 0 and codes.min() >= 0 and (codes[1:] <= reach[:-1] + 1).all():  # each new code the next
        used_n = int(reach[-1]) + 1  # (a head's dictionary-encoded column: every tensor's key path, issue 37)
        return codes.astype(np.int64, copy=False), dict(zip(values[:used_n], range(used_n), strict=True))
    used, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
    rank = np.empty(len(used), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(used))
    by_rank = used[np.argsort(rank)].tolist()
    return rank[inverse.reshape(-1)], dict(zip(map(values.__getitem__, by_rank), range(len(by_rank)), strict=True))


class TensorArrays:
    """A TensorTable's shapes, strides, key paths and dtypes as numpy arrays."""

    def __init__(
        self,
        ndim: np.ndarray,
        shape: np.ndarray,
        key_paths: Sequence[str] | tuple[np.ndarray, dict[str, int]],
        dtypes: Sequence[str] | tuple[np.ndarray, dict[str, int]],
    ) -> None:
        """``ndim`` and the flat ``shape`` (int64); key paths and dtypes per tensor, or
        as (codes in order of first use, string to code) already."""
        self.ndim = ndim
        self.starts = np.concatenate([np.zeros(1, np.int64), np.cumsum(ndim)])
        self.shape = shape
        #: row-major element strides (flat like ``shape``): suffix products of the shape,
        #: exact below 2**62 elements, else MAX_TENSOR_BYTES; ``numel`` likewise
        self.strides, self.numel = suffix_products(ndim, self.starts, shape)
        self.kp, self.key_paths = key_paths if isinstance(key_paths, tuple) else codes_of_first_use(key_paths)
        self.dt, self.dtypes = dtypes if isinstance(dtypes, tuple) else codes_of_first_use(dtypes)

    @functools.cached_property
    def key_path_array(self) -> pa.Array:
        """The distinct key paths in code order as an Arrow string array (rows matched in Arrow)."""
        return pa.array(list(self.key_paths), pa.string())

    @functools.cached_property
    def dtype_array(self) -> pa.Array:
        """The distinct dtype names in code order as an Arrow string array."""
        return pa.array(list(self.dtypes), pa.string())

    def shape_tuples(self) -> list[tuple[int, ...]]:
        """Each tensor's shape as a tuple of ints."""
        ndim, flat, n = self.ndim, self.shape, len(self.ndim)
        if n and (ndim == ndim[0]).all():  # one rank for all: the columns of a matrix, zipped
            d = int(ndim[0])
            return list(zip(*flat.reshape(n, d).T.tolist(), strict=True)) if d else [()] * n
        out = np.empty(n, dtype=object)  # each rank's tuples zipped from its columns, then put in place
        for d in np.unique(ndim).tolist():
            rows = np.flatnonzero(ndim == d)
            columns = flat[self.starts[rows][:, None] + np.arange(d)].T.tolist()
            out[rows] = np.fromiter(zip(*columns, strict=True) if d else [()] * len(rows), object, len(rows))
        return out.tolist()


def suffix_products(ndim: np.ndarray, starts: np.ndarray, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(strides, numel): every tensor's row-major strides and element count, products
    saturated at MAX_TENSOR_BYTES (exact below it), one numpy pass per dimension."""
    n = len(ndim)
    strides = np.ones(len(flat), np.int64)
    acc = np.ones(n, np.int64)
    for j in range(int(ndim.max()) if n else 0):
        live = np.flatnonzero(ndim > j)
        pos = starts[live] + ndim[live] - 1 - j
        a, d = acc[live], flat[pos]
        strides[pos] = a
        over = (d > 0) & (a > MAX_TENSOR_BYTES // np.maximum(d, 1))
        with np.errstate(over="ignore"):
            acc[live] = np.where(over, MAX_TENSOR_BYTES, a * d)
    return strides, acc
