"""manifest.json: the commit record of a checkpoint (FORMAT.md, "manifest.json").

Written last. A checkpoint whose manifest is absent was never committed and does
not exist to a reader. It names the generation of files that belong to it, so an
overwrite can write a whole new generation beside the old one and switch with one
atomic put.

Everything in it decides what a load returns (objects, file sizes and CRCs, block
size, world size), so it carries its own CRC32C (``manifest_crc32c``, from version
2) and every field is checked for type and range before anything uses it: a
flipped bit or a hostile file is a FormatError naming the file and the field, never
a different state or some other exception further down.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from typing import Any

from bcp.metadata.checksum import crc32c
from bcp.metadata.format_errors import CorruptManifestError, FormatError
from bcp.metadata.keys import (
    DATA_FILE_NAME_RE,
    MANIFEST_KEY,
    catalog_key,
    generation_name,
    is_generation,
    is_sibling_name,
)

__all__ = [
    "CRC_FIELD",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LATEST_VERSION",
    "MANIFEST_KEY",
    "MAX_JSON_DEPTH",
    "MAX_OBJECT_DEPTH",
    "REFERENCES_VERSION",
    "FileEntry",
    "Manifest",
    "ObjectEntry",
    "reseal",
    "seal",
]

FORMAT_NAME = "bcp-checkpoint"
#: 2: the manifest carries ``manifest_crc32c``. Version 1 (without it) is still read.
#: What bcp writes for a checkpoint without references (every full save).
FORMAT_VERSION = 2
#: 3: data files may be references to a sibling's (``data_files[].checkpoint``); bcp
#: writes it only for a checkpoint that has one, so full ones stay readable by 2's readers.
REFERENCES_VERSION = 3
#: The newest version this bcp reads.
LATEST_VERSION = REFERENCES_VERSION
#: The first version whose manifests must carry their own checksum.
CRC_REQUIRED_FROM = 2
CRC_FIELD = "manifest_crc32c"
#: Deepest nesting of arrays and objects a reader accepts (the top-level object is 1):
#: deeper JSON would exhaust the parser's recursion long before it meant anything.
MAX_JSON_DEPTH = 200
#: An object's value sits at depth 5 (manifest, "objects", FQN list, entry, value).
MAX_OBJECT_DEPTH = MAX_JSON_DEPTH - 4
MAX_CHECKSUM_BLOCK_BYTES = 1 << 32
MAX_WORLD_SIZE = 1 << 24
_INT64_MAX = (1 << 63) - 1

_WS = rb"[ \t\n\r]*"
#: The last member of the top-level object, then the object's end: where the CRC is.
_TRAILER = re.compile(rb'"manifest_crc32c"' + _WS + rb":" + _WS + rb'"([0-9a-f]{8})"' + _WS + rb"\}" + _WS + rb"\Z")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = tuple(1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256))
_SAVE_ID = re.compile(r"[0-9a-f]+")


@dataclasses.dataclass(frozen=True, slots=True)
class FileEntry:
    """A data or catalog object of the checkpoint, or (``checkpoint`` set, version 3) a
    data file of a sibling checkpoint that this one refers to (FORMAT.md, "References")."""

    path: str
    nbytes: int
    #: data files: CRC32C over the block checksums (metadata.checksum.digest_of_checksums);
    #: the catalog: CRC32C of its bytes.
    crc32c: int
    #: None: the file is this checkpoint's own (``path`` under its generation). A name:
    #: the sibling checkpoint (same parent URI) whose generation holds the bytes, read at
    #: ``<checkpoint>/<path>`` of the parent (:func:`bcp.metadata.keys.reference_key`).
    checkpoint: str | None = None

    @property
    def is_reference(self) -> bool:
        return self.checkpoint is not None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"path": self.path, "nbytes": self.nbytes, "crc32c": self.crc32c}
        if self.checkpoint is not None:
            doc["checkpoint"] = self.checkpoint
        return doc


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
    #: 0 (the default): chosen from the data files, REFERENCES_VERSION when one is a
    #: reference, else FORMAT_VERSION; an explicit version is kept (a manifest read back)
    #: but must be REFERENCES_VERSION or later when a data file is a reference.
    version: int = 0
    byte_order: str = "little"
    checksum_algorithm: str = "crc32c"

    def __post_init__(self) -> None:
        referring = any(f.checkpoint is not None for f in self.data_files)
        if self.version == 0:
            object.__setattr__(self, "version", REFERENCES_VERSION if referring else FORMAT_VERSION)
        elif referring and self.version < REFERENCES_VERSION:
            raise ValueError(
                f"manifest version {self.version} cannot hold references; they need version {REFERENCES_VERSION}"
            )

    @property
    def generation(self) -> str:
        """Key prefix of every data and catalog object of this save."""
        return self.catalog.path.split("/", 1)[0]

    @property
    def references(self) -> tuple[FileEntry, ...]:
        """The data files that belong to sibling checkpoints (``checkpoint`` set)."""
        return tuple(f for f in self.data_files if f.checkpoint is not None)

    @property
    def own_files(self) -> tuple[FileEntry, ...]:
        """The data files under this checkpoint's own generation."""
        return tuple(f for f in self.data_files if f.checkpoint is None)

    def to_json(self) -> bytes:
        """The file's bytes, ending with their own CRC32C (``manifest_crc32c``)."""
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
            CRC_FIELD: "00000000",
        }
        data = json.dumps(doc, indent=1, allow_nan=False, ensure_ascii=True).encode("utf-8")
        if _max_depth(data) > MAX_JSON_DEPTH:  # readers would refuse it: fail the save instead
            raise FormatError(f"{MANIFEST_KEY}: nested deeper than {MAX_JSON_DEPTH} levels")
        return seal(data)

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Manifest:
        """Check and parse a manifest; FormatError (CorruptManifestError when its own
        CRC32C fails) naming ``where`` and the field for anything else than FORMAT.md's."""
        trailer = _TRAILER.search(data)
        if trailer is not None:
            stored, actual = int(trailer.group(1), 16), _crc_with_zeroed_field(data, trailer)
            if stored != actual:
                raise CorruptManifestError(
                    f"{where}: fails its own CRC32C ({CRC_FIELD} {stored:08x}, computed {actual:08x}): "
                    "the file is corrupt or was edited"
                )
        doc = _load_json(data, where)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise FormatError(f"{where}: not a bcp manifest (format field is {_get(doc, 'format')!r})")
        version = doc.get("version")
        if type(version) is not int or version < 1:
            raise FormatError(f"{where}: invalid format version {version!r}")
        if version > LATEST_VERSION:
            raise FormatError(
                f"{where}: format version {version} was written by a newer bcp "
                f"(this one reads up to {LATEST_VERSION}); upgrade bcp to load it"
            )
        _check_crc_field(doc, trailer, version, where)
        return _Fields(where).manifest(doc, version)


def seal(data: bytes) -> bytes:
    """``data``, a manifest ending with ``"manifest_crc32c": "00000000"}``, with the CRC filled in."""
    trailer = _TRAILER.search(data)
    if trailer is None or trailer.group(1) != b"00000000":
        raise ValueError(f"not a manifest ending with a zeroed {CRC_FIELD}")
    crc = f"{_crc_with_zeroed_field(data, trailer):08x}".encode()
    return data[: trailer.start(1)] + crc + data[trailer.end(1) :]


def reseal(doc: dict) -> bytes:
    """``doc`` (a manifest as ``json.loads`` returns it) written with a fresh
    ``manifest_crc32c``: for tools and tests that change a manifest on purpose."""
    body = {k: v for k, v in doc.items() if k != CRC_FIELD}
    body[CRC_FIELD] = "00000000"
    return seal(json.dumps(body, indent=1, ensure_ascii=True).encode("utf-8"))


def _crc_with_zeroed_field(data: bytes, trailer: re.Match[bytes]) -> int:
    """FORMAT.md's rule: the CRC32C of the whole file with the field's 8 digits read as ``0``."""
    start, end = trailer.span(1)
    return crc32c(b"".join((data[:start], b"00000000", data[end:])))


def _check_crc_field(doc: dict, trailer: re.Match[bytes] | None, version: int, where: str) -> None:
    """The CRC was checked if the file ends with it; make sure it had to be there and is the
    top-level member, so no bit flip (in the version, in the name) can skip the check."""
    if CRC_FIELD in doc:
        if trailer is None:
            raise FormatError(
                f"{where}: {CRC_FIELD} must be the last member of the manifest, as 8 lowercase hex digits"
            )
        if doc[CRC_FIELD] != trailer.group(1).decode():
            raise FormatError(f"{where}: {CRC_FIELD} {doc[CRC_FIELD]!r} is not the one at the end of the file")
        return
    if trailer is not None:  # ends like the field but it is not the top-level member (an escaped key)
        raise FormatError(f"{where}: the member at its end only looks like {CRC_FIELD}")
    if version >= CRC_REQUIRED_FROM:
        raise FormatError(f"{where}: has no {CRC_FIELD}, which format version {version} requires")
    for key in doc:
        if len(key) == len(CRC_FIELD) and sum(a != b for a, b in zip(key, CRC_FIELD, strict=True)) <= 2:
            raise FormatError(f"{where}: field {key!r} looks like a damaged {CRC_FIELD}; the manifest is corrupt")


def _max_depth(data: bytes) -> int:
    """Deepest nesting of arrays and objects, from the brackets outside strings: a cheap
    scan, so that no parser recurses into a hostile file."""
    skeleton = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_STEP.__getitem__, skeleton)), default=0)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows a float")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {dup!r}")
    return doc


def _load_json(data: bytes, where: str) -> Any:
    """Strict JSON: UTF-8, bounded nesting, no NaN/Infinity, finite numbers, unique keys."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{where}: not valid JSON: {e}") from e
    depth = _max_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise FormatError(f"{where}: nested {depth} levels deep; readers accept up to {MAX_JSON_DEPTH}")
    try:
        return json.loads(
            text, object_pairs_hook=_unique_keys, parse_constant=_reject_constant, parse_float=_finite_float
        )
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError, as are the hooks' and int()'s
        raise FormatError(f"{where}: not valid JSON: {e}") from e


def _get(doc: Any, key: str) -> Any:
    return doc.get(key) if isinstance(doc, dict) else None


class _Fields:
    """Type and range checks of each field, raising FormatError naming file and field."""

    def __init__(self, where: str) -> None:
        self.where = where

    def bad(self, field: str, value: Any, want: str) -> FormatError:
        text = repr(value)
        text = text if len(text) <= 80 else text[:77] + "..."
        return FormatError(f"{self.where}: field {field!r} is {text}; expected {want}")

    def get(self, doc: dict, key: str, field: str) -> Any:
        if key not in doc:
            raise FormatError(f"{self.where}: field {field!r} is missing")
        return doc[key]

    def int_(self, value: Any, field: str, lo: int, hi: int) -> int:
        if type(value) is not int or not lo <= value <= hi:
            raise self.bad(field, value, f"an integer from {lo} to {hi}")
        return value

    def str_(self, value: Any, field: str) -> str:
        if type(value) is not str:
            raise self.bad(field, value, "a string")
        return value

    def dict_(self, value: Any, field: str) -> dict:
        if type(value) is not dict:
            raise self.bad(field, value, "a JSON object")
        return value

    def list_(self, value: Any, field: str) -> list:
        if type(value) is not list:
            raise self.bad(field, value, "a JSON array")
        return value

    def manifest(self, doc: dict, version: int) -> Manifest:
        save_id = self.str_(self.get(doc, "save_id", "save_id"), "save_id")
        if not _SAVE_ID.fullmatch(save_id):
            raise self.bad("save_id", save_id, "lowercase hex digits")
        generation = generation_name(save_id)
        if doc.get("byte_order", "little") != "little":
            raise self.bad("byte_order", doc["byte_order"], '"little"')
        checksum = self.dict_(self.get(doc, "checksum", "checksum"), "checksum")
        if checksum.get("algorithm") != "crc32c":
            raise FormatError(f"{self.where}: unsupported checksum algorithm {checksum.get('algorithm')!r}")
        block = self.int_(
            self.get(checksum, "block_bytes", "checksum.block_bytes"),
            "checksum.block_bytes",
            1,
            MAX_CHECKSUM_BLOCK_BYTES,
        )
        world_size = self.int_(self.get(doc, "world_size", "world_size"), "world_size", 1, MAX_WORLD_SIZE)
        catalog = self.file_entry(self.get(doc, "catalog", "catalog"), "catalog")
        if catalog.path != catalog_key(generation):
            raise self.bad("catalog.path", catalog.path, repr(catalog_key(generation)))
        files = self.list_(self.get(doc, "data_files", "data_files"), "data_files")
        data_files = tuple(self.file_entry(f, f"data_files[{i}]", version=version) for i, f in enumerate(files))
        seen: set[str] = set()
        for i, f in enumerate(data_files):
            self.data_path(f, f"data_files[{i}]", generation)
            if f.path in seen:
                raise self.bad(f"data_files[{i}].path", f.path, "each data file listed once")
            seen.add(f.path)
        objects = self.dict_(self.get(doc, "objects", "objects"), "objects")
        return Manifest(
            save_id=save_id,
            created=self.str_(self.get(doc, "created", "created"), "created"),
            world_size=world_size,
            catalog=catalog,
            data_files=data_files,
            objects={fqn: self.object_entries(fqn, entries, world_size) for fqn, entries in objects.items()},
            checksum_block_bytes=block,
            bcp_version=self.str_(doc.get("bcp_version", ""), "bcp_version"),
            torch_version=self.str_(doc.get("torch_version", ""), "torch_version"),
            user_metadata=dict(self.dict_(doc.get("user_metadata", {}), "user_metadata")),
            stats=dict(self.dict_(doc.get("stats", {}), "stats")),
            version=version,
        )

    def file_entry(self, doc: Any, field: str, *, version: int = 0) -> FileEntry:
        """A ``{"path", "nbytes", "crc32c"}`` entry; with ``version`` (a data file's),
        also its ``checkpoint`` (a reference: version 3 or later, a sibling's name)."""
        doc = self.dict_(doc, field)
        path = self.str_(self.get(doc, "path", f"{field}.path"), f"{field}.path")
        nbytes = self.int_(self.get(doc, "nbytes", f"{field}.nbytes"), f"{field}.nbytes", 0, _INT64_MAX)
        crc = self.int_(self.get(doc, "crc32c", f"{field}.crc32c"), f"{field}.crc32c", 0, 0xFFFFFFFF)
        checkpoint = None
        if "checkpoint" in doc:
            if not version:
                raise self.bad(f"{field}.checkpoint", doc["checkpoint"], "no such field (only data files refer)")
            if version < REFERENCES_VERSION:
                raise FormatError(
                    f"{self.where}: field {field + '.checkpoint'!r} (a reference) needs format version "
                    f"{REFERENCES_VERSION}; the manifest says version {version}"
                )
            checkpoint = self.str_(doc["checkpoint"], f"{field}.checkpoint")
            if not is_sibling_name(checkpoint):
                raise self.bad(
                    f"{field}.checkpoint", checkpoint, "a sibling checkpoint's name ([A-Za-z0-9_][A-Za-z0-9._-]*)"
                )
        return FileEntry(path=path, nbytes=nbytes, crc32c=crc, checkpoint=checkpoint)

    def data_path(self, f: FileEntry, field: str, generation: str) -> None:
        """``gen-<save_id>/data/NAME`` for an own file; ``gen-<id>/data/NAME`` of another
        generation for a reference (generation ids are unique, so its path names its owner)."""
        head, _, name = f.path.rpartition("/")
        gen, _, data = head.partition("/")
        if f.checkpoint is None:
            if head != f"{generation}/data" or not DATA_FILE_NAME_RE.fullmatch(name):
                raise self.bad(f"{field}.path", f.path, f"a file name under {generation}/data/")
        elif not (is_generation(gen) and data == "data" and DATA_FILE_NAME_RE.fullmatch(name)):
            raise self.bad(f"{field}.path", f.path, "gen-<id>/data/NAME of the referenced checkpoint")
        elif gen == generation:
            raise self.bad(f"{field}.path", f.path, f"a generation other than this checkpoint's own ({generation})")

    def object_entries(self, fqn: str, entries: Any, world_size: int) -> list[ObjectEntry]:
        field = f"objects[{fqn!r}]"
        entries = self.list_(entries, field)
        if not entries:
            raise self.bad(field, entries, "at least one entry")
        out = [self.object_entry(fqn, e, f"{field}[{i}]", world_size) for i, e in enumerate(entries)]
        ranks = [e.rank for e in out]
        if (None in ranks and len(out) != 1) or len(set(ranks)) != len(ranks):
            raise self.bad(f"{field}.rank", ranks, "null in a single entry, or distinct ranks")
        return out

    def object_entry(self, fqn: str, doc: Any, field: str, world_size: int) -> ObjectEntry:
        doc = self.dict_(doc, field)
        key_path = self.list_(self.get(doc, "key_path", f"{field}.key_path"), f"{field}.key_path")
        keys = []
        for elem in key_path:
            if (
                type(elem) is not list
                or len(elem) != 2
                or elem[0] not in ("d", "l", "t")
                or not (type(elem[1]) is int or (elem[0] == "d" and type(elem[1]) is str))
            ):
                raise self.bad(f"{field}.key_path", key_path, '[kind, key] pairs, kind "d", "l" or "t"')
            keys.append(str(elem[1]))
        if not keys or ".".join(keys) != fqn:
            raise self.bad(f"{field}.key_path", key_path, f"a key path whose keys joined by '.' are {fqn!r}")
        value = self.get(doc, "value", f"{field}.value")
        rank = doc.get("rank")
        if rank is not None:
            self.int_(rank, f"{field}.rank", 0, world_size - 1)
        return ObjectEntry(key_path, value, rank)
