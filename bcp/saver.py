"""The save path: flatten, lay fragments out, write data, write catalog, commit.

Commit protocol (FORMAT.md, "Commit"): every object of a save lives under a fresh
generation prefix ``gen-<id>/``; ``manifest.json`` is written last, create-only
unless ``overwrite=True`` (then an atomic replace), and only after the data and
catalog are durable. A save that fails or is killed leaves at most an unreferenced
generation behind, never a visible checkpoint, and never touches the previous one.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from bcp.backends import Backend, ObjectExistsError, backend_for
from bcp.metadata import (
    DEFAULT_BLOCK_BYTES,
    MANIFEST_KEY,
    Catalog,
    FileEntry,
    Fragment,
    Manifest,
    ObjectEntry,
    block_checksums,
    crc32c,
    digest_of_checksums,
)

from . import objcodec
from ._version import __version__
from .errors import CheckpointExistsError, UnsupportedStateError
from .dtypes import dtype_name
from .state import Leaf, flatten_state, path_to_json, path_to_str
from .tensor_io import byte_view, check_saveable, host_contiguous, storage_identity

log = logging.getLogger(__name__)

#: Fragments of at least this many bytes start at a multiple of 4096 (direct I/O,
#: page-aligned reads); smaller ones at a multiple of 64.
_PAGE_ALIGN_FROM = 64 << 10


@dataclasses.dataclass(frozen=True)
class SaveInfo:
    """What a save wrote."""

    uri: str
    save_id: str
    tensors: int
    fragments: int
    objects: int
    tensor_bytes: int
    bytes_written: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Tensor bytes per second, in GB/s (10^9)."""
        return self.tensor_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        return (
            f"saved {self.tensors} tensors ({self.tensor_bytes / 2**20:.1f} MiB) and {self.objects} objects "
            f"to {self.uri} in {self.seconds:.3f} s ({self.gbps:.2f} GB/s)"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class _WriteItem:
    leaf: Leaf
    byte_offset: int
    nbytes: int
    #: Index of the item whose bytes this one shares (tied weights), or -1.
    same_as: int


def _align(offset: int, nbytes: int) -> int:
    a = 4096 if nbytes >= _PAGE_ALIGN_FROM else 64
    return -(-offset // a) * a


def _layout(tensor_leaves: list[Leaf]) -> tuple[list[_WriteItem], int]:
    """Place each tensor's bytes in one data file, back to back (aligned)."""
    items: list[_WriteItem] = []
    first_of: dict[tuple, int] = {}
    end = 0
    for leaf in tensor_leaves:
        t: torch.Tensor = leaf.value
        nbytes = t.numel() * t.element_size()
        ident = storage_identity(t)
        if ident in first_of:
            prior = items[first_of[ident]]
            items.append(_WriteItem(leaf, prior.byte_offset, nbytes, first_of[ident]))
            continue
        first_of[ident] = len(items)
        start = _align(end, nbytes)
        items.append(_WriteItem(leaf, start, nbytes, -1))
        end = start + nbytes
    return items, end


def _validate_tensor(leaf: Leaf) -> None:
    t = leaf.value
    if type(t).__name__ == "DTensor":
        raise UnsupportedStateError(
            f"tensor at key {leaf.fqn!r} is a DTensor; saving distributed tensors needs the distributed save, "
            "which this version of bcp does not have yet"
        )
    check_saveable(t, leaf.fqn)
    dtype_name(t.dtype, fqn=leaf.fqn)


def read_manifest_if_any(backend: Backend) -> Manifest | None | bool:
    """The committed manifest; None when there is none; False when one exists but is unreadable."""
    if not backend.exists(MANIFEST_KEY):
        return None
    try:
        return Manifest.from_json(backend.read(MANIFEST_KEY), where=f"{backend.uri}/{MANIFEST_KEY}")
    except Exception as e:  # noqa: BLE001 - an unreadable old manifest still blocks a non-overwrite save
        log.warning("existing manifest at %s is unreadable: %s", backend.uri, e)
        return False


def save(
    state: Mapping[str, Any],
    uri: str,
    *,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
    allow_pickle: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    checksum_block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> SaveInfo:
    """Save ``state`` (a nested dict of tensors and plain objects) to ``uri``.

    Refuses (CheckpointExistsError) when a committed checkpoint is already there,
    unless ``overwrite=True``; an overwrite replaces it atomically. ``metadata`` is
    stored as user metadata (JSON types). ``allow_pickle`` lets objects without a
    safe encoding be pickled; loading them then needs ``allow_pickle=True`` too.
    """
    started = time.perf_counter()
    backend = backend_for(str(uri), **dict(storage_options or {}))
    old = read_manifest_if_any(backend)
    if old is not None and not overwrite:
        raise CheckpointExistsError(f"a committed checkpoint already exists at {backend.uri}; pass overwrite=True to replace it")

    leaves = flatten_state(state)
    tensor_leaves = [leaf for leaf in leaves.values() if leaf.is_tensor]
    for leaf in tensor_leaves:
        _validate_tensor(leaf)
    objects = {
        leaf.fqn: [ObjectEntry(path_to_json(leaf.path), objcodec.encode(leaf.value, fqn=leaf.fqn, allow_pickle=allow_pickle))]
        for leaf in leaves.values()
        if not leaf.is_tensor
    }
    user_metadata = dict(metadata or {})
    try:
        json.dumps(user_metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UnsupportedStateError(f"metadata must be JSON-serialisable: {e}") from None

    save_id = uuid.uuid4().hex[:16]
    generation = f"gen-{save_id}"
    data_key = f"{generation}/data/rank00000-0.bin"
    catalog_key = f"{generation}/fragments.arrow"
    items, data_size = _layout(tensor_leaves)

    try:
        fragments, file_checksums = _write_data(backend, data_key, items, data_size, checksum_block_bytes)
        catalog_bytes = Catalog(fragments).to_arrow()
        backend.write(catalog_key, catalog_bytes)
        manifest = Manifest(
            save_id=save_id,
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
            world_size=1,
            catalog=FileEntry(catalog_key, len(catalog_bytes), crc32c(catalog_bytes)),
            data_files=(FileEntry(data_key, data_size, digest_of_checksums(file_checksums)),),
            objects=objects,
            checksum_block_bytes=checksum_block_bytes,
            bcp_version=__version__,
            torch_version=torch.__version__,
            user_metadata=user_metadata,
            stats={
                "tensors": len(tensor_leaves),
                "fragments": len(fragments),
                "tensor_bytes": sum(i.nbytes for i in items),
            },
        )
        _commit(backend, manifest, overwrite=overwrite)
    except BaseException:
        _discard(backend, generation)
        raise

    if isinstance(old, Manifest) and old.generation != generation:
        try:
            backend.delete_prefix(old.generation + "/")
        except Exception as e:  # noqa: BLE001 - the new checkpoint is committed; leftovers are only space
            log.warning("could not delete the replaced generation %s at %s: %s", old.generation, backend.uri, e)

    info = SaveInfo(
        uri=backend.uri,
        save_id=save_id,
        tensors=len(tensor_leaves),
        fragments=len(fragments),
        objects=len(objects),
        tensor_bytes=manifest.stats["tensor_bytes"],
        bytes_written=data_size,
        seconds=time.perf_counter() - started,
    )
    log.info("%s", info)
    return info


def _write_data(
    backend: Backend, data_key: str, items: list[_WriteItem], size: int, block: int
) -> tuple[list[Fragment], list[int]]:
    fragments: list[Fragment] = []
    checksums_of: dict[int, tuple[int, ...]] = {}
    file_checksums: list[int] = []
    with backend.open_writer(data_key, size=size) as writer:
        for index, item in enumerate(items):
            t: torch.Tensor = item.leaf.value
            if item.same_as < 0:
                host = host_contiguous(t)
                view = byte_view(host)
                sums = tuple(block_checksums(view, block))
                if item.nbytes:
                    writer.write_at(item.byte_offset, view)
                checksums_of[index] = sums
                file_checksums.extend(sums)
            else:
                sums = checksums_of[item.same_as]
            fragments.append(
                Fragment(
                    fqn=item.leaf.fqn,
                    key_path=path_to_str(item.leaf.path),
                    dtype=dtype_name(t.dtype),
                    global_shape=tuple(t.shape),
                    offsets=(0,) * t.dim(),
                    lengths=tuple(t.shape),
                    file=data_key,
                    byte_offset=item.byte_offset,
                    nbytes=item.nbytes,
                    checksums=sums,
                )
            )
        if size == 0:
            writer.write_at(0, b"")
        writer.commit()
    return fragments, file_checksums


def _commit(backend: Backend, manifest: Manifest, *, overwrite: bool) -> None:
    data = manifest.to_json()
    if overwrite:
        backend.write(MANIFEST_KEY, data)
        return
    try:
        backend.write_if_absent(MANIFEST_KEY, data)
    except ObjectExistsError as e:
        raise CheckpointExistsError(
            f"another save committed a checkpoint at {backend.uri} while this one was writing; this save was discarded"
        ) from e


def _discard(backend: Backend, generation: str) -> None:
    try:
        backend.delete_prefix(generation + "/")
    except Exception as e:  # noqa: BLE001 - the original error matters more
        log.warning("could not remove the partial save %s at %s: %s", generation, backend.uri, e)
