"""Reading an incremental checkpoint's references: data files of its siblings.

A version 3 manifest (FORMAT.md, "References") may list data files that belong to a
sibling checkpoint, one under the same parent URI: ``{"path": "gen-<id>/data/NAME",
"checkpoint": "step_00000100"}``. Such a file is read at ``step_00000100/gen-<id>/data/NAME``
of the parent, on a backend built for the parent URI with the same storage options;
nothing else outside the checkpoint is read, and a reference is followed one step
only (it names the owner of the bytes, never a checkpoint that refers on).

:class:`ReferencingBackend` puts that routing under everything that reads data files
(the loader, ``bcp.open``, verify, the exports): they ask for a catalog row's ``file``
as always and get the sibling's bytes, checked by size and block checksums as any
other. A checkpoint opened from a Backend object has no URI to find a parent from;
one with references then fails at open (:func:`references_backend`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from bcp.backends import Backend, ObjectWriter
from bcp.backends.base import Buffer
from bcp.backends.registry import backend_for
from bcp.backends.wrappers import ForwardingBackend
from bcp.errors import CheckpointError
from bcp.metadata import Manifest
from bcp.metadata.keys import reference_key, split_parent

#: builds the parent's backend when a checkpoint turns out to have references
ParentFactory = Callable[[], Backend]


def parent_factory(target: Any, storage_options: Mapping[str, Any] | None = None) -> ParentFactory | None:
    """A function building the backend of ``target``'s parent URI (same storage
    options), called only if the checkpoint has references; None for a Backend object
    (no URI: references cannot be resolved) or a URI without a parent segment."""
    if isinstance(target, Backend):
        return None
    try:
        parent, _name = split_parent(os.fspath(target))
    except (TypeError, ValueError):
        return None
    options = dict(storage_options or {})
    return functools.cache(lambda: backend_for(parent, **options))


def references_backend(backend: Backend, manifest: Manifest, parent: ParentFactory | None) -> Backend:
    """``backend`` itself for a checkpoint without references; else a
    :class:`ReferencingBackend` reading each referenced file on the parent's backend.
    CheckpointError when there is no parent to read them from."""
    refs = manifest.references
    if not refs:
        return backend
    owners = sorted({f.checkpoint for f in refs if f.checkpoint is not None})
    if parent is None:
        raise CheckpointError(
            f"{backend.uri} is an incremental checkpoint: it reads data files of the checkpoint(s) "
            f"{', '.join(owners)} beside it, which bcp finds from its URI; it was opened from a Backend "
            "object (or a URI without a parent), so open it by its URI"
        )
    return ReferencingBackend(backend, parent(), {f.path: f.checkpoint for f in refs if f.checkpoint is not None})


class ReferencingBackend(ForwardingBackend):
    """A checkpoint's backend that reads the data files of ``references`` (path ->
    owning sibling's name) at ``<sibling>/<path>`` of ``parent``, and everything else
    from the checkpoint itself. Read-only for referenced keys: a reader never writes a
    sibling's files."""

    def __init__(self, inner: Backend, parent: Backend, references: Mapping[str, str]) -> None:
        super().__init__(inner)
        self.parent = parent
        #: path of a referenced data file -> its key on the parent (checked: one sibling segment, no '..')
        self.keys = {path: reference_key(owner, path) for path, owner in references.items()}
        self.owners = dict(references)

    def _where(self, key: str) -> tuple[Backend, str]:
        ref = self.keys.get(key)
        return (self.inner, key) if ref is None else (self.parent, ref)

    def describe_key(self, key: str) -> str:
        """How errors name ``key``: for a referenced file, where it truly lies."""
        ref = self.keys.get(key)
        if ref is None:
            return f"{key!r} of {self.uri}"
        return f"{key!r} of sibling checkpoint {self.owners[key]!r} ({self.parent.uri}/{ref})"

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        backend, k = self._where(key)
        return backend.read_into(k, offset, buffer)

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        backend, k = self._where(key)
        return backend.read(k, offset, length)

    def read_exact(self, key: str, offset: int, buffer: memoryview) -> None:
        backend, k = self._where(key)
        backend.read_exact(k, offset, buffer)

    def reading(self, key: str) -> Any:
        backend, k = self._where(key)
        return backend.reading(k)

    def size(self, key: str) -> int:
        backend, k = self._where(key)
        return backend.size(k)

    def exists(self, key: str) -> bool:
        backend, k = self._where(key)
        return backend.exists(k)

    def in_memory(self, key: str, offset: int, nbytes: int) -> bool:
        backend, k = self._where(key)
        return backend.in_memory(k, offset, nbytes)

    def _own(self, key: str) -> str:
        if key in self.keys:
            raise ValueError(f"{self.describe_key(key)} belongs to another checkpoint: a reader does not change it")
        return key

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        return self.inner.open_writer(self._own(key), size=size)

    def write(self, key: str, data: Buffer) -> None:
        self.inner.write(self._own(key), data)

    def write_if_absent(self, key: str, data: Buffer) -> None:
        self.inner.write_if_absent(self._own(key), data)

    def delete(self, key: str) -> None:
        self.inner.delete(self._own(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self.parent.close()


def describe_file(backend: Backend) -> Callable[[str], str]:
    """``name(key)`` for errors about data file ``key`` read through ``backend``:
    ``'key' of URI``, or where a referenced file truly lies."""
    if isinstance(backend, ReferencingBackend):
        return backend.describe_key
    uri = backend.uri
    return lambda key: f"{key!r} of {uri}"
