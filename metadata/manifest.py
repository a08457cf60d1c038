"""manifest.json: the commit record of a checkpoint (FORMAT.md, "manifest.json").

Written last. A checkpoint whose manifest is absent was never committed and does
not exist to a reader. It names the generation of files that belong to it, so an
overwrite can write a whole new generation beside the old one and switch with one
atomic put.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from .errors import FormatError

FORMAT_NAME = "bcp-checkpoint"
FORMAT_VERSION = 1
MANIFEST_KEY = "manifest.json"


@dataclasses.dataclass(frozen=True, slots=True)
class FileEntry:
    """A data or catalog object of the checkpoint."""

    path: str
    nbytes: int
    #: data files: CRC32C over the block checksums (metadata.checksum.digest_of_checksums);
    #: the catalog: CRC32C of its bytes.
    crc32c: int

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "nbytes": self.nbytes, "crc32c": self.crc32c}


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectEntry:
    """A non-tensor value of the state in the safe tagged-JSON encoding (FORMAT.md)."""

    key_path: list
    value: Any
    #: None: one value for the whole job; an int: the value the given rank saved.
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"key_path": self.key_path, "value": self.value, "rank": self.rank}


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    save_id: str
    created: str
    world_size: int
    catalog: FileEntry
    data_files: tuple[FileEntry, ...]
    #: fqn -> entries (one for global objects, one per rank for per-rank objects)
    objects: dict[str, list[ObjectEntry]]
    checksum_block_bytes: int
    bcp_version: str
    torch_version: str
    user_metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    stats: dict[str, int] = dataclasses.field(default_factory=dict)
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    byte_order: str = "little"
    checksum_algorithm: str = "crc32c"

    @property
    def generation(self) -> str:
        """Key prefix of every data and catalog object of this save."""
        return self.catalog.path.split("/", 1)[0]

    def to_json(self) -> bytes:
        doc = {
            "format": self.format,
            "version": self.version,
            "save_id": self.save_id,
            "created": self.created,
            "bcp_version": self.bcp_version,
            "torch_version": self.torch_version,
            "world_size": self.world_size,
            "byte_order": self.byte_order,
            "checksum": {"algorithm": self.checksum_algorithm, "block_bytes": self.checksum_block_bytes},
            "catalog": self.catalog.to_json(),
            "data_files": [f.to_json() for f in self.data_files],
            "objects": {k: [e.to_json() for e in v] for k, v in self.objects.items()},
            "user_metadata": self.user_metadata,
            "stats": self.stats,
        }
        return json.dumps(doc, indent=1, allow_nan=False, ensure_ascii=True).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Manifest:
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{where}: not valid JSON: {e}") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise FormatError(f"{where}: not a bcp manifest (format field is {_get(doc, 'format')!r})")
        version = doc.get("version")
        if not isinstance(version, int) or version < 1:
            raise FormatError(f"{where}: invalid format version {version!r}")
        if version > FORMAT_VERSION:
            raise FormatError(
                f"{where}: format version {version} was written by a newer bcp "
                f"(this one reads up to {FORMAT_VERSION}); upgrade bcp to load it"
            )
        try:
            checksum = doc["checksum"]
            if checksum["algorithm"] != "crc32c":
                raise FormatError(f"{where}: unsupported checksum algorithm {checksum['algorithm']!r}")
            if doc.get("byte_order", "little") != "little":
                raise FormatError(f"{where}: unsupported byte order {doc['byte_order']!r}")
            return cls(
                save_id=str(doc["save_id"]),
                created=str(doc["created"]),
                world_size=int(doc["world_size"]),
                catalog=_file_entry(doc["catalog"]),
                data_files=tuple(_file_entry(f) for f in doc["data_files"]),
                objects={
                    str(k): [ObjectEntry(list(e["key_path"]), e["value"], e.get("rank")) for e in v]
                    for k, v in doc["objects"].items()
                },
                checksum_block_bytes=int(checksum["block_bytes"]),
                bcp_version=str(doc.get("bcp_version", "")),
                torch_version=str(doc.get("torch_version", "")),
                user_metadata=dict(doc.get("user_metadata", {})),
                stats=dict(doc.get("stats", {})),
                version=version,
            )
        except FormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise FormatError(f"{where}: missing or malformed field: {type(e).__name__}: {e}") from e


def _get(doc: Any, key: str) -> Any:
    return doc.get(key) if isinstance(doc, dict) else None


def _file_entry(doc: dict) -> FileEntry:
    return FileEntry(path=str(doc["path"]), nbytes=int(doc["nbytes"]), crc32c=int(doc["crc32c"]))
