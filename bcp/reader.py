"""Reading a committed checkpoint: manifest, catalog, tensors, objects.

``bcp.open(uri)`` needs no template: it lists what is stored and reads one tensor
at a time, touching only that tensor's bytes. ``bcp.load`` is built on it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import torch

from bcp.backends import Backend, ObjectNotFoundError, backend_for
from bcp.metadata import MANIFEST_KEY, Catalog, Fragment, Manifest, TensorEntry, block_checksums, crc32c

from . import objcodec
from .dtypes import torch_dtype
from .errors import CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError
from .state import KeyPath, build_nested, path_from_json
from .tensor_io import byte_view, copy_values

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """A stored global tensor: shape, dtype and the fragments that hold it."""

    fqn: str
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    fragments: tuple[Fragment, ...]


class CheckpointReader:
    """A committed checkpoint, opened for reading. Cheap to create: reads the
    manifest and the catalog, no tensor data."""

    def __init__(self, backend: Backend, manifest: Manifest, catalog: Catalog, *, allow_pickle: bool = False) -> None:
        self.backend = backend
        self.manifest = manifest
        self.catalog = catalog
        self.allow_pickle = allow_pickle

    @property
    def uri(self) -> str:
        return self.backend.uri

    # -- listing ------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Every stored FQN: tensors in save order, then objects."""
        return [*self.tensor_keys(), *self.object_keys()]

    def tensor_keys(self) -> list[str]:
        return list(self.catalog.tensors)

    def object_keys(self) -> list[str]:
        return list(self.manifest.objects)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self.catalog.tensors or fqn in self.manifest.objects

    def key_path(self, fqn: str) -> KeyPath:
        """Where the entry sat in the saved nested state."""
        if fqn in self.catalog.tensors:
            return path_from_json(json.loads(self.catalog.tensors[fqn].key_path), fqn=fqn)
        return path_from_json(self._object_entry(fqn).key_path, fqn=fqn)

    def meta(self, fqn: str) -> TensorMeta:
        entry = self._tensor_entry(fqn)
        return TensorMeta(
            fqn=fqn,
            shape=torch.Size(entry.global_shape),
            dtype=torch_dtype(entry.dtype, fqn=fqn),
            nbytes=entry.nbytes,
            fragments=entry.fragments,
        )

    # -- reading ------------------------------------------------------------------------

    def read(self, fqn: str) -> Any:
        """One stored entry: a new CPU tensor (reading only its bytes), or an object."""
        if fqn in self.manifest.objects:
            return self.read_object(fqn)
        meta = self.meta(fqn)
        out = torch.empty(meta.shape, dtype=meta.dtype)
        self.read_into(fqn, out)
        return out

    def read_object(self, fqn: str) -> Any:
        entry = self._object_entry(fqn)
        return objcodec.decode(entry.value, fqn=fqn, allow_pickle=self.allow_pickle)

    def objects(self) -> dict[str, Any]:
        """Every stored object, decoded."""
        return {fqn: self.read_object(fqn) for fqn in self.manifest.objects}

    def state(self) -> dict:
        """The whole saved state rebuilt as nested dicts/lists/tuples (tensors on CPU)."""
        entries = [(self.key_path(fqn), self.read(fqn)) for fqn in self.keys()]
        return build_nested(entries)

    def read_into(self, fqn: str, dest: torch.Tensor) -> None:
        """Fill ``dest`` (global shape; dtype cast if it differs) with the stored tensor."""
        entry = self._tensor_entry(fqn)
        if tuple(dest.shape) != entry.global_shape:
            raise ValueError(f"{fqn!r}: destination shape {list(dest.shape)} != stored {list(entry.global_shape)}")
        if dest.is_meta:
            raise ValueError(f"{fqn!r}: cannot load into a meta tensor; allocate it first (module.to_empty(device=...))")
        dtype = torch_dtype(entry.dtype, fqn=fqn)
        frags = entry.fragments
        direct = dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype
        full = len(frags) == 1 and frags[0].lengths == entry.global_shape
        if direct and full:
            with torch.no_grad():
                self._read_fragment(frags[0], byte_view(dest.detach()))
            return
        for frag in _unique_boxes(frags):
            tmp = torch.empty(frag.lengths, dtype=dtype)
            self._read_fragment(frag, byte_view(tmp))
            region = tuple(slice(o, o + n) for o, n in zip(frag.offsets, frag.lengths))
            copy_values(dest[region], tmp)

    def _read_fragment(self, frag: Fragment, view: memoryview) -> None:
        """Read one whole fragment into ``view`` and verify every checksum block."""
        if frag.nbytes == 0:
            return
        try:
            self.backend.read_exact(frag.file, frag.byte_offset, view)
        except ObjectNotFoundError as e:
            raise CorruptCheckpointError(
                f"tensor {frag.fqn!r}: data file {frag.file!r} of {self.uri} is missing",
                fqn=frag.fqn, file=frag.file, offset=frag.byte_offset,
            ) from e
        except EOFError as e:
            raise CorruptCheckpointError(
                f"tensor {frag.fqn!r}: data file {frag.file!r} of {self.uri} is truncated: {e}",
                fqn=frag.fqn, file=frag.file, offset=frag.byte_offset,
            ) from e
        block = self.manifest.checksum_block_bytes
        for i, (got, want) in enumerate(zip(block_checksums(view, block), frag.checksums)):
            if got != want:
                start = frag.byte_offset + i * block
                end = min(start + block, frag.byte_offset + frag.nbytes)
                raise CorruptCheckpointError(
                    f"checksum mismatch in tensor {frag.fqn!r}: file {frag.file!r} of {self.uri}, "
                    f"bytes [{start}, {end}) (crc32c {got:#010x}, expected {want:#010x})",
                    fqn=frag.fqn, file=frag.file, offset=start,
                )

    # -- helpers ------------------------------------------------------------------------

    def _tensor_entry(self, fqn: str) -> TensorEntry:
        try:
            return self.catalog.tensors[fqn]
        except KeyError:
            kind = "an object, not a tensor" if fqn in self.manifest.objects else "not in the checkpoint"
            raise KeyError(f"{fqn!r} is {kind} ({self.uri})") from None

    def _object_entry(self, fqn: str):
        entries = self.manifest.objects.get(fqn)
        if not entries:
            kind = "a tensor, not an object" if fqn in self.catalog.tensors else "not in the checkpoint"
            raise KeyError(f"{fqn!r} is {kind} ({self.uri})")
        return entries[0]

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({self.uri!r}, tensors={len(self.catalog.tensors)}, objects={len(self.manifest.objects)})"


def _unique_boxes(frags: tuple[Fragment, ...]) -> list[Fragment]:
    seen, out = set(), []
    for f in frags:
        if (f.offsets, f.lengths) not in seen:
            seen.add((f.offsets, f.lengths))
            out.append(f)
    return out


def open_checkpoint(uri: str, *, allow_pickle: bool = False, storage_options: dict | None = None) -> CheckpointReader:
    """Open the committed checkpoint at ``uri`` (``bcp.open``)."""
    backend = backend_for(str(uri), **dict(storage_options or {}))
    where = f"{backend.uri}/{MANIFEST_KEY}"
    try:
        manifest = Manifest.from_json(backend.read(MANIFEST_KEY), where=where)
    except ObjectNotFoundError:
        if next(iter(backend.list("")), None) is not None:
            raise IncompleteCheckpointError(
                f"{backend.uri} has no {MANIFEST_KEY}: a save started there and never committed "
                "(it failed, was killed, or is still running), so there is no checkpoint to load"
            ) from None
        raise CheckpointNotFoundError(f"no checkpoint at {backend.uri}") from None
    cat = manifest.catalog
    try:
        data = backend.read(cat.path)
    except ObjectNotFoundError as e:
        raise CorruptCheckpointError(f"catalog {cat.path!r} of {backend.uri} is missing", file=cat.path) from e
    if len(data) != cat.nbytes or crc32c(data) != cat.crc32c:
        raise CorruptCheckpointError(
            f"catalog {cat.path!r} of {backend.uri} does not match the manifest "
            f"({len(data)} bytes, crc32c {crc32c(data):#010x}; expected {cat.nbytes} bytes, {cat.crc32c:#010x})",
            file=cat.path,
        )
    catalog = Catalog.from_arrow(data, where=f"{backend.uri}/{cat.path}", checksum_block_bytes=manifest.checksum_block_bytes)
    return CheckpointReader(backend, manifest, catalog, allow_pickle=allow_pickle)
