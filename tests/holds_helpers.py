"""Checkpoints with references and holds, written by hand (FORMAT.md, "References" and
"Holds"), for the retention and deletion tests: no saver, no reader involved.

A checkpoint here owns one data file of random bytes and a stand-in catalog; a
*referrer* also lists data files of earlier siblings (``"checkpoint": OWNER``, flat:
always the owner of the bytes) and puts its holds on their generations before its
manifest, in FORMAT.md's order. :func:`readable` checks what a reader relies on: the
manifest, the catalog, and every listed data file (own or referenced) at its key with
the size the manifest says and the bytes first written.
"""

from __future__ import annotations

import datetime
import hashlib
import os

from bcp.backends import Backend
from bcp.commit import new_save_id, read_manifest
from bcp.metadata import FileEntry, Manifest, crc32c
from bcp.metadata.keys import catalog_key, generation_name, hold_key, manifest_key

#: key on the parent -> sha256 of the bytes first written there
WRITTEN: dict[tuple[int, str], str] = {}


def _put(parent: Backend, key: str, data: bytes) -> None:
    parent.write(key, data)
    WRITTEN[(id(parent), key)] = hashlib.sha256(data).hexdigest()


def make(
    parent: Backend,
    name: str,
    refs: list[tuple[str, FileEntry]] = (),  # type: ignore[assignment]
    *,
    commit: bool = True,
    save_id: str | None = None,
    nbytes: int = 64,
) -> Manifest:
    """Write checkpoint ``name`` under ``parent``: its own data file, then (references
    ``refs``: (owner, that owner's own FileEntry)) its holds, then its manifest unless
    ``commit`` is False (a save in progress, or a killed one)."""
    save_id = save_id or new_save_id()
    gen = generation_name(save_id)
    data = os.urandom(nbytes)
    own = FileEntry(f"{gen}/data/rank0-0.bin", len(data), crc32c(data))
    _put(parent, f"{name}/{own.path}", data)
    cat = b"catalog of " + name.encode()
    _put(parent, f"{name}/{catalog_key(gen)}", cat)
    files = [own]
    for owner, f in refs:
        files.append(FileEntry(f.path, f.nbytes, f.crc32c, checkpoint=owner))
        parent.write(f"{owner}/{hold_key(f.path.split('/', 1)[0], name, save_id)}", b"")
    manifest = Manifest(
        save_id=save_id,
        created=datetime.datetime.now(datetime.UTC).isoformat(),
        world_size=1,
        catalog=FileEntry(catalog_key(gen), len(cat), crc32c(cat)),
        data_files=tuple(files),
        objects={},
        checksum_block_bytes=1 << 20,
        bcp_version="test",
        torch_version="test",
    )
    if commit:
        parent.write_if_absent(f"{name}/{manifest_key()}", manifest.to_json())
    return manifest


def own_files(manifest: Manifest, name: str) -> list[tuple[str, FileEntry]]:
    """What a referrer over checkpoint ``name`` refers to: its own files, and (flat) the
    files it refers to itself, each with its owner."""
    return [(name, f) for f in manifest.own_files] + [(f.checkpoint or "", f) for f in manifest.references]


def readable(parent: Backend, name: str) -> bool:
    """Whether committed checkpoint ``name`` has every byte it lists, as first written."""
    manifest = read_manifest(parent, f"{name}/")
    assert manifest is not None, f"{name} is not committed"
    for f in (manifest.catalog, *manifest.data_files):
        key = f"{f.checkpoint or name}/{f.path}"
        try:
            if parent.size(key) != f.nbytes:
                return False
            first = WRITTEN.get((id(parent), key))  # None: written by bcp.save, its size is checked
            if first is not None and hashlib.sha256(parent.read(key)).hexdigest() != first:
                return False
        except Exception:  # noqa: BLE001 - missing: not readable
            return False
    return True


def generations(parent: Backend, name: str) -> set[str]:
    return {k.split("/")[1] for k in parent.list(f"{name}/") if k.split("/")[1].startswith("gen-")}
