"""Storage backends for bcp: one small interface, a registry keyed by URI scheme.

Knows nothing of tensors or of the checkpoint engine. Its modules, one line each:
docs/architecture.md.
"""

if __name__ != "bcp.backends":  # the folder imported under its own name: a second copy of every class
    raise ImportError(f"this folder is the package bcp.backends; write `import bcp.backends`, not `import {__name__}`")

from bcp.backends.base import (
    Backend,
    Buffer,
    Capability,
    IOHints,
    ObjectWriter,
    Unfinished,
    check_key,
    read_into_many,
)
from bcp.backends.registry import (
    backend_for,
    get_backend_class,
    import_plugins,
    imported_plugins,
    join_uri,
    register_backend,
    registered_backends,
    split_scheme,
)
from bcp.backends.storage_errors import (
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    TransientError,
    WriterClosedError,
)

__all__ = [
    "Backend",
    "Buffer",
    "Capability",
    "IOHints",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "ObjectWriter",
    "StorageError",
    "TransientError",
    "Unfinished",
    "WriterClosedError",
    "backend_for",
    "check_key",
    "get_backend_class",
    "import_plugins",
    "imported_plugins",
    "join_uri",
    "read_into_many",
    "register_backend",
    "registered_backends",
    "split_scheme",
]
