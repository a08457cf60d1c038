"""The checkpoint catalog and manifest: which fragments of which tensors live where.

Pure format code (FORMAT.md is the spec). Knows nothing of torch.distributed, of
storage, or of the engine. Its modules, one line each: docs/architecture.md.
"""

if __name__ != "bcp.metadata":  # the folder imported under its own name: a second copy of every class
    raise ImportError(f"this folder is the package bcp.metadata; write `import bcp.metadata`, not `import {__name__}`")

from bcp.metadata.catalog import CATALOG_SCHEMA, Catalog, validate_fragment
from bcp.metadata.checksum import ALGORITHM, DEFAULT_BLOCK_BYTES, block_checksums, crc32c, digest_of_checksums
from bcp.metadata.dtypes import DTYPE_ITEMSIZE, itemsize
from bcp.metadata.format_errors import FormatError
from bcp.metadata.geometry import covers_exactly as boxes_cover_exactly  # its name in bcp.metadata since 0.1
from bcp.metadata.manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_KEY, FileEntry, Manifest, ObjectEntry
from bcp.metadata.rows import Fragment, TensorEntry

__all__ = [
    "ALGORITHM",
    "CATALOG_SCHEMA",
    "DEFAULT_BLOCK_BYTES",
    "DTYPE_ITEMSIZE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_KEY",
    "Catalog",
    "FileEntry",
    "FormatError",
    "Fragment",
    "Manifest",
    "ObjectEntry",
    "TensorEntry",
    "block_checksums",
    "boxes_cover_exactly",
    "crc32c",
    "digest_of_checksums",
    "itemsize",
    "validate_fragment",
]
