"""Incremental checkpoints built by hand (FORMAT.md, "References"), for the readers' tests.

:func:`make_incremental` takes two full checkpoints under one parent, a *base* and a
*full* save of the next state, and writes beside them the incremental checkpoint an
incremental save of that state would write: the full save's catalog, where every
fragment whose box and bytes equal a fragment of the base names the base's stored
bytes instead (its ``file``, ``byte_offset``, ``nbytes``, ``checksums``), its own data
files copied for the others, and a version 3 manifest listing the referenced files with
``"checkpoint": BASE``. Every row carries its XXH3-128 ``digest``. Nothing of bcp's
save path is used, so readers are tested against the format, not against the writer.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Mapping
from typing import Any

import xxhash

import bcp
from bcp.backends import backend_for
from bcp.metadata import Catalog, FileEntry, Fragment, Manifest, crc32c, digest_of_checksums
from bcp.metadata.keys import catalog_key, generation_name, manifest_key, split_parent


@dataclasses.dataclass
class Incremental:
    uri: str
    manifest: Manifest
    #: fragments that name the base's bytes, and all fragments
    reused: int
    fragments: int


def _digest(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)  # canonical (big-endian) form


def _file_entries(frags: list[Fragment], sizes: Mapping[str, int], owners: Mapping[str, str | None]) -> list[FileEntry]:
    """One entry per file the rows name: its size as stored, the CRC32C of the block
    checksums of its rows in file order (each stored fragment once), its owner."""
    by_file: dict[str, dict[int, tuple[int, ...]]] = {}
    for f in frags:
        if f.nbytes:
            by_file.setdefault(f.file, {})[f.byte_offset] = f.checksums
    out = []
    for path in sorted({f.file for f in frags}):
        sums = [s for _off, row in sorted(by_file.get(path, {}).items()) for s in row]
        out.append(FileEntry(path, sizes[path], digest_of_checksums(sums), checkpoint=owners[path]))
    return out


def make_incremental(
    base_uri: str, full_uri: str, out_uri: str, *, storage_options: Mapping[str, Any] | None = None
) -> Incremental:
    """Write at ``out_uri`` the incremental checkpoint of ``full_uri``'s state over
    ``base_uri`` (all three siblings: one parent). See the module's docstring."""
    options = dict(storage_options or {})
    parent, base_name = split_parent(base_uri)
    assert split_parent(out_uri)[0] == parent == split_parent(full_uri)[0], "base, full and out must be siblings"
    base = bcp.open(base_uri, storage_options=options)
    full = bcp.open(full_uri, storage_options=options)
    assert base.manifest.checksum_block_bytes == full.manifest.checksum_block_bytes
    assert not base.manifest.references, "references are flat: the base must own its bytes"
    base_rows: dict[tuple, Fragment] = {}
    for f in base.catalog.fragments:
        base_rows.setdefault((f.fqn, f.dtype, f.global_shape, f.offsets, f.lengths), f)
    save_id = f"{int(time.time()):08x}{secrets.token_hex(8)}"
    gen = generation_name(save_id)
    old_gen = full.manifest.generation
    out = backend_for(out_uri, **options)
    frags: list[Fragment] = []
    sizes: dict[str, int] = {}
    owners: dict[str, str | None] = {}
    reused = 0
    for f in full.catalog.fragments:
        data = full.backend.read(f.file, f.byte_offset, f.nbytes)
        b = base_rows.get((f.fqn, f.dtype, f.global_shape, f.offsets, f.lengths))
        if b is not None and base.backend.read(b.file, b.byte_offset, b.nbytes) == data:
            frags.append(dataclasses.replace(f, file=b.file, byte_offset=b.byte_offset, checksums=b.checksums))
            sizes[b.file], owners[b.file] = base.backend.size(b.file), base_name
            reused += 1
        else:
            path = gen + f.file.removeprefix(old_gen)
            frags.append(dataclasses.replace(f, file=path))
            sizes[path], owners[path] = full.backend.size(f.file), None
        frags[-1] = dataclasses.replace(frags[-1], digest=_digest(data))
    for path, owner in owners.items():
        if owner is None:
            out.write(path, full.backend.read(old_gen + path.removeprefix(gen)))
    catalog = Catalog(frags).to_arrow()
    out.write(catalog_key(gen), catalog)
    m = full.manifest
    manifest = Manifest(
        save_id=save_id,
        created=m.created,
        world_size=m.world_size,
        catalog=FileEntry(catalog_key(gen), len(catalog), crc32c(catalog)),
        data_files=tuple(_file_entries(frags, sizes, owners)),
        objects=m.objects,
        checksum_block_bytes=m.checksum_block_bytes,
        bcp_version=m.bcp_version,
        torch_version=m.torch_version,
        user_metadata=m.user_metadata,
        stats=m.stats,
    )
    out.write_if_absent(manifest_key(), manifest.to_json())
    for r in (base, full):
        r.close()
    out.close()
    return Incremental(out_uri, manifest, reused, len(frags))
