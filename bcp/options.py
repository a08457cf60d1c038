"""The options of a save and of a load, each as one typed value.

``bcp.save``, ``bcp.async_save`` and ``CheckpointManager.save`` take the same
:class:`SaveOptions`; ``bcp.load``, ``bcp.load_with_info`` and
``CheckpointManager.load_latest`` the same :class:`LoadOptions`. They are declared
once here, so a new option is added in one place and every call accepts it. Each
call takes ``options=...`` and/or the same names as keyword arguments (keywords
win). The ``...Kwargs`` TypedDicts give those keywords their types for type
checkers; a test keeps them equal to the dataclasses' fields.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal, TypedDict

from bcp.io_scheduler.staging import DEFAULT_SLAB_BYTES, StagingPool
from bcp.metadata import DEFAULT_BLOCK_BYTES
from bcp.metadata.manifest import MAX_CHECKSUM_BLOCK_BYTES
from bcp.trace import TraceOption

#: ``SaveOptions.check_replicas``: which replicated tensors a save compares across ranks
ReplicaCheck = Literal["small", "all", "off"]
REPLICA_CHECKS: tuple[str, ...] = ("small", "all", "off")


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """How to save. Every field has the default ``bcp.save`` uses."""

    #: replace a committed checkpoint at the URI (atomically) instead of refusing
    overwrite: bool = False
    #: user metadata stored in the manifest (JSON-serialisable)
    metadata: Mapping[str, Any] | None = None
    #: let objects without a safe encoding be pickled; loading them then needs it too
    allow_pickle: bool = False
    #: options for the backend the URI selects (credentials, endpoints, part sizes);
    #: left out of the repr: it may hold secrets
    storage_options: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)
    #: bytes per CRC32C block of the data files
    checksum_block_bytes: int = DEFAULT_BLOCK_BYTES
    #: the ranks that save together (default: the whole job; ``bcp.LOCAL``: this process alone)
    process_group: Any = None
    #: concurrent writes per rank (default: the backend's hint)
    streams: int | None = None
    #: staging memory (default: the process-wide pool, whose capacity is the budget)
    pool: StagingPool | None = None
    #: refuse the save when ranks hold different values of a tensor stored once (a
    #: plain tensor, a replicated DTensor): "small" checks those of at most 16 KiB
    #: (RNG states, counters, small buffers; about free), "all" every one (a CRC32C
    #: of every replicated byte on every rank), "off" none (docs/distributed.md)
    check_replicas: ReplicaCheck = "small"
    #: a directory to write this rank's timeline to (Chrome trace JSON; ``bcp trace``
    #: merges the ranks'), True: stage totals in ``SaveInfo.stages`` only; default:
    #: ``$BCP_TRACE_DIR`` when set (docs/observability.md)
    trace: TraceOption = None
    #: an earlier checkpoint beside this one (same parent URI, committed): write only the
    #: pieces whose bytes differ from it and refer to its stored bytes for the others
    #: (metadata/FORMAT.md, "References"); implies ``incremental``
    base: str | None = None
    #: cut fragments into pieces of whole rows and record each piece's XXH3-128 digest,
    #: so a later save can take this one as its base (a save without ``base`` writes every byte)
    incremental: bool = False
    #: the most bytes a piece of an incremental save holds (a larger row is one piece)
    piece_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        pieces: Any = self.piece_bytes  # typed int; callers pass what they have
        if isinstance(pieces, bool) or not isinstance(pieces, numbers.Integral):
            raise TypeError(f"piece_bytes must be an int, got {type(pieces).__name__}")
        if pieces < 1:
            raise ValueError(f"piece_bytes must be at least 1, got {pieces}")
        object.__setattr__(self, "piece_bytes", int(pieces))
        if self.base is not None and not isinstance(self.base, str):
            raise TypeError(f"base must be a URI string, got {type(self.base).__name__}")
        if self.check_replicas not in REPLICA_CHECKS:
            raise ValueError(
                f"check_replicas must be one of {', '.join(map(repr, REPLICA_CHECKS))}, got {self.check_replicas!r}"
            )
        given: Any = self.checksum_block_bytes  # typed int; callers pass what they have (numpy ints, bools)
        if isinstance(given, bool) or not isinstance(given, numbers.Integral):
            raise TypeError(f"checksum_block_bytes must be an int, got {type(given).__name__}")
        block = int(given)
        if not 0 < block <= MAX_CHECKSUM_BLOCK_BYTES:  # what readers accept (metadata/FORMAT.md)
            raise ValueError(
                f"checksum_block_bytes must be from 1 to {MAX_CHECKSUM_BLOCK_BYTES} (readers refuse larger blocks), "
                f"got {block}"
            )
        slab = self.pool.slab_bytes if self.pool is not None else DEFAULT_SLAB_BYTES  # the default pool's
        if slab % block:  # each staging slab is checksummed in whole blocks
            raise ValueError(
                f"checksum_block_bytes must divide the staging slab size, {slab} bytes (a power of two up to it, "
                f"for the default pool), got {block}"
            )
        object.__setattr__(self, "checksum_block_bytes", block)  # written to the manifest as a JSON integer
        if self.metadata is not None:
            # taken at the call: an async save commits it later, after the caller may
            # have changed the dict it passed
            object.__setattr__(self, "metadata", MappingProxyType(_snapshot(self.metadata)))

    @classmethod
    def of(cls, options: SaveOptions | None, overrides: Mapping[str, Any]) -> SaveOptions:
        """``options`` (or the defaults) with ``overrides`` applied; an unknown name is
        a TypeError that lists the known ones."""
        return _combine(cls, "save", options, overrides)

    @property
    def user_metadata(self) -> dict[str, Any]:
        return dict(self.metadata or {})

    @property
    def is_incremental(self) -> bool:
        """Whether the save cuts pieces and records digests (``incremental`` or a ``base``)."""
        return self.incremental or self.base is not None


class SaveOptionsKwargs(TypedDict, total=False):
    """:class:`SaveOptions` as keyword arguments (for type checkers)."""

    overwrite: bool
    metadata: Mapping[str, Any] | None
    allow_pickle: bool
    storage_options: Mapping[str, Any] | None
    checksum_block_bytes: int
    process_group: Any
    streams: int | None
    pool: StagingPool | None
    check_replicas: ReplicaCheck
    trace: TraceOption
    base: str | None
    incremental: bool
    piece_bytes: int


#: ``reshard_objects(fqn, values_by_saved_rank, rank, world_size) -> value for this rank``
ReshardObjects = Callable[[str, dict[int, Any], int, int], Any]


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How to load. Every field has the default ``bcp.load`` uses."""

    #: True: any missing or unexpected key, shape or dtype mismatch raises one error
    #: listing them all, before anything is read. False: keys on one side only are
    #: skipped (``LoadInfo`` lists them), dtypes are cast; shapes must still match.
    strict: bool = True
    #: let stored pickles be unpickled (runs code from the checkpoint)
    allow_pickle: bool = False
    #: options for the backend the URI selects (credentials too: left out of the repr)
    storage_options: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)
    #: the ranks that load together (default: the whole job; ``bcp.LOCAL``: this process alone)
    process_group: Any = None
    #: decides what each rank gets of objects saved per rank at another world size
    reshard_objects: ReshardObjects | None = None
    #: verify the CRC32C of every checksum block a read touches
    verify: bool = True
    #: read a fragment several ranks need once and send it to the others; default:
    #: on for object stores, off for POSIX filesystems (docs/distributed.md)
    share_reads: bool | None = None
    #: as SaveOptions.trace: a directory for this rank's timeline, True (``LoadInfo.stages`` only)
    trace: TraceOption = None

    @classmethod
    def of(cls, options: LoadOptions | None, overrides: Mapping[str, Any]) -> LoadOptions:
        """``options`` (or the defaults) with ``overrides`` applied."""
        return _combine(cls, "load", options, overrides)


class LoadOptionsKwargs(TypedDict, total=False):
    """:class:`LoadOptions` as keyword arguments (for type checkers)."""

    strict: bool
    allow_pickle: bool
    storage_options: Mapping[str, Any] | None
    process_group: Any
    reshard_objects: ReshardObjects | None
    verify: bool
    share_reads: bool | None
    trace: TraceOption


def _combine(cls: Any, what: str, options: Any, overrides: Mapping[str, Any]) -> Any:
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        known = ", ".join(f.name for f in dataclasses.fields(cls))
        raise TypeError(f"unknown {what} option(s) {', '.join(unknown)}; the options are: {known}")
    return dataclasses.replace(options or cls(), **overrides)


def _snapshot(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy where the values allow one (they should be JSON), else a shallow one."""
    try:
        return copy.deepcopy(dict(metadata))
    except Exception:  # noqa: BLE001 - not copyable: not JSON either, and the save will say so
        return dict(metadata)
