"""Reading a committed checkpoint: manifest, catalog, tensors, objects.

``bcp.open(uri)`` needs no template: it lists what is stored and reads one tensor
at a time, touching only that tensor's bytes. ``bcp.load`` is built on it.

Every checkpoint is opened one way: :func:`fetch_metadata` reads the manifest and
the catalog (whole, or for a load of a large catalog only its head and trailer: at
16,384 ranks no rank receives the whole catalog), and :func:`open_reader` turns
those bytes, on any rank, into a :class:`CheckpointReader`. ``bcp.open``, the
loader, verify, convert and the local tier's recovery all go through the two.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import numpy as np
import torch

from bcp import objcodec
from bcp.backends import Backend, ObjectNotFoundError
from bcp.commit import parse_manifest, replaces_atomically
from bcp.discovery import missing_checkpoint_error
from bcp.errors import CorruptCheckpointError, IncompleteCheckpointError
from bcp.io_scheduler.device_copy import DeviceCopies, is_device_tensor
from bcp.io_scheduler.device_load import DeviceFill
from bcp.io_scheduler.read_exec import ReadStats, execute_reads
from bcp.io_scheduler.read_plan import RunSet, plan_tensor_reads, touched_rows
from bcp.io_scheduler.shard_reads import row_of, split_bulk
from bcp.io_scheduler.shared_dest import Span, check_destination, without_shared_destinations
from bcp.io_scheduler.staging import StagingPool, default_pool
from bcp.io_scheduler.whole_reads import execute_whole_reads
from bcp.metadata import Catalog, FormatError, Fragment, Manifest, ObjectEntry, TensorEntry, crc32c
from bcp.metadata.catalog.sections import TRAILER, is_v2
from bcp.metadata.geometry import Box, check_box_inside, intersect
from bcp.metadata.keys import manifest_key
from bcp.metadata.ties import first_of_each, tied_entries
from bcp.references import ParentFactory, describe_file, parent_factory, references_backend
from bcp.shards import RankValues
from bcp.state import KeyPath, a_dot_prefix_is_a_key, build_nested, path_from_json
from bcp.target import resolve_backend
from bcp.tensor_io import byte_view, copy_values
from bcp.torch_dtypes import torch_dtype

log = logging.getLogger(__name__)

#: how an export treats an object saved per rank: ``"all"`` keeps every saving rank's
#: value, an int keeps that saved rank's value only
PerRankChoice = Literal["all"] | int

#: catalogs up to this size are read whole when opened for a load (and shared with every rank)
WHOLE_CATALOG_BYTES = 8 << 20
#: the first read of a large catalog's end: the head is usually inside
TAIL_GUESS_BYTES = 1 << 20


def check_per_rank_choice(per_rank: object) -> None:
    """ValueError unless ``per_rank`` is ``"all"`` or a rank (an int >= 0)."""
    if per_rank != "all" and (type(per_rank) is not int or per_rank < 0):
        raise ValueError(f"per_rank must be 'all' or a saved rank (an int >= 0), not {per_rank!r}")


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """A stored global tensor: shape, dtype and the fragments that hold it."""

    fqn: str
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    entry: TensorEntry = dataclasses.field(repr=False, compare=False)

    @property
    def fragments(self) -> tuple[Fragment, ...]:
        """Every stored fragment (built on first use: a catalog row is columns until asked for)."""
        return self.entry.fragments


class CheckpointReader:
    """A committed checkpoint, opened for reading. Cheap to create: reads the
    manifest and the catalog, no tensor data."""

    def __init__(
        self, backend: Backend, manifest: Manifest, catalog: Catalog, *, allow_pickle: bool = False, verify: bool = True
    ) -> None:
        self.backend = backend
        self.manifest = manifest
        self.catalog = catalog
        self.allow_pickle = allow_pickle
        #: verify CRC32C of every checksum block a read touches (reads the rest of partly read blocks)
        self.verify = verify
        #: data files whose size in storage was found equal to the manifest's
        self._sizes_checked: set[str] = set()

    @property
    def uri(self) -> str:
        return self.backend.uri

    @property
    def _manifest_uri(self) -> str:
        return f"{self.uri}/{manifest_key()}"

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
            text = self.catalog.tensors[fqn].key_path
            try:
                doc = json.loads(text)
            except (ValueError, RecursionError) as e:
                raise FormatError(
                    f"{self.uri}/{self.manifest.catalog.path}: key path of {fqn!r} is not valid JSON: {e}"
                ) from None
            return path_from_json(doc, fqn=fqn, where=f"{self.uri}/{self.manifest.catalog.path}")
        return path_from_json(self._object_entry(fqn).key_path, fqn=fqn, where=self._manifest_uri)

    def check_keys(self) -> None:
        """FormatError naming the catalog and the key unless every stored entry has a place
        of its own in the rebuilt state: no catalog tensor has the FQN of a manifest object,
        and no entry's key path lies inside another's (a tensor ``a.b`` beside an object
        ``a``), which would drop one value or put it where the other was. Key paths are
        parsed only where an FQN is a dot-prefix of another (``{"a": 1, "a.b": t}`` is legitimate)."""
        catalog = f"{self.uri}/{self.manifest.catalog.path}"
        tensors, objects, index = self.catalog.tensors, self.manifest.objects, self.catalog.tensor_index  # dicts
        keys = set(index)
        if not keys.isdisjoint(objects):  # the first such tensor in the catalog's order named
            fqn = next(f for f in tensors if f in objects)
            raise FormatError(f"{catalog}: tensor {fqn!r} has the key of an object of {self._manifest_uri}")
        if not a_dot_prefix_is_a_key(keys.union(objects)):
            return  # no key's part before a dot is a key (the usual state): none is parsed
        for fqn in [*tensors, *objects]:
            start = 0
            while (dot := fqn.find(".", start)) != -1:
                start, outer = dot + 1, fqn[:dot]
                if outer not in index and outer not in objects:
                    continue
                try:
                    inner_keys, outer_keys = ([key for _kind, key in self.key_path(f)] for f in (fqn, outer))
                except FormatError:
                    continue  # an entry no read can use (raises again when asked for): inspect, verify go on
                if inner_keys[: len(outer_keys)] == outer_keys:
                    where = catalog if fqn in tensors or outer in tensors else self._manifest_uri
                    raise FormatError(
                        f"{where}: {fqn!r} is stored inside {outer!r}, which is stored as a value of its own"
                    )

    def meta(self, fqn: str) -> TensorMeta:
        e = self._tensor_entry(fqn)
        return TensorMeta(fqn, torch.Size(e.global_shape), torch_dtype(e.dtype, fqn=fqn), e.nbytes, entry=e)

    # -- reading ------------------------------------------------------------------------

    def read(self, fqn: str, box: Box | None = None) -> Any:
        """One stored entry: a new CPU tensor (reading only its bytes, or only those of
        ``box`` = (offsets, lengths)), or an object."""
        if fqn in self.manifest.objects and box is None:
            return self.read_object(fqn)
        out = self.empty(fqn, box)
        self.read_into(fqn, out, box=box)
        return out

    def empty(self, fqn: str, box: Box | None = None) -> torch.Tensor:
        """An uninitialised CPU tensor for the stored tensor, or its part ``box``, once the data
        files holding those bytes are found in storage with their declared sizes: what a
        hostile catalog can make a reader allocate is bounded by the bytes stored."""
        entry = self._tensor_entry(fqn)
        box = self._whole(entry) if box is None else box
        check_box_inside(fqn, entry.global_shape, box)
        self.check_sizes([(fqn, box)])
        return torch.empty(tuple(box[1]), dtype=torch_dtype(entry.dtype, fqn=fqn))

    def check_sizes(self, requests: list[tuple[str, Box]], *, prefer_rank: int = 0, files: Iterable[str] = ()) -> None:
        """Check, once per file and before anything is allocated for it, that every data
        file that reading ``requests`` ((fqn, box) pairs) touches holds in storage the
        size the manifest declares (the catalog was checked against the manifest when
        it was decoded, so every planned byte then lies inside a file that exists).
        A sparse file counts with its apparent size: storage reports no other. ``files``:
        data files to check as well (those of the tensors read in bulk)."""
        declared = {f.path: f.nbytes for f in self.manifest.data_files}
        if len(self._sizes_checked) == len(declared):
            return  # every file checked already (the usual case after the first tensor)
        self.catalog.require(requests)  # a catalog read in part fetches the rows these boxes need
        files = {f for f in files if f not in self._sizes_checked}
        by_tensor: dict[str, list[Box]] = {}
        for fqn, box in requests:
            by_tensor.setdefault(fqn, []).append(box)
        for fqn, boxes in by_tensor.items():  # only the rows these boxes meet, never every row
            if len(files) + len(self._sizes_checked) == len(declared):
                break  # every file is to be checked already: the other tensors can add none
            entry = self._tensor_entry(fqn)
            if (
                entry.num_fragments == 1
                and not any(entry.offsets[0].tolist())
                and tuple(entry.lengths[0].tolist()) == entry.global_shape
            ):
                # one fragment holding the whole tensor meets every non-empty box (no numpy per tensor)
                if entry.sizes[0] > 0 and any(math.prod(lengths) for _off, lengths in boxes):
                    name = entry.file_names[int(entry.files[0])]
                    if name not in self._sizes_checked:
                        files.add(name)
                continue
            _bi, rows, _off, _len = touched_rows(entry, boxes, prefer_rank)
            codes = np.unique(entry.files[rows[entry.sizes[rows] > 0]]).tolist()
            files.update(name for name in (entry.file_names[c] for c in codes) if name not in self._sizes_checked)
        if not files:
            return
        named = describe_file(self.backend)
        for file in sorted(files):
            try:
                size = self.backend.size(file)
            except ObjectNotFoundError as e:
                raise CorruptCheckpointError(f"data file {named(file)} is missing", file=file, offset=0) from e
            if size != declared[file]:
                raise CorruptCheckpointError(
                    f"data file {named(file)} holds {size} bytes; the manifest says {declared[file]}",
                    file=file,
                    offset=min(size, declared[file]),
                )
            self._sizes_checked.add(file)

    def read_object(self, fqn: str, rank: int | None = None) -> Any:
        """A stored object. One saved per rank comes back as a :class:`~bcp.RankValues`
        (every saving rank's value), or, with ``rank``, as that saving rank's value
        (KeyError naming the ranks that saved it when ``rank`` did not)."""
        if rank is None and self.is_per_rank(fqn):
            return RankValues(self.per_rank_objects(fqn))
        entry = self._object_entry(fqn, rank)
        return objcodec.decode(entry.value, fqn=fqn, allow_pickle=self.allow_pickle, where=self._manifest_uri)

    def objects(self) -> dict[str, Any]:
        """Every stored object, decoded (a per-rank one as a :class:`~bcp.RankValues`)."""
        return {fqn: self.read_object(fqn) for fqn in self.manifest.objects}

    def state(self, *, per_rank: PerRankChoice = "all") -> dict:
        """The whole saved state rebuilt as nested dicts/lists/tuples (tensors on CPU). An
        object saved per rank is, with ``per_rank="all"``, a :class:`~bcp.RankValues` of
        every saving rank's value; with ``per_rank=R``, saved rank ``R``'s value (KeyError
        naming the key and the ranks that saved it when ``R`` did not)."""
        check_per_rank_choice(per_rank)
        tensors = self.read_tensors(self.tensor_keys())
        values = [
            tensors[fqn] if fqn in tensors else self.read_object(fqn, None if per_rank == "all" else per_rank)
            for fqn in self.keys()
        ]
        return build_nested(zip([self.key_path(fqn) for fqn in self.keys()], values, strict=True))

    def read_tensors(self, fqns: list[str]) -> dict[str, torch.Tensor]:
        """Whole stored tensors as new CPU tensors, read together (runs that follow each other
        in a file in large requests); tied FQNs as one tensor, as saved (``metadata.ties``)."""
        out = self.empty_whole(fqns)
        self.fill([(fqn, self._whole(self._tensor_entry(fqn)), t) for fqn, t in first_of_each(out).items()])
        return out

    def empty_whole(self, fqns: list[str]) -> dict[str, torch.Tensor]:
        """:meth:`empty` of each of ``fqns``, one tensor for tied FQNs: FormatError for FQNs
        sharing bytes otherwise, which would allocate more than is stored (``metadata.ties``)."""
        names = list(dict.fromkeys(fqns))  # a key asked twice is one tensor
        tied = {names[i]: names[j] for i, j in tied_entries(self._entries(names)).items()}
        out = {fqn: self.empty(fqn) for fqn in names if fqn not in tied}
        return {fqn: out[tied.get(fqn, fqn)] for fqn in names}

    def read_into(self, fqn: str, dest: torch.Tensor, *, box: Box | None = None) -> ReadStats:
        """Fill ``dest`` with the stored tensor, or with the part ``box`` = (offsets,
        lengths) of it (``dest`` then has the box's shape). Casts if dtypes differ."""
        entry = self._tensor_entry(fqn)
        box = box if box is not None else self._whole(entry)
        if tuple(dest.shape) != tuple(box[1]):
            raise ValueError(f"{fqn!r}: destination shape {list(dest.shape)} != requested box {list(box[1])}")
        return self.fill([(fqn, box, dest)])

    def fill(
        self,
        requests: list[tuple[str, Box, torch.Tensor]],
        *,
        prefer_rank: int = 0,
        in_memory: dict[tuple[str, Box], torch.Tensor] | None = None,
        pool: StagingPool | None = None,
    ) -> ReadStats:
        """Fill each destination tensor with box ``box`` of tensor ``fqn``, reading only
        the bytes needed, straight into destination memory where its layout allows.
        ``in_memory`` maps (fqn, stored box) to that fragment's values, already at
        hand (shared by another rank): those parts are copied, not read. CUDA
        destinations are filled through slabs of ``pool`` (default: the process-wide
        pool; see ``bcp.io_scheduler.device_load``); the call returns once every byte has landed."""
        in_memory = in_memory or {}
        spans: list[Span] = []  # each destination's (address, bytes, dtype), found once for both
        kept = without_shared_destinations(requests, self.catalog, self._tensor_entry, spans)  # before any read
        block = self.manifest.checksum_block_bytes  # whole tensors and exact shards read in bulk; the rest planned
        # ``kept`` holds every destination until the call returns: bulk reads write through views holding none
        whole, sums, requests = split_bulk(self.catalog, block, kept, in_memory, spans)
        entries = self._entries([fqn for fqn, _box, _dest in requests])
        check_box = check_box_inside
        for (fqn, box, dest), entry in zip(requests, entries, strict=True):  # everything checked before any allocation
            check_box(fqn, entry.global_shape, box)
            check_destination(fqn, dest)
        wanted = [(fqn, box) for fqn, box, _dest in requests]
        if not self.catalog.is_whole:
            self.catalog.require(wanted)  # a catalog read in part fetches the rows these boxes need
            entries = [self._tensor_entry(fqn) for fqn, _box in wanted]  # with the rows read just now
        self.check_sizes(wanted, prefer_rank=prefer_rank, files={read.file for read in whole})
        devices = sorted({dest.device for _f, _b, dest in requests if is_device_tensor(dest)}, key=str)
        device_fill: DeviceFill | None = None
        if devices:
            device_copies = DeviceCopies()
            device_copies.start(devices)  # after the caller's work on the destinations
            device_fill = DeviceFill(
                pool or default_pool(), device_copies, block=self.manifest.checksum_block_bytes, prefer_rank=prefer_rank
            )
        held: dict[str, dict[Box, torch.Tensor]] = {}
        for (fqn, fbox), values in in_memory.items():
            held.setdefault(fqn, {})[fbox] = values
        views: list[memoryview] = []
        plans: list[RunSet] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        none: frozenset[Box] = frozenset()
        dtypes: dict[str, torch.dtype] = {}  # one lookup per stored dtype name, not per tensor
        for (fqn, box, dest), entry in zip(requests, entries, strict=True):
            dtype = dtypes.get(entry.dtype)
            if dtype is None:
                dtype = dtypes[entry.dtype] = torch_dtype(entry.dtype, fqn=fqn)
            mine = held.get(fqn) if held else None
            if device_fill is not None and is_device_tensor(dest):
                mine = mine or {}
                for part, values in _held_parts(dest.detach(), box, mine):
                    device_fill.add_host_part(part, values)
                device_fill.add(entry, box, dest, dtype, frozenset(mine))
                continue
            if (
                dest.is_cpu
                and dest.dtype == dtype
                and dest.is_contiguous()
                and not dest.is_conj()
                and not dest.is_neg()
            ):
                landing = dest  # byte_view and copy_values work on it without autograd
            else:
                landing = torch.empty(tuple(box[1]), dtype=dtype)
                copies.append((dest, landing))
            index = len(views)
            views.append(byte_view(landing))
            if mine:
                for part, values in _held_parts(landing.detach(), box, mine):
                    copy_values(part, values)
            plans += plan_tensor_reads(
                entry, [box], prefer_rank=prefer_rank, in_memory=frozenset(mine) if mine else none, dest=index
            )
        stats = execute_reads(self.backend, plans, views, block_bytes=block, verify=self.verify)
        row = lambda read: row_of(self._tensor_entry(read.fqn), read)  # noqa: E731 - names a bulk read in an error
        stats.add(execute_whole_reads(self.backend, whole, sums, row, block_bytes=block, verify=self.verify))
        for dest, landing in copies:
            copy_values(dest, landing)
        if device_fill is not None:
            stats.add(device_fill.run(self.backend, verify=self.verify, streams=self.backend.hints.concurrency))
        return stats

    # -- helpers ------------------------------------------------------------------------

    @staticmethod
    def _whole(entry: TensorEntry) -> Box:
        return (0,) * len(entry.global_shape), entry.global_shape

    def _entries(self, fqns: list[str]) -> list[TensorEntry]:
        """The entries of ``fqns`` in one catalog call (:meth:`_tensor_entry`'s KeyError)."""
        try:
            return self.catalog.entries(fqns)
        except KeyError:
            return [self._tensor_entry(fqn) for fqn in fqns]

    def _tensor_entry(self, fqn: str) -> TensorEntry:
        try:
            return self.catalog.tensors[fqn]
        except KeyError:
            kind = "an object, not a tensor" if fqn in self.manifest.objects else "not in the checkpoint"
            raise KeyError(f"{fqn!r} is {kind} ({self.uri})") from None

    def _object_entry(self, fqn: str, rank: int | None = None) -> ObjectEntry:
        entries = self.manifest.objects.get(fqn)
        if not entries:
            kind = "a tensor, not an object" if fqn in self.catalog.tensors else "not in the checkpoint"
            raise KeyError(f"{fqn!r} is {kind} ({self.uri})")
        if rank is None or entries[0].rank is None:  # a job-wide object: every rank's value
            return entries[0]
        for e in entries:
            if e.rank == rank:
                return e
        saved = sorted(e.rank for e in entries if e.rank is not None)
        raise KeyError(
            f"per-rank object {fqn!r} has no value saved by rank {rank} (saved by ranks {saved}; {self.uri})"
        )

    def per_rank_objects(self, fqn: str) -> dict[int, Any]:
        """rank -> value for an object saved per rank ({} for a job-wide object)."""
        return {
            e.rank: objcodec.decode(e.value, fqn=fqn, allow_pickle=self.allow_pickle, where=self._manifest_uri)
            for e in self.manifest.objects.get(fqn, [])
            if e.rank is not None
        }

    def is_per_rank(self, fqn: str) -> bool:
        entries = self.manifest.objects.get(fqn, [])
        return bool(entries) and entries[0].rank is not None

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointReader({self.uri!r}, tensors={len(self.catalog.tensors)}, objects={len(self.manifest.objects)})"
        )


def _held_parts(
    landing: torch.Tensor, box: Box, held: dict[Box, torch.Tensor]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(part of ``landing``, the values for it) for each fragment in ``held`` (stored
    box -> values already in memory) that overlaps ``box``, the box ``landing`` holds."""
    for (f_off, f_len), values in held.items():
        region = intersect(box[0], box[1], f_off, f_len)
        if region is not None:
            r_off, r_len = region
            src = values[tuple(slice(o - fo, o - fo + n) for o, fo, n in zip(r_off, f_off, r_len, strict=True))]
            yield landing[tuple(slice(o - bo, o - bo + n) for o, bo, n in zip(r_off, box[0], r_len, strict=True))], src


# -- opening: the one path from storage to a reader -------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """What opening a checkpoint reads before any tensor: the manifest's bytes and the
    catalog's. One rank reads them and every rank gets them (a load's coordinator, a
    local step's source host), so they are bytes, never parsed objects."""

    manifest: bytes
    #: the whole catalog; with ``head_only``, only its last bytes: the head (tensor
    #: table, section table, span index) and the trailer (catalog v2, FORMAT.md)
    catalog: bytes
    #: the catalog was too large to read whole: sections are read when a reader needs them
    head_only: bool = False


def fetch_metadata(backend: Backend, *, allow_head_only: bool = False) -> CheckpointMetadata:
    """The committed checkpoint's manifest and its catalog, checked against each other:
    the whole catalog (its size and CRC32C), or, with ``allow_head_only`` and a v2
    catalog over ``WHOLE_CATALOG_BYTES``, only its head and trailer (ranged reads;
    ``head_only``), so that no rank of a large job receives the whole catalog.
    Distinguishes nothing there from a save that never committed."""
    manifest_bytes, manifest = fetch_manifest(backend)
    cat = manifest.catalog
    if not allow_head_only or cat.nbytes <= WHOLE_CATALOG_BYTES:
        return CheckpointMetadata(manifest_bytes, fetch_catalog(backend, manifest))
    try:
        size = backend.size(cat.path)
    except ObjectNotFoundError as e:
        raise CorruptCheckpointError(f"catalog {cat.path!r} of {backend.uri} is missing", file=cat.path) from e
    if size != cat.nbytes:
        raise CorruptCheckpointError(
            f"catalog {cat.path!r} of {backend.uri} holds {size} bytes; the manifest says {cat.nbytes}",
            file=cat.path,
        )
    guess = min(TAIL_GUESS_BYTES, size)
    tail = _ranged(backend, cat.path, size - guess, guess)
    if not is_v2(tail):  # a v1 catalog: one Arrow file, read whole
        return CheckpointMetadata(manifest_bytes, fetch_catalog(backend, manifest))
    need = Catalog.tail_bytes(size, tail[-TRAILER.size :])
    if need > len(tail):
        tail = _ranged(backend, cat.path, size - need, need - len(tail)) + tail
    return CheckpointMetadata(manifest_bytes, tail[len(tail) - need :], head_only=True)


def fetch_manifest(backend: Backend) -> tuple[bytes, Manifest]:
    """The committed manifest's bytes, parsed; distinguishes nothing there from a save
    that never committed (``discovery.missing_checkpoint_error``)."""
    try:
        manifest_bytes = backend.read(manifest_key())
    except ObjectNotFoundError:
        error = missing_checkpoint_error(backend)
        if isinstance(error, IncompleteCheckpointError) and not replaces_atomically(backend):
            error = IncompleteCheckpointError(
                f"{error}; or, since this store cannot replace objects atomically, an overwrite is between "
                "deleting the old manifest and writing the new one: try again"
            )
        raise error from None
    return manifest_bytes, parse_manifest(backend, manifest_bytes)


def fetch_catalog(backend: Backend, manifest: Manifest) -> bytes:
    """The whole catalog's bytes, checked against the manifest's size and CRC32C."""
    cat = manifest.catalog
    try:
        data = backend.read(cat.path)
    except ObjectNotFoundError as e:
        raise CorruptCheckpointError(f"catalog {cat.path!r} of {backend.uri} is missing", file=cat.path) from e
    check_catalog(backend.uri, manifest, data)
    return data


def check_catalog(uri: str, manifest: Manifest, data: bytes) -> None:
    """CorruptCheckpointError unless ``data`` is the whole catalog ``manifest`` names
    (its size and CRC32C): for bytes read here, or received from another rank."""
    cat = manifest.catalog
    if len(data) != cat.nbytes or crc32c(data) != cat.crc32c:
        raise CorruptCheckpointError(
            f"catalog {cat.path!r} of {uri} does not match the manifest "
            f"({len(data)} bytes, crc32c {crc32c(data):#010x}; expected {cat.nbytes} bytes, {cat.crc32c:#010x})",
            file=cat.path,
        )


def _ranged(backend: Backend, key: str, offset: int, length: int) -> bytes:
    """``length`` bytes of the catalog ``key`` from ``offset``: all of them, or a CorruptCheckpointError."""
    try:
        data = backend.read(key, offset, length)
    except ObjectNotFoundError as e:
        raise CorruptCheckpointError(f"catalog {key!r} of {backend.uri} is missing", file=key) from e
    if len(data) != length:
        raise CorruptCheckpointError(
            f"catalog {key!r} of {backend.uri} ended before byte {offset + length} "
            f"({len(data)} of {length} bytes from {offset})",
            file=key,
            offset=offset + len(data),
        )
    return data


def open_reader(
    backend: Backend,
    metadata: CheckpointMetadata,
    *,
    allow_pickle: bool = False,
    verify: bool = True,
    parent: ParentFactory | None = None,
) -> CheckpointReader:
    """A reader over ``metadata`` (from :func:`fetch_metadata`, possibly read by another
    rank): the manifest parsed, the catalog decoded (whole, or from its head: its
    sections are then read from ``backend`` when ``reader.catalog.require`` asks for
    them, each checked against the head) and checked against the manifest's data
    files, and every stored entry given a place of its own (``check_keys``). An
    incremental checkpoint's references are read on the backend ``parent`` builds (its
    parent URI's: :func:`bcp.references.parent_factory`); without one, it is refused."""
    manifest = parse_manifest(backend, metadata.manifest)
    backend = references_backend(backend, manifest, parent)
    path = manifest.catalog.path
    where = f"{backend.uri}/{path}"
    sizes = {f.path: f.nbytes for f in manifest.data_files}  # each once, sizes >= 0: the manifest parser checked
    if metadata.head_only:

        def fetch(offset: int, length: int) -> bytes:
            return _ranged(backend, path, offset, length)

        catalog = Catalog.from_head(
            metadata.catalog,
            file_size=manifest.catalog.nbytes,
            fetch=fetch,
            where=where,
            checksum_block_bytes=manifest.checksum_block_bytes,
        )
    else:
        catalog = Catalog.from_arrow(metadata.catalog, where=where, checksum_block_bytes=manifest.checksum_block_bytes)
    catalog.check_files(sizes, where=where)
    reader = CheckpointReader(backend, manifest, catalog, allow_pickle=allow_pickle, verify=verify)
    reader.check_keys()
    return reader


def open_checkpoint(
    uri: str, *, allow_pickle: bool = False, verify: bool = True, storage_options: dict | None = None
) -> CheckpointReader:
    """Open the committed checkpoint at ``uri`` (``bcp.open``). Reads manifest and catalog only."""
    backend = resolve_backend(uri, storage_options)
    parent = parent_factory(uri, storage_options)
    return open_reader(backend, fetch_metadata(backend), allow_pickle=allow_pickle, verify=verify, parent=parent)
