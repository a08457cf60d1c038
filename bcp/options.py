"""The options of a save, as one typed value shared by every way to save.

``bcp.save``, ``bcp.async_save`` and ``CheckpointManager.save`` take the same
options; they are declared once here, so a new one is added in one place and all
three accept it. Each call takes ``options=SaveOptions(...)`` and/or the same
names as keyword arguments (keywords win).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from bcp.metadata import DEFAULT_BLOCK_BYTES

from .io_scheduler.staging import StagingPool


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """How to save. Every field has the default ``bcp.save`` uses."""

    #: replace a committed checkpoint at the URI (atomically) instead of refusing
    overwrite: bool = False
    #: user metadata stored in the manifest (JSON-serialisable)
    metadata: Mapping[str, Any] | None = None
    #: let objects without a safe encoding be pickled; loading them then needs it too
    allow_pickle: bool = False
    #: options for the backend the URI selects (credentials, endpoints, part sizes)
    storage_options: Mapping[str, Any] | None = None
    #: bytes per CRC32C block of the data files
    checksum_block_bytes: int = DEFAULT_BLOCK_BYTES
    #: the ranks that save together (default: the whole job)
    process_group: Any = None
    #: concurrent writes per rank (default: the backend's hint)
    streams: int | None = None
    #: staging memory (default: the process-wide pool, whose capacity is the budget)
    pool: StagingPool | None = None

    def __post_init__(self) -> None:
        if self.checksum_block_bytes <= 0:
            raise ValueError(f"checksum_block_bytes must be > 0, got {self.checksum_block_bytes}")
        if self.streams is not None and self.streams < 1:
            raise ValueError(f"streams must be >= 1, got {self.streams}")

    @classmethod
    def of(cls, options: SaveOptions | None, overrides: Mapping[str, Any]) -> SaveOptions:
        """``options`` (or the defaults) with ``overrides`` applied; an unknown name is
        a TypeError that lists the known ones."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            known = ", ".join(f.name for f in dataclasses.fields(cls))
            raise TypeError(f"unknown save option(s) {', '.join(unknown)}; the options are: {known}")
        return dataclasses.replace(options or cls(), **overrides)

    @property
    def user_metadata(self) -> dict[str, Any]:
        return dict(self.metadata or {})
