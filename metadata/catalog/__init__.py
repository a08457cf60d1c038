"""The fragment catalog (fragments.arrow): which fragment of which tensor lives where.

A package split by job, each module importing only those below it (no cycle); its
modules, one line each, are in docs/architecture.md.

Box geometry (tiling, overlap, stable order) is bcp.metadata.geometry's. The names
below are the catalog's public API; everything else is imported from the
module that owns it.
"""

from bcp.metadata.catalog.budget import DECODE_FLOOR_BYTES, DECODE_RATIO, check_ipc_budget, decode_budget
from bcp.metadata.catalog.core import TRAILER_BYTES, Catalog
from bcp.metadata.catalog.tensors import CATALOG_SCHEMA, MAX_TENSOR_BYTES, TensorArrays, TensorTable
from bcp.metadata.catalog.validate import validate_fragment

__all__ = [
    "CATALOG_SCHEMA",
    "DECODE_FLOOR_BYTES",
    "DECODE_RATIO",
    "MAX_TENSOR_BYTES",
    "TRAILER_BYTES",
    "Catalog",
    "TensorArrays",
    "TensorTable",
    "check_ipc_budget",
    "decode_budget",
    "validate_fragment",
]
