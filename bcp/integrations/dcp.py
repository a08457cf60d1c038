"""PyTorch DCP checkpoints on any bcp backend: a ``StorageWriter``/``StorageReader`` pair.

``dcp.save(state, storage_writer=BcpStorageWriter(uri))`` and
``dcp.load(state, storage_reader=BcpStorageReader(uri))`` keep DCP's own format (its
``.metadata`` pickle and ``__<rank>_<n>.distcp`` data files, readable by DCP's
``FileSystemReader`` when the backend is a local directory) and add what bcp's storage
gives its own checkpoints (docs/integrations.md, "DCP storage"):

* every object goes through the backend's writers: parallel multipart uploads on S3
  and GCS, the retries and timeouts of ``backend_for``, any registered plugin;
* CRC32C: each data file is checksummed while it is written, in segments cut where
  DCP's writer asks the stream for its position (at the edges of every item), and
  the checksums go to a bcp-owned sidecar, ``.bcp-checksums.json`` (JSON), with the
  size and CRC32C of ``.metadata`` itself; the reader verifies every byte it hands
  to DCP and names the file and offset of a mismatch;
* atomic commit: ``.metadata`` is written last, create-only where the store can
  (``If-None-Match`` on S3, ``O_EXCL`` locally), so a save killed at any point before
  it never looks complete, and two saves racing for one URI cannot both win.

DCP's ``.metadata`` is a pickle. The reader unpickles it with bcp's allow-list
(:class:`bcp.convert.dcp_metadata.MetadataUnpickler`: DCP's own metadata types only)
unless ``allow_pickle=True``. Data items are DCP's: tensors are read back with
``torch.load(weights_only=True)``, as DCP does; non-tensor items go to the load
planner's ``load_bytes`` (DCP's ``DefaultLoadPlanner`` unpickles them without limits;
``bcp.convert.dcp_metadata.SafeBytesPlanner`` does not).

The writer reuses DCP's ``FileSystemWriter`` for planning and for the bytes of the data
files (the way DCP's own fsspec writer does, with ``self.fs`` set to a filesystem of
its own), so the files are byte for byte what DCP writes; ``finish`` is bcp's.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import itertools
import json
import logging
import os
import pickle
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter, StorageReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from bcp.backends import Backend, ObjectExistsError, ObjectNotFoundError, backend_for, join_uri
from bcp.convert.dcp_metadata import check_storage, parse_metadata
from bcp.convert.pickle_check import check_archive
from bcp.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatError,
)
from bcp.integrations.dcp_storage import (
    CHECKSUMS_FORMAT,
    CHECKSUMS_KEY,
    CHECKSUMS_VERSION,
    METADATA_KEY,
    BackendFileSystem,
    FileChecksums,
    FileEntry,
    is_bcp_uri,
    parse_checksums,
)
from bcp.metadata.checksum import crc32c

log = logging.getLogger(__name__)

__all__ = ["CHECKSUMS_KEY", "METADATA_KEY", "BcpStorageReader", "BcpStorageWriter", "ChecksummedWriteResult"]


@dataclasses.dataclass(frozen=True)
class ChecksummedWriteResult(WriteResult):
    """DCP's ``WriteResult``, carrying to the coordinator the checksums of the files this
    rank wrote (on the rank's first result). ``finish`` keeps only DCP's fields in
    ``.metadata``."""

    files: tuple[FileChecksums, ...] = ()


class BcpStorageWriter(FileSystemWriter):
    """Writes a standard DCP checkpoint to ``uri`` (any bcp URI or local path) through
    bcp's backends. ``overwrite=False`` (DCP's writer defaults to True) refuses a URI
    that holds a complete checkpoint; with True its ``.metadata`` is deleted before any
    data is written, so the old checkpoint stops being loadable at once and the new one
    becomes loadable when its save finishes. ``thread_count`` and
    ``single_file_per_rank`` are DCP's; ``storage_options`` go to ``backend_for``."""

    def __init__(
        self,
        uri: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        thread_count: int = 1,
        single_file_per_rank: bool = True,
        **storage_options: Any,
    ) -> None:
        # sync_files=False: durability is the backend's commit (fsync on the file backend)
        super().__init__(
            os.fspath(uri),
            single_file_per_rank=single_file_per_rank,
            sync_files=False,
            thread_count=thread_count,
            overwrite=overwrite,
        )
        self.storage = BackendFileSystem(storage_options)
        # DCP's writer writes through self.fs, as DCP's own fsspec writer arranges it
        self.fs = self.storage  # type: ignore[assignment]
        self.path = self.storage.init_path(os.fspath(uri))

    @property
    def backend(self) -> Backend:
        return self.storage.at()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self.storage.committed.clear()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ValueError(
                f"{self.backend.uri}: BcpStorageWriter commits one .metadata for the whole group; "
                "dcp.save(use_collectives=False) writes one per rank, which it does not support"
            )
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.overwrite and self.backend.exists(METADATA_KEY):
            raise CheckpointExistsError(
                f"{self.backend.uri} already holds a complete DCP checkpoint ({METADATA_KEY}); "
                "choose another URI or pass BcpStorageWriter(..., overwrite=True)"
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator after every rank planned and before any rank writes.
        if self.overwrite and self.backend.exists(METADATA_KEY):
            log.info("overwriting the DCP checkpoint in %s: deleting its %s first", self.backend.uri, METADATA_KEY)
            self.backend.delete(METADATA_KEY)
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.storage.committed.clear()
        results = super().write_data(plan, planner).wait()
        files = tuple(self.storage.committed.values())
        out: list[WriteResult] = [
            ChecksummedWriteResult(r.index, r.size_in_bytes, r.storage_data, files if i == 0 else ())
            for i, r in enumerate(results)
        ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(out)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The sidecar of checksums, then ``.metadata``, create-only: the commit."""
        files: dict[str, FileChecksums] = {}
        storage_data: dict[Any, Any] = {}
        for rank_results in results:
            for result in rank_results:
                storage_data[result.index] = result.storage_data
                files.update((f[0], f) for f in getattr(result, "files", ()))
        missing = sorted({info.relative_path for info in storage_data.values()} - files.keys())
        if missing:
            raise RuntimeError(f"{self.backend.uri}: no checksums arrived for the data files {missing[:5]}")
        version = getattr(dcp_filesystem, "CURRENT_DCP_VERSION", None)
        if version is not None:
            metadata.version = version
        metadata.storage_data = storage_data
        metadata.storage_meta = self.storage_meta()
        blob = pickle.dumps(metadata)
        sidecar = {
            "format": CHECKSUMS_FORMAT,
            "version": CHECKSUMS_VERSION,
            "metadata": {"size": len(blob), "crc32c": crc32c(blob)},
            "files": {
                name: {"size": size, "crc32c": crc, "segments": [list(s) for s in segments]}
                for name, size, crc, segments in sorted(files.values())
            },
        }
        backend = self.backend
        backend.write(CHECKSUMS_KEY, json.dumps(sidecar, separators=(",", ":")).encode())
        try:
            backend.write_if_absent(METADATA_KEY, blob)
        except ObjectExistsError as e:
            raise CheckpointExistsError(
                f"{backend.uri}: another save committed a DCP checkpoint here while this one was writing"
            ) from e
        log.info("committed DCP checkpoint %s (%d data files)", backend.uri, len(files))

    def storage_meta(self) -> StorageMeta | None:
        # the backend's URI: redacted, and without the query string's options
        return StorageMeta(checkpoint_id=self.backend.uri, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_bcp_uri(checkpoint_id)


# -- reading ---------------------------------------------------------------------------------


def narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The part of ``tensor`` a read item asks for (DCP reads whole chunks)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


class BcpStorageReader(StorageReader):
    """Reads a DCP checkpoint from ``uri`` (any bcp URI or local path) through bcp's
    backends. ``verify=True`` requires the checksums a :class:`BcpStorageWriter` wrote
    and checks every byte read against them; ``verify=False`` reads any DCP checkpoint
    (one DCP's own writer wrote, say) without them. ``allow_pickle=True`` unpickles
    ``.metadata`` without bcp's allow-list: only for checkpoints you trust."""

    def __init__(
        self,
        uri: str | os.PathLike[str],
        *,
        verify: bool = True,
        allow_pickle: bool = False,
        **storage_options: Any,
    ) -> None:
        super().__init__()
        self.verify = verify
        self.allow_pickle = allow_pickle
        self.storage_options = storage_options
        self.storage_data: dict[Any, Any] = {}
        self.files: dict[str, FileEntry] = {}
        self.sizes: dict[str, int] = {}  # data file -> its real size, from set_up_storage_reader
        self.load_id = str(uuid.uuid4())
        self._backend: Backend | None = None
        self.path = ""
        self._open(os.fspath(uri))

    def _open(self, uri: str) -> None:
        if self._backend is not None:
            self._backend.close()
        self.path = uri
        self._backend = backend_for(uri, **self.storage_options)

    @property
    def backend(self) -> Backend:
        assert self._backend is not None  # set in __init__
        return self._backend

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data, self.files, self.sizes = {}, {}, {}
        if checkpoint_id:
            self._open(os.fspath(checkpoint_id))
        self.load_id = str(uuid.uuid4())

    def _where(self, key: str) -> str:
        return join_uri(self.backend.uri, key)

    # No **kwargs: DCP's load falls back to per-rank metadata (read_metadata(rank=r))
    # only for readers that take keyword arguments, and then reports both failures;
    # bcp writes no per-rank metadata, so the error of the one read is the whole story.
    def read_metadata(self, *args: Any) -> Metadata:
        where = self._where(METADATA_KEY)
        try:
            blob = self.backend.read(METADATA_KEY)
        except ObjectNotFoundError as e:
            raise CheckpointNotFoundError(
                f"{where} does not exist: no complete DCP checkpoint here (a save that did not finish leaves none)"
            ) from e
        if self.verify:
            (size, crc), self.files = self._read_checksums()
            if len(blob) != size or crc32c(blob) != crc:
                raise CorruptCheckpointError(
                    f"{where}: {len(blob)} bytes with CRC32C {crc32c(blob):08x}, "
                    f"but {CHECKSUMS_KEY} records {size} bytes with {crc:08x}",
                    file=METADATA_KEY,
                )
        metadata = parse_metadata(io.BytesIO(blob), where=where, allow_pickle=self.allow_pickle)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _read_checksums(self) -> tuple[tuple[int, int], dict[str, FileEntry]]:
        where = self._where(CHECKSUMS_KEY)
        try:
            raw = self.backend.read(CHECKSUMS_KEY)
        except ObjectNotFoundError as e:
            raise CorruptCheckpointError(
                f"{where} does not exist: this DCP checkpoint was not written by BcpStorageWriter; "
                "pass BcpStorageReader(..., verify=False) to read it without checksums",
                file=CHECKSUMS_KEY,
            ) from e
        return parse_checksums(raw, where)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Every item's place checked against its file's real size (and, verifying,
        that size against the sidecar's) before anything is allocated or read."""
        self.sizes = check_storage(metadata, size_of=self.backend.size, where=self._where)
        if self.verify:
            for name, size in self.sizes.items():
                entry = self.files.get(name)
                if entry is None:
                    raise CorruptCheckpointError(f"{self._where(name)}: not in {CHECKSUMS_KEY}", file=name)
                if entry.size != size:
                    raise CorruptCheckpointError(
                        f"{self._where(name)}: {size} bytes, but {CHECKSUMS_KEY} records {entry.size}", file=name
                    )
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in sorted(plan.items, key=lambda i: self._location(i.storage_index)):
            name, offset, length = self._location(item.storage_index)
            data = self._read(name, offset, length)
            where = f"{self._where(name)}: bytes {offset}..{offset + length} ({item.storage_index.fqn!r})"
            check_archive(io.BytesIO(data), where=where)  # torch's loader would inflate a zip bomb
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(data))
                continue
            try:
                tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as e:  # not torch.save's bytes of a tensor
                raise FormatError(
                    f"{self._where(name)}: bytes {offset}..{offset + length} of {item.storage_index.fqn!r} are not a "
                    f"saved tensor: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                ) from e
            if not isinstance(tensor, torch.Tensor):
                raise FormatError(
                    f"{self._where(name)}: bytes {offset}..{offset + length} of {item.storage_index.fqn!r} hold a "
                    f"{type(tensor).__name__}, not a tensor"
                )
            tensor = narrow(tensor, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != tensor.size():
                raise FormatError(
                    f"{self._where(name)}: {item.storage_index.fqn!r} holds {tuple(tensor.size())} "
                    f"where the plan expects {tuple(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _location(self, index: Any) -> tuple[str, int, int]:
        info = self.storage_data.get(index)
        if info is None:
            raise FormatError(f"{self._where(METADATA_KEY)}: no storage_data for {index.fqn!r} at {index.offset}")
        return info.relative_path, info.offset, info.length  # types and transforms checked by check_storage

    def _read_exact(self, name: str, offset: int, buffer: memoryview) -> None:
        try:
            self.backend.read_exact(name, offset, buffer)
        except EOFError as e:  # it shrank since set_up_storage_reader measured it
            raise CorruptCheckpointError(
                f"{self._where(name)}: ended before byte {offset + len(buffer)} (reading {len(buffer)} bytes "
                f"from offset {offset}): the file is truncated",
                file=name,
                offset=offset,
            ) from e

    def _read(self, name: str, offset: int, length: int) -> bytes | memoryview:
        """``length`` bytes of ``name`` from ``offset``, each checked against the
        segment checksums that cover it (verify) or as stored; within the file's real
        size (checked in set_up_storage_reader), so never allocated past it."""
        size = self.sizes.get(name)
        if size is None or offset + length > size:  # a plan set_up_storage_reader did not see
            raise CorruptCheckpointError(
                f"{self._where(name)}: bytes {offset}..{offset + length} are past its end ({size} bytes)",
                file=name,
                offset=offset,
            )
        if not self.verify:
            buffer = bytearray(length)
            self._read_exact(name, offset, memoryview(buffer))
            return memoryview(buffer)
        entry = self.files.get(name)
        if entry is None:
            raise CorruptCheckpointError(f"{self._where(name)}: not in {CHECKSUMS_KEY}", file=name)
        first = bisect.bisect_right(entry.starts, offset) - 1
        last = first
        while 0 <= last < len(entry.segments) and sum(entry.segments[last][:2]) < offset + length:
            last += 1
        covered = first >= 0 and last < len(entry.segments)
        if covered:
            runs = entry.segments[first : last + 1]
            covered = all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(runs))
        if not covered:
            raise CorruptCheckpointError(
                f"{self._where(name)}: bytes {offset}..{offset + length} are not covered by its checksums",
                file=name,
                offset=offset,
            )
        start = entry.segments[first][0]
        end = sum(entry.segments[last][:2])
        buffer = bytearray(end - start)  # segments lie inside entry.size, the file's real size
        view = memoryview(buffer)
        self._read_exact(name, start, view)
        for seg_offset, seg_length, expected in entry.segments[first : last + 1]:
            got = crc32c(view[seg_offset - start : seg_offset - start + seg_length])
            if got != expected:
                raise CorruptCheckpointError(
                    f"{self._where(name)}: bytes {seg_offset}..{seg_offset + seg_length} have CRC32C {got:08x}, "
                    f"{CHECKSUMS_KEY} records {expected:08x}: the file is corrupt",
                    file=name,
                    offset=seg_offset,
                )
        return view[offset - start : offset - start + length]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_bcp_uri(checkpoint_id)
