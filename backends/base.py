"""The storage backend interface.

A backend stores opaque objects under string keys relative to a root URI, with the
smallest set of semantics that local filesystems, object stores and distributed
filesystems all share (docs/writing-a-backend.md). It knows nothing of tensors
or checkpoints.

Notes for implementers
----------------------
* Subclass :class:`Backend` and implement every abstract method; a backend that
  misses one fails when it is constructed, not at the first call.
* Keys are ``/``-separated relative paths: no leading ``/``, no empty, ``.`` or
  ``..`` components. Unicode is allowed. :func:`check_key` enforces this; call it.
* Raise :class:`~bcp.backends.storage_errors.ObjectNotFoundError` (a ``FileNotFoundError``)
  for a missing object, and wrap every other failure once in
  :class:`~bcp.backends.storage_errors.StorageError` (``errors.annotate`` does both).
* Declare what the store can do in ``capabilities``; the engine picks its commit
  protocol from it and the conformance suite picks what to test.
* Writers subclass :class:`ObjectWriter` and implement its hooks (``_write_at``,
  ``_commit``, ``_abort``); the public methods keep the lifecycle, once for all.
* Everything not abstract has a default built on the abstract methods; override it
  only to make it faster.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import enum
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Self

from bcp.backends.retry import is_transient
from bcp.backends.storage_errors import ObjectExistsError, StorageError, WriterClosedError, redact_uri

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview


class Capability(enum.Flag):
    """What a store guarantees beyond the base contract, and (``NON_ATOMIC_REPLACE``)
    the one guarantee of the base contract a store may declare that it lacks.

    That one is negative so that a backend which declares nothing keeps the full
    contract (and the commit path and conformance checks that go with it)."""

    NONE = 0
    #: ``write_if_absent`` is atomic: of writers racing for one key exactly one wins
    #: (O_EXCL/link locally, ``If-None-Match: *`` on S3, ``ifGenerationMatch=0`` on GCS).
    CREATE_ONLY = enum.auto()
    #: ``read_into`` at an offset costs about the bytes read, not the whole object.
    RANGED_READ = enum.auto()
    #: ``ObjectWriter.write_at`` may be called from several threads at once.
    PARALLEL_WRITES = enum.auto()
    #: Objects are files on a local or mounted POSIX filesystem (rename is atomic).
    POSIX = enum.auto()
    #: Replacing an existing object is *not* atomic for readers: while a commit replaces
    #: it, a reader may find the key missing (the store deletes the old object first:
    #: WebDAV's MOVE, per RFC 4918; HDFS's rename). Readers still never see a mix of the
    #: old and new bytes, and a write to a key that does not exist is still atomic. bcp
    #: then commits an overwrite by deleting the old manifest and creating the new one
    #: (``bcp.commit``), and the conformance suite checks this weaker guarantee instead.
    NON_ATOMIC_REPLACE = enum.auto()


#: :attr:`IOHints.read_gap_bytes` of the network stores (S3, GCS, fsspec, HDFS): a ranged
#: GET's fixed cost (tens of milliseconds to the first byte) is about what moving 1 MiB
#: more on one stream costs, so skipping a smaller gap saves nothing.
REQUEST_GAP_BYTES = 1 << 20
#: ... and of local files: a ``pread`` from the page cache costs a few microseconds,
#: about what copying 16 KiB more costs, and a smaller gap mostly lies in pages read anyway.
FILE_GAP_BYTES = 16 << 10


@dataclasses.dataclass(frozen=True, kw_only=True)
class IOHints:
    """How to drive a backend fast. Advice, not contract, except ``part_size``."""

    #: When set, every ``write_at`` except the one that ends the object must start at a
    #: multiple of ``part_size`` and be a multiple of it long (object-store multipart
    #: uploads need this). ``None``: any non-overlapping ranges.
    part_size: int | None = None
    #: Concurrent streams worth using per process.
    concurrency: int = 4
    #: Writes from page-aligned memory in multiples of 4096 bytes are faster (O_DIRECT):
    #: writers should stage unaligned buffers rather than hand them over directly.
    aligned_writes: bool = False
    #: A gap of fewer than this many bytes between two byte ranges one load needs from an
    #: object is read through (one request) rather than skipped (two requests): about the
    #: bytes a stream moves in the time one request's fixed cost takes. 0: never.
    read_gap_bytes: int = 0


class _State(enum.Enum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"


class ObjectWriter(abc.ABC):
    """Writes one object, possibly in parts, and makes it visible atomically.

    Call order: ``write_at`` any number of times (ranges must not overlap and must
    cover ``[0, size)`` with no gaps), then ``commit`` or ``abort``. Until ``commit``
    returns, readers see the previous object under the key, or none.

    This class owns the lifecycle, so that every writer keeps it the same way: a writer
    is *open*, then *committed* or *aborted* (docs/writing-a-backend.md, "The writer
    lifecycle"). ``write_at`` and ``commit`` on a finished writer raise
    :class:`~bcp.backends.storage_errors.WriterClosedError`; ``abort`` is idempotent and does
    nothing once committed; a failed commit aborts the writer (see ``retryable_commit``);
    leaving a ``with`` block with the writer still open aborts it. Subclasses implement
    the hooks ``_write_at``, ``_commit`` and ``_abort`` and call ``super().__init__``.

    Attributes every writer has (``super().__init__(uri, key)`` sets the first two;
    wrappers such as the retry loop and the conformance suite read them):

    * ``uri`` (str): the root URI of the store, as its backend shows it (redacted).
    * ``key`` (str): the key being written, exactly as passed to ``open_writer``.
    * ``idempotent_commit`` (bool, class attribute, default False): see below.
    * ``retryable_commit`` (bool, class attribute, default False): see below.
    """

    #: The root URI of the store (``Backend.uri``), for error messages and wrappers.
    #: The conformance suite requires the real value (``super().__init__`` sets it).
    uri: str = ""
    #: The key being written, exactly as passed to ``Backend.open_writer``.
    key: str = ""
    #: A ``commit`` after a successful one returns at once instead of raising. Network
    #: writers set it: a retry loop repeats a commit whose answer was lost.
    idempotent_commit: bool = False
    #: A ``_commit`` that fails with a transient error (:func:`~bcp.backends.retry.is_transient`)
    #: leaves the writer open, so a retry loop can call ``commit`` again; any other
    #: failure aborts it. For writers whose ``_commit`` can simply run again.
    retryable_commit: bool = False

    _state: _State
    _lifecycle: threading.RLock
    #: the commit's error that aborted the writer, named by later calls
    _failure: BaseException | None

    def __new__(cls, *args: object, **kwargs: object) -> Self:
        # Here, not in __init__: the lifecycle holds even for a writer that forgets super().__init__.
        self = super().__new__(cls)
        self._state = _State.OPEN
        self._lifecycle = threading.RLock()  # re-entrant: a failed commit aborts under it
        self._failure = None
        return self

    def __init__(self, uri: str, key: str) -> None:
        self.uri, self.key = uri, key

    # -- the lifecycle ------------------------------------------------------------------

    def write_at(self, offset: int, data: Buffer) -> None:
        """Write ``data`` at ``offset`` of the new object. Not serialized with other
        writes: with ``PARALLEL_WRITES``, several threads call it at once."""
        if self._state is not _State.OPEN:
            raise self._closed("writing")
        self._write_at(offset, data)

    def commit(self) -> None:
        """Make the object durable and visible, replacing any object under the key.
        After an exception here nothing new is visible (the old object, if any, stays;
        with ``Capability.NON_ATOMIC_REPLACE`` it may be gone), unless the commit took
        effect and only its answer was lost."""
        with self._lifecycle:
            if self._state is _State.COMMITTED and self.idempotent_commit:
                return  # a retried commit whose first answer was lost
            if self._state is not _State.OPEN:
                raise self._closed("committing")
            try:
                self._commit()
            except BaseException as e:
                retry = self.retryable_commit and is_transient(e)
                if self._state is _State.OPEN and not retry:
                    self._failure = e
                    self.abort_after_failure()
                raise
            if self._state is _State.OPEN:
                self._state = _State.COMMITTED

    def abort(self) -> None:
        """Discard everything written. Idempotent; does nothing after a commit."""
        with self._lifecycle:
            if self._state is _State.OPEN:
                self._state = _State.ABORTED
                self._abort()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Abort a writer the block left open, whether it raised or never committed."""
        if self._state is _State.OPEN:
            self.abort()

    def abort_after_failure(self) -> None:
        """Abort because something failed (a commit, a save), logging rather than
        raising a cleanup failure, so that the failure's own error is the one that
        propagates."""
        try:
            self.abort()
        except Exception as e:  # noqa: BLE001 - logged, so the failure's own error propagates
            log.warning("could not clean up %r in %s after a failure: %s", self.key, self.uri, e)

    def _closed(self, action: str) -> WriterClosedError:
        """Raised unchained, so a retry loop stops at it; its message names the failed
        commit that aborted the writer (a retried commit otherwise hid the real error)."""
        e = self._failure  # a StorageError's reason: its message less the key this one names again
        why = "" if e is None else e.reason if isinstance(e, StorageError) else f"{type(e).__name__}: {e}"
        after = f" after its commit failed ({why})" if e is not None else ""
        return WriterClosedError(
            f"the writer was already {self._state.value}{after}", uri=self.uri, key=self.key, action=action
        )

    # -- hooks for subclasses -----------------------------------------------------------

    @abc.abstractmethod
    def _write_at(self, offset: int, data: Buffer) -> None:
        """Write ``data`` at ``offset``; called only while open. Must not keep a
        reference to ``data`` after returning (the caller reuses its buffers)."""

    @abc.abstractmethod
    def _commit(self) -> None:
        """Make the object durable and visible; called only while open. Raise to fail:
        nothing new may be visible then (unless only the answer was lost). The writer is
        then aborted, or, with ``retryable_commit`` and a transient error, left open."""

    @abc.abstractmethod
    def _abort(self) -> None:
        """Discard everything written. Called at most once, never after a successful
        commit; must not raise for a part that is missing."""


@dataclasses.dataclass(frozen=True)
class Unfinished:
    """A write that was never committed or aborted, as a store reports it."""

    #: the store's name for it (a partial file's path, relative to the root)
    name: str
    #: seconds since it was last written to
    age_seconds: float


class Backend(abc.ABC):
    """A store rooted at a URI. Thread-safe: one instance serves many threads.

    Not guaranteed by the contract: the order of ``list``; atomicity of anything
    spanning several keys (``delete_prefix`` may stop halfway); read-after-write
    visibility across processes before ``commit`` returns; a key that is also a
    prefix directory of other keys (``p`` and ``p/q``: filesystems cannot hold both,
    and bcp never creates such pairs).
    """

    # scheme, capabilities and network are set per class, and read from the class by the
    # registry; an instance may shadow them with its own value (wrappers report what they
    # wrap, a store without conditional writes drops CREATE_ONLY), so they are not ClassVars.

    #: URI scheme this class serves by default ("file", "memory", "s3", ...).
    scheme: str
    capabilities: Capability = Capability.NONE
    #: A network store: :func:`~bcp.backends.backend_for` wraps it in a
    #: :class:`~bcp.backends.wrappers.RetryingBackend` built from the ``retries``,
    #: ``retry_base_delay``, ``retry_max_delay`` and ``retry_deadline`` options.
    network: bool = False
    #: Names of the options that carry credentials (S3: key, secret, token, ...). They
    #: are accepted from ``storage_options`` only: :func:`~bcp.backends.backend_for`
    #: refuses a URI whose query or ``user:password@`` carries them. Empty: the
    #: backend takes no credentials as options (its URIs are shown redacted).
    credential_options: frozenset[str] = frozenset()

    def __init__(self, uri: str) -> None:
        #: The root as shown (errors, logs, SaveInfo): credentials in it are redacted.
        #: A backend connects with what ``from_uri`` parsed from the real URI.
        self.uri = redact_uri(uri)

    @classmethod
    @abc.abstractmethod
    def from_uri(cls, uri: str, **options: str) -> Self:
        """Build a backend rooted at ``uri`` (query string already removed). Options
        come from the URI query (strings) and keyword arguments (any type); reject
        unknown ones with TypeError naming them, without echoing values. Credentials
        are accepted from ``storage_options`` only: declare their names in
        ``credential_options`` so that a URI carrying them is refused."""

    @property
    def hints(self) -> IOHints:
        return IOHints()

    # -- the contract ------------------------------------------------------------------

    @abc.abstractmethod
    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        """Start writing ``key``. ``size``, when given, is the final size: a hint to
        preallocate. Nothing is visible until the writer commits."""

    @abc.abstractmethod
    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        """Read up to ``len(buffer)`` bytes of ``key`` starting at ``offset`` into
        ``buffer``; return how many were read (fewer only at the end of the object,
        0 at or past it). Missing key: ObjectNotFoundError."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes of ``key``. Missing key: ObjectNotFoundError."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Every committed key that starts with ``prefix`` (a plain string prefix, not
        a directory), in no particular order. Unfinished writes are never listed."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``. Deleting a missing key is not an error."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` is a committed object."""

    # -- unfinished writes; override where the store can leave them ---------------------

    def unfinished(self, prefix: str = "") -> Iterator[Unfinished]:
        """Writes under ``prefix`` that were never committed or aborted (a process
        killed mid-write left them), which ``list`` hides: partial files on a
        filesystem. Housekeeping deletes the old ones. The default: none."""
        return iter(())

    def delete_unfinished(self, name: str) -> None:  # noqa: B027 - optional hook, paired with unfinished()
        """Remove one unfinished write that :meth:`unfinished` reported."""

    # -- derived; override for speed -------------------------------------------------

    def write(self, key: str, data: Buffer) -> None:
        """Write a whole object atomically (replacing any old one)."""
        with self.open_writer(key, size=len(data)) as writer:
            if len(data):
                writer.write_at(0, data)
            writer.commit()

    def write_if_absent(self, key: str, data: Buffer) -> None:
        """Create ``key`` only if it does not exist; else ObjectExistsError.

        Note for implementers: this default checks, then writes, so two racing writers
        can both succeed. Stores that can do better override it and declare
        ``Capability.CREATE_ONLY``; the engine relies on that flag, not on this method.
        """
        if self.exists(key):
            raise ObjectExistsError("object already exists", uri=self.uri, key=key, action="creating")
        self.write(key, data)

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Read ``length`` bytes from ``offset`` (to the end when None) as bytes."""
        if length is None:
            length = max(self.size(key) - offset, 0)
        buf = bytearray(length)
        view = memoryview(buf)
        got = 0
        while got < length:
            n = self.read_into(key, offset + got, view[got:])
            if n == 0:
                break
            got += n
        return bytes(view[:got])

    def read_exact(self, key: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` entirely from ``offset``; EOFError naming key and offset if the
        object ends first."""
        got = 0
        while got < len(buffer):
            n = self.read_into(key, offset + got, buffer[got:])
            if n == 0:
                raise EOFError(
                    f"{key!r} in {self.uri} ended at byte {offset + got}; "
                    f"expected {len(buffer)} bytes from offset {offset}"
                )
            got += n

    @contextlib.contextmanager
    def reading(self, key: str) -> Iterator[Callable[[int, memoryview], None]]:
        """``read(offset, buffer)``, filling ``buffer`` from ``offset`` of ``key`` as
        :meth:`read_exact` does, for many reads of one object in a row: a backend may keep
        the object open between them (the file backend does: a load from memory reads a
        fragment in 2 MiB pieces). Default: :meth:`read_exact` each time. The reader may
        also have an optional ``read_into_many(offset, buffers)``: see :func:`read_into_many`."""
        yield functools.partial(self.read_exact, key)

    def in_memory(self, key: str, offset: int, nbytes: int) -> bool:
        """Whether reading ``nbytes`` of ``key`` from ``offset`` copies bytes already in
        this machine's memory (the page cache, tmpfs) instead of fetching them from
        storage. Advice for readers, never an error: such a range is read in small
        pieces, each checksummed while it is still in the CPU cache. Default: False."""
        return False

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix``. Not atomic: a failure may stop halfway."""
        for key in list(self.list(prefix)):
            self.delete(key)

    def close(self) -> None:  # noqa: B027 - optional hook: most backends hold nothing to release
        """Release connections or handles. The default holds none."""

    def unwrap(self) -> Backend:
        """The backend that talks to the store (wrappers such as the retry loop
        return what they wrap)."""
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


def read_into_many(read: Callable[[int, memoryview], None], offset: int, buffers: Sequence[memoryview]) -> None:
    """Fill ``buffers`` (byte views) with consecutive bytes of the object from ``offset``,
    through a reader that :meth:`Backend.reading` yielded: its optional
    ``read_into_many(offset, buffers)`` where it has one (the file backend: one
    ``preadv`` for many small tensors, about half the CPU of one read each), else one
    ``read`` per buffer, so a backend needs nothing to support it. Errors as ``read``'s."""
    many = getattr(read, "read_into_many", None)
    if many is not None:
        many(offset, buffers)
        return
    for buffer in buffers:
        read(offset, buffer)
        offset += buffer.nbytes


def check_key(key: str) -> str:
    """Validate an object key (see module notes); return it unchanged."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid object key {key!r}: must be a non-empty string")
    parts = key.split("/")
    if key.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in key or "\0" in key:
        raise ValueError(
            f"invalid object key {key!r}: use '/'-separated relative names without "
            "empty, '.' or '..' parts, backslashes or NUL"
        )
    return key
