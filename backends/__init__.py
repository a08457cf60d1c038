"""Storage backends for bcp: one small interface, a registry keyed by URI scheme.

Knows nothing of tensors or of the checkpoint engine (README, "Layout").
"""

from .base import Backend, Buffer, Capability, IOHints, ObjectWriter, check_key
from .errors import ObjectExistsError, ObjectNotFoundError, StorageError, TransientError, WriterClosedError
from .registry import (
    backend_for,
    get_backend_class,
    register_backend,
    registered_backends,
    split_scheme,
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
    "WriterClosedError",
    "backend_for",
    "check_key",
    "get_backend_class",
    "register_backend",
    "registered_backends",
    "split_scheme",
]
