"""Where a checkpoint lives: a URI (with storage options) or a ready Backend."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from bcp.backends import Backend, backend_for

Target = str | os.PathLike | Backend


def resolve_backend(target: Target, storage_options: Mapping[str, Any] | None = None) -> Backend:
    """The backend for ``target``. A Backend instance is used as is (wrapped stacks,
    plugins built by hand, tests); anything else is a URI or path."""
    if isinstance(target, Backend):
        if storage_options:
            raise TypeError("storage_options apply to URIs; this target is already a Backend")
        return target
    return backend_for(os.fspath(target), **dict(storage_options or {}))
