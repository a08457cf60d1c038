"""Errors of the checkpoint engine. Storage errors come from bcp.backends, format
errors from bcp.metadata; all are re-exported here so users import from one place."""

from __future__ import annotations

from bcp.backends.errors import ObjectExistsError, ObjectNotFoundError, StorageError
from bcp.metadata.errors import FormatError


class CheckpointError(Exception):
    """Base of the engine's errors."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """Nothing is stored at the URI."""


class IncompleteCheckpointError(CheckpointError):
    """Files exist at the URI but no manifest: a save started and never committed."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint is already at the URI and overwrite was not asked for."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes do not match their checksum or size. Names tensor, file and offset."""

    def __init__(self, message: str, *, fqn: str | None = None, file: str | None = None, offset: int | None = None):
        super().__init__(message)
        self.fqn, self.file, self.offset = fqn, file, offset


class UnsupportedStateError(CheckpointError, TypeError):
    """A value in the state cannot be saved safely (names the key)."""


class StateMismatchError(CheckpointError, ValueError):
    """The state passed to load does not match the checkpoint. Lists every difference."""

    def __init__(
        self,
        uri: str,
        *,
        missing: list[str],
        unexpected: list[str],
        shape_mismatch: list[tuple[str, tuple, tuple]],
        dtype_mismatch: list[tuple[str, str, str]],
        kind_mismatch: list[tuple[str, str, str]],
    ) -> None:
        self.missing, self.unexpected = missing, unexpected
        self.shape_mismatch, self.dtype_mismatch, self.kind_mismatch = shape_mismatch, dtype_mismatch, kind_mismatch
        lines = [f"checkpoint {uri} does not match the state given to load:"]
        if missing:
            lines.append(f"  missing keys (in the state, not in the checkpoint): {', '.join(missing)}")
        if unexpected:
            lines.append(f"  unexpected keys (in the checkpoint, not in the state): {', '.join(unexpected)}")
        for fqn, want, got in shape_mismatch:
            lines.append(f"  shape mismatch for {fqn}: state {list(want)}, checkpoint {list(got)}")
        for fqn, want, got in dtype_mismatch:
            lines.append(f"  dtype mismatch for {fqn}: state {want}, checkpoint {got}")
        for fqn, want, got in kind_mismatch:
            lines.append(f"  kind mismatch for {fqn}: state has {want}, checkpoint has {got}")
        super().__init__("\n".join(lines))

    def __bool__(self) -> bool:
        return True


__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "FormatError",
    "IncompleteCheckpointError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "StateMismatchError",
    "StorageError",
    "UnsupportedStateError",
]
