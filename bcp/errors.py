"""Every error bcp raises, importable from one place (docs/errors.md has the tree).

Two roots: :class:`CheckpointError` for anything about a checkpoint or a state
(defined in ``bcp.metadata.format_errors`` so the format layer can raise one), and
:class:`StorageError`, an ``OSError``, for the store underneath (defined in
``bcp.backends.storage_errors``). Every error here pickles with its type and fields, so a
rank's failure reaches the other ranks intact (``bcp.coordination.collectives``).
"""

from __future__ import annotations

from typing import Any

from bcp.backends.storage_errors import (
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    TransientError,
    WriterClosedError,
)
from bcp.metadata.format_errors import CheckpointError, CorruptManifestError, FormatError


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """Nothing is stored at the URI."""


class IncompleteCheckpointError(CheckpointError):
    """Files exist at the URI but no manifest. The message says what they are: a save
    that started and never committed, a CheckpointManager root (naming its newest
    committed step), checkpoints further down, or files that are none of bcp's."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint is already at the URI and overwrite was not asked for."""


class CommitUncertainError(CheckpointError):
    """Writing the manifest failed in a way that leaves unknown whether it landed (the
    store lost every answer and cannot be read back). The save's data is kept: it may
    be a committed checkpoint. Load it to find out, or save again with overwrite=True."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes do not match their checksum or size. Names tensor, file and offset."""

    def __init__(self, message: str, *, fqn: str | None = None, file: str | None = None, offset: int | None = None):
        super().__init__(message)
        self.fqn, self.file, self.offset = fqn, file, offset


class UnsupportedStateError(CheckpointError, TypeError):
    """A value in the state cannot be saved safely (names the key)."""


class PickleNotAllowedError(UnsupportedStateError):
    """A stored object is a pickle and the caller did not pass ``allow_pickle=True``.

    Unpickling runs code chosen by whoever wrote the checkpoint, so it needs the
    caller's explicit consent. ``fqn`` names the object."""

    def __init__(self, message: str, *, fqn: str | None = None) -> None:
        super().__init__(message)
        self.fqn = fqn


class ShardingError(UnsupportedStateError):
    """Ranks disagree about a tensor, or its shards do not tile it exactly."""


class ReplicaMismatchError(ShardingError):
    """Ranks hold different values of a tensor that is stored once (a plain tensor, or a
    DTensor replicated over a mesh dimension), so the save is refused before anything
    is written. ``differing`` maps each key to {a rank: the ranks whose copy differs
    from that rank's}."""

    def __init__(self, message: str, *, differing: dict[str, dict[int, list[int]]] | None = None) -> None:
        super().__init__(message)
        self.differing = dict(differing or {})


class RankFailedError(CheckpointError):
    """Another rank failed during a collective checkpoint operation.

    ``errors`` maps each failed rank to its error, with its own type and fields
    (or a RankFailedError holding its message, when it could not be sent)."""

    def __init__(self, message: str, *, errors: dict[int, BaseException] | None = None) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})


class GroupConnectError(CheckpointError):
    """The ranks could not connect bcp's gloo group (a network setting, usually
    ``GLOO_SOCKET_IFNAME``). ``rank`` is the rank that raised it, ``address`` the
    address its gloo group listens on."""

    def __init__(self, message: str, *, rank: int | None = None, address: str | None = None) -> None:
        super().__init__(message)
        self.rank, self.address = rank, address


class RanksMissingError(CheckpointError, TimeoutError):
    """A collective save or load was not called by every rank of its process group
    within ``BCP_RENDEZVOUS_TIMEOUT``. ``missing`` holds the global ranks known not to
    have arrived (the first of them only, at a job's first operation, when the group
    was being created; empty when this rank cannot tell), ``operation`` the call."""

    def __init__(self, message: str, *, missing: list[int] | None = None, operation: str = "") -> None:
        super().__init__(message)
        self.missing = list(missing or [])
        self.operation = operation


class ProcessGroupMissingError(CheckpointError, RuntimeError):
    """The process was started as one of several processes of a job (a launcher set
    ``WORLD_SIZE``, ``RANK``, ``SLURM_PROCID``, ...) but ``torch.distributed`` is not
    initialised: every process would save or load alone, racing the others at one
    location. ``variable`` is the environment variable that says so (``NAME=value``),
    ``operation`` the call."""

    def __init__(self, message: str, *, variable: str = "", operation: str = "") -> None:
        super().__init__(message)
        self.variable = variable
        self.operation = operation


#: keys a message names per kind of difference before it says "and N more"
LISTED_KEYS = 8


def listed(keys: list[str] | tuple[str, ...], limit: int = LISTED_KEYS) -> str:
    """At most ``limit`` keys, then how many more: a message stays readable at 10,000 keys."""
    more = f", ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


class ConversionError(CheckpointError):
    """Another format's library failed while bcp converted to or from it: PyTorch DCP
    raises ``CheckpointException``, a ``BaseException`` that ``except Exception``
    does not catch, with a multi-line traceback as its message. This carries one line
    naming the path and the first failure; ``errors`` maps each failed rank to its
    error as that library reported it."""

    def __init__(self, message: str, *, errors: dict[int, BaseException] | None = None) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})


class StateMismatchError(CheckpointError, ValueError):
    """The state passed to load does not match the checkpoint. Counts every kind of
    difference and names the first keys of each (the fields hold them all)."""

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
        self.uri = uri
        self.missing, self.unexpected = missing, unexpected
        self.shape_mismatch, self.dtype_mismatch, self.kind_mismatch = shape_mismatch, dtype_mismatch, kind_mismatch
        counts = (
            f"{len(missing)} missing, {len(unexpected)} unexpected, {len(shape_mismatch)} shape, "
            f"{len(dtype_mismatch)} dtype, {len(kind_mismatch)} kind mismatches"
        )
        lines = [f"checkpoint {uri} does not match the state given to load ({counts}):"]
        kinds = (
            ("missing keys (in the state, not in the checkpoint)", missing),
            ("unexpected keys (in the checkpoint, not in the state)", unexpected),
            ("shape mismatch (state, checkpoint)", [f"{f} ({list(w)}, {list(g)})" for f, w, g in shape_mismatch]),
            ("dtype mismatch (state, checkpoint)", [f"{f} ({w}, {g})" for f, w, g in dtype_mismatch]),
            ("kind mismatch (state, checkpoint)", [f"{f} ({w}, {g})" for f, w, g in kind_mismatch]),
        )
        lines += [f"  {what}: {listed(keys)}" for what, keys in kinds if keys]
        self.hint = prefix_hint(missing, unexpected)
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        super().__init__("\n".join(lines))

    def __bool__(self) -> bool:
        return True

    def __reduce__(self) -> tuple[Any, ...]:
        # keyword-only fields: rebuilt from them, not from the message; the instance
        # dict (notes, attributes added later) is restored as the pickle's state
        fields = (self.uri, self.missing, self.unexpected, self.shape_mismatch, self.dtype_mismatch, self.kind_mismatch)
        return (_rebuild_mismatch, fields, dict(vars(self)))


#: how many unexpected keys :func:`prefix_hint` tries as a match for the first missing key
_HINT_CANDIDATES = 64


def prefix_hint(missing: list[str] | tuple[str, ...], unexpected: list[str] | tuple[str, ...]) -> str | None:
    """A one-line fix when the missing keys are the unexpected ones with whole dotted
    components added or removed at one place (a model wrapped by DDP as ``module.``,
    compiled as ``_orig_mod.``, or saved unwrapped): None when no such swap explains at
    least half of them. A component replaced by another (``model.extra.`` where the
    checkpoint has ``model.2.``) is another model, not another wrapping: no hint.

    The swap is read off the first missing key and a stored key ending the same way
    (the longest common dotted suffix), then checked against every missing key."""
    if not missing or not unexpected:
        return None
    stored = set(unexpected)
    first = missing[0].split(".")
    candidates = [u for u in unexpected if u.split(".")[-1] == first[-1]][:_HINT_CANDIDATES]
    best: tuple[int, str, str] | None = None
    for other in candidates:
        state_prefix, stored_prefix = _prefixes(first, other.split("."))
        if not _wrapping(state_prefix.split(".")[:-1], stored_prefix.split(".")[:-1]):
            continue
        explained = sum(
            1 for m in missing if m.startswith(state_prefix) and stored_prefix + m[len(state_prefix) :] in stored
        )
        if best is None or explained > best[0]:
            best = (explained, state_prefix, stored_prefix)
    if best is None or best[0] * 2 < len(missing):
        return None
    explained, state_prefix, stored_prefix = best
    return (
        f"{explained} of {len(missing)} missing keys are stored under another prefix: the state has "
        f"{state_prefix or '(no prefix)'!r}... where the checkpoint has {stored_prefix or '(no prefix)'!r}...; "
        f"build the state from the same wrapping as the save (e.g. the unwrapped model: model.module for DDP, "
        f"model._orig_mod for torch.compile) or rename the keys"
    )


def _wrapping(a: list[str], b: list[str]) -> bool:
    """Whether one component list is the other with one run of components inserted
    (what wrapping a module does to its keys)."""
    short, long = (a, b) if len(a) < len(b) else (b, a)
    if len(short) == len(long):
        return False
    head = 0
    while head < len(short) and short[head] == long[head]:
        head += 1
    tail = len(short) - head
    return short[head:] == long[len(long) - tail :]


def _prefixes(state_key: list[str], stored_key: list[str]) -> tuple[str, str]:
    """The dotted prefixes (with their trailing '.') left when two keys' longest
    common dotted suffix is removed."""
    common = 0
    while common < min(len(state_key), len(stored_key)) and state_key[-1 - common] == stored_key[-1 - common]:
        common += 1
    head = state_key[: len(state_key) - common]
    other = stored_key[: len(stored_key) - common]
    return ("".join(k + "." for k in head), "".join(k + "." for k in other))


def _rebuild_mismatch(
    uri: str,
    missing: list[str],
    unexpected: list[str],
    shapes: list[tuple[str, tuple, tuple]],
    dtypes: list[tuple[str, str, str]],
    kinds: list[tuple[str, str, str]],
) -> StateMismatchError:
    return StateMismatchError(
        uri, missing=missing, unexpected=unexpected, shape_mismatch=shapes, dtype_mismatch=dtypes, kind_mismatch=kinds
    )


__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ConversionError",
    "CorruptCheckpointError",
    "CorruptManifestError",
    "FormatError",
    "GroupConnectError",
    "IncompleteCheckpointError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "PickleNotAllowedError",
    "ProcessGroupMissingError",
    "RankFailedError",
    "RanksMissingError",
    "ReplicaMismatchError",
    "ShardingError",
    "StateMismatchError",
    "StorageError",
    "TransientError",
    "UnsupportedStateError",
    "WriterClosedError",
]
