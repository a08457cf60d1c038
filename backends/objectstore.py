"""What the object-store backends (S3, GCS) share, written once.

Both root a backend at ``scheme://bucket/prefix``; take the same core options
(``endpoint_url``, ``anon``, ``part_size``, ``concurrency``, ``conditional_writes``);
send a small object in one request and a larger one through a
:class:`~bcp.backends.parts.PartWriter`; read with ranged GETs through the fsspec
filesystem's ``cat_file``; list page by page; and fall back to check-then-write when
the store ignores conditional writes. :class:`ObjectStoreBackend` holds that logic;
each store implements the few requests that differ (the hooks below).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import errno
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

from bcp.backends.base import REQUEST_GAP_BYTES, Backend, Buffer, Capability, IOHints, ObjectWriter, check_key
from bcp.backends.parts import PartWriter
from bcp.backends.retry import is_transient
from bcp.backends.storage_errors import ObjectExistsError, ObjectNotFoundError, annotate, redact_uri
from bcp.backends.uri_options import as_bool, as_int, as_size, as_timeout, plain_root, refuse_uri_credentials


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """The options every object store takes, parsed."""

    endpoint_url: str | None
    anon: bool
    part_size: int
    concurrency: int
    conditional_writes: bool
    timeouts: Timeouts


#: Seconds a request may go without an answer or a byte of its answer before it is
#: abandoned and retried (option ``timeout``; 0 or ``none`` waits forever).
DEFAULT_TIMEOUT = 60.0
#: Bytes per second a request's body or answer must at least move at (option
#: ``min_throughput``): a request carrying ``n`` bytes is abandoned after
#: ``timeout + n / min_throughput`` seconds even while bytes still trickle.
DEFAULT_MIN_THROUGHPUT = 1 << 20


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """When a request to the store is given up on (and retried).

    Two limits, because a stall looks different in each direction: a store that stops
    answering (or stops sending the answer) is caught by the SDK's read timeout after
    ``idle`` seconds of silence; a store that stops *reading* an upload leaves the
    client blocked in a write, which no SDK times out, so every request also has a
    total limit that grows with the bytes it moves (slow links are not cut off)."""

    idle: float | None = DEFAULT_TIMEOUT
    min_throughput: int = DEFAULT_MIN_THROUGHPUT

    @property
    def connect(self) -> float | None:
        """Seconds to wait for a connection: the idle time, at most 10 s."""
        return None if self.idle is None else min(self.idle, 10.0)

    def limit(self, nbytes: int = 0) -> float | None:
        """Seconds a request moving ``nbytes`` may take in all, or None for no limit."""
        if self.idle is None or self.min_throughput <= 0:
            return None
        return self.idle + nbytes / self.min_throughput


#: Requests in flight per process (option ``concurrency``).
DEFAULT_CONCURRENCY = 16


def split_bucket_uri(uri: str, *, store: str, scheme: str) -> tuple[str, str]:
    """``(bucket, root)`` of ``scheme://bucket/prefix``; ValueError without a bucket."""
    parts = urlsplit(uri)
    if "@" in parts.netloc:  # a bucket name has no "@": this is user[:password]@bucket
        refuse_uri_credentials(uri, [], userinfo=True)
    if not parts.netloc:
        raise ValueError(f"{store} URI needs a bucket: {scheme}://BUCKET[/prefix], got {redact_uri(uri)!r}")
    return parts.netloc, plain_root(unquote(parts.path).strip("/"), uri)


def check_credential(name: str, value: Any) -> str:
    """``value`` if it is a non-empty string; TypeError naming the option (never
    showing the value: it is a secret)."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"option {name} must be a non-empty string, got {type(value).__name__}")
    return value


def pop_store_options(options: dict[str, Any], *, default_part: int) -> StoreOptions:
    """Pop and parse the shared options (the store checks ``part_size``'s bounds)."""
    endpoint = options.pop("endpoint_url", None)
    anon = as_bool("anon", options.pop("anon", False))
    part_size = as_size("part_size", options.pop("part_size", default_part))
    concurrency = as_int("concurrency", options.pop("concurrency", DEFAULT_CONCURRENCY), minimum=1)
    conditional = as_bool("conditional_writes", options.pop("conditional_writes", True))
    timeouts = Timeouts(
        as_timeout(options.pop("timeout", DEFAULT_TIMEOUT)),
        as_size("min_throughput", options.pop("min_throughput", DEFAULT_MIN_THROUGHPUT)),
    )
    return StoreOptions(
        endpoint_url=endpoint,
        anon=anon,
        part_size=part_size,
        concurrency=concurrency,
        conditional_writes=conditional,
        timeouts=timeouts,
    )


def causes(error: BaseException, limit: int = 8) -> Iterator[BaseException]:
    """``error``, then the errors it was raised from (``__cause__``, else ``__context__``)."""
    current: BaseException | None = error
    for _ in range(limit):
        if current is None:
            return
        yield current
        current = current.__cause__ or current.__context__


def endpoint_in(error: BaseException) -> str | None:
    """Where the failed request went, from the SDK's error: ``scheme://host[:port]``
    from botocore's ``endpoint_url``, ``host:port`` from aiohttp's, or None."""
    for e in causes(error):
        url = getattr(e, "kwargs", {}).get("endpoint_url") if isinstance(getattr(e, "kwargs", None), dict) else None
        if isinstance(url, str) and url:
            parts = urlsplit(url)
            return f"{parts.scheme}://{parts.netloc}" if parts.netloc else url
        host, port = getattr(e, "host", None), getattr(e, "port", None)
        if isinstance(host, str) and host and isinstance(port, int):
            return f"{host}:{port}"
    return None


#: Connection failures by errno, and what they mean for the endpoint.
_UNREACHABLE = {
    errno.ECONNREFUSED: "connection refused (nothing listens there)",
    errno.ENETUNREACH: "network unreachable",
    errno.EHOSTUNREACH: "host unreachable",
}
#: The SDKs' names for "the connection did not open in time" (botocore, aiohttp).
_CONNECT_TIMEOUTS = frozenset({"ConnectTimeoutError", "ConnectionTimeoutError"})


def connection_failure(error: BaseException, endpoint: str) -> OSError | None:
    """A ``ConnectionError``/``TimeoutError`` naming ``endpoint`` when ``error`` (or an
    error it came from) is a connection that could not be opened; None otherwise.
    Both stay transient: the retry loop tries again, within its deadline."""
    for e in causes(error):
        code = getattr(e, "errno", None)
        if isinstance(e, OSError) and code in _UNREACHABLE:
            return ConnectionError(code, f"cannot connect to endpoint {endpoint}: {_UNREACHABLE[code]}")
        if isinstance(e, socket.gaierror):
            return ConnectionError(errno.EHOSTUNREACH, f"cannot connect to endpoint {endpoint}: unknown host")
        if type(e).__name__ in _CONNECT_TIMEOUTS:
            return TimeoutError(errno.ETIMEDOUT, f"cannot connect to endpoint {endpoint}: no answer to connect")
    return None


class ObjectStoreBackend(Backend):
    """A bucket (and key prefix ``root``) on an object store reached through the fsspec
    filesystem ``fs``. Subclasses implement ``from_uri``, ``size`` and the hooks."""

    network = True
    capabilities = Capability.RANGED_READ | Capability.PARALLEL_WRITES | Capability.CREATE_ONLY
    #: Options that are credentials: accepted as keyword arguments (``storage_options``),
    #: refused in the URI's query by :func:`~bcp.backends.backend_for`.
    credential_options: frozenset[str] = frozenset()

    def __init__(self, uri: str, bucket: str, root: str, fs: Any, options: StoreOptions) -> None:
        super().__init__(uri)
        self.bucket, self.root, self.fs = bucket, root, fs
        self.part_size, self.concurrency = options.part_size, options.concurrency
        self.conditional_writes, self.timeouts = options.conditional_writes, options.timeouts
        self.endpoint_url = options.endpoint_url
        if not self.conditional_writes:
            self.capabilities = type(self).capabilities & ~Capability.CREATE_ONLY

    @property
    def hints(self) -> IOHints:
        return IOHints(part_size=self.part_size, concurrency=self.concurrency, read_gap_bytes=REQUEST_GAP_BYTES)

    @property
    def base(self) -> str:
        """What precedes a key in its bucket-relative name: ``root/``, or nothing."""
        return f"{self.root}/" if self.root else ""

    def _key(self, key: str) -> str:
        """The bucket-relative name of ``key`` (validated)."""
        return self.base + check_key(key)

    def run(self, coroutine_function: Any, *args: Any, nbytes: int = 0, extra: float = 0.0, **kwargs: Any) -> Any:
        """Run one of the filesystem's coroutines (fsspec's async API: ``_cat_file``,
        ``_call_s3``, ...) on its event loop, cancelled after ``timeouts.limit(nbytes)``
        (plus ``extra``) seconds; ``nbytes``: what the request sends or receives. A
        request that stalls raises TimeoutError, which the retry loop treats as
        transient, so it is sent again. The limit is enforced on the loop alone (one
        timer): the calling thread waits for the request's own outcome, so a retry
        never starts while the abandoned attempt is still running."""
        limit = self.timeouts.limit(nbytes)
        if limit is not None:
            limit += extra

        idle = self.timeouts.idle

        async def bounded() -> Any:
            request = coroutine_function(*args, **kwargs)
            if limit is None:
                return await request
            start = time.monotonic()
            try:
                return await asyncio.wait_for(request, limit)
            except Exception as e:
                if isinstance(e, TimeoutError) and isinstance(e.__cause__, asyncio.CancelledError):  # our limit
                    raise TimeoutError(
                        f"no complete answer within {limit:.1f} s (options timeout={idle:g} s, "
                        f"min_throughput={self.timeouts.min_throughput} B/s; {nbytes} bytes); abandoned"
                    ) from None
                clearer = await self._explain(e) or self._quiet(e, time.monotonic() - start)
                if clearer is e:
                    raise
                raise clearer from e

        return asyncio.run_coroutine_threadsafe(bounded(), self.fs.loop).result()

    def _quiet(self, error: Exception, elapsed: float) -> Exception:
        """``error`` as it is, or, when the SDK gave up because the store was silent for
        the idle timeout (each SDK words that differently), a TimeoutError that says so."""
        idle = self.timeouts.idle
        if idle is None or elapsed < 0.95 * idle or not is_transient(error):
            return error
        return TimeoutError(
            f"no answer for {elapsed:.1f} s (option timeout={idle:g} s); {type(error).__name__}: {error}"
        )

    async def _explain(self, error: Exception) -> Exception | None:
        """An error that says what is wrong with the set-up, for ``error`` (the SDK's),
        or None to keep it. Here: the endpoint refused the connection, or cannot be
        reached; stores add their own cases (credentials, the bucket) and call this.
        Runs on the event loop; the caller chains the result to ``error``."""
        return connection_failure(error, self._endpoint(error))

    def _endpoint(self, error: BaseException) -> str:
        """The endpoint the failed request went to, as errors name it: the
        ``endpoint_url`` option, else what the SDK's error says, else the store's."""
        if self.endpoint_url:
            return self.endpoint_url
        return endpoint_in(error) or f"the default {self.scheme} endpoint"

    # -- hooks for subclasses -----------------------------------------------------------------

    @abc.abstractmethod
    def _new_writer(self, key: str, size: int | None) -> PartWriter[Any]:
        """The part writer for ``key`` (already validated)."""

    @property
    @abc.abstractmethod
    def _single_request_max(self) -> int:
        """The largest object ``write`` sends in one request; larger ones go in parts."""

    @abc.abstractmethod
    def _put_object(self, key: str, data: Buffer, *, if_absent: bool = False) -> None:
        """Write a whole object in one request; with ``if_absent``, only if none exists."""

    @abc.abstractmethod
    def _list_names(self, full_prefix: str) -> Iterator[str]:
        """Bucket-relative names starting with ``full_prefix``, page by page, errors annotated."""

    @abc.abstractmethod
    def _delete_name(self, name: str) -> None:
        """Delete the bucket-relative ``name``; a missing one is not an error."""

    @abc.abstractmethod
    def _past_end(self, error: Exception, key: str, offset: int) -> bool:
        """Whether the ranged read of ``key`` at ``offset`` failed with ``error`` only
        because it started at or past the end (then it reads 0 bytes)."""

    def _lost_race(self, error: OSError) -> bool:
        """Whether a conditional write failed because the object already existed."""
        return isinstance(error, FileExistsError)

    def _hidden(self, name: str) -> bool:
        """Whether ``list`` skips the bucket-relative ``name`` (a store's own temporaries)."""
        return False

    # -- the contract --------------------------------------------------------------------------

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        check_key(key)
        return self._new_writer(key, size)

    def write(self, key: str, data: Buffer) -> None:
        if len(data) > self._single_request_max:
            return super().write(key, data)
        with annotate(self.uri, key, "writing"):
            self._put_object(key, data)

    def write_if_absent(self, key: str, data: Buffer) -> None:
        if not self.conditional_writes:
            return super().write_if_absent(key, data)
        with annotate(self.uri, key, "creating"):
            try:
                self._put_object(key, data, if_absent=True)
            except OSError as e:
                if self._lost_race(e):
                    raise ObjectExistsError("object already exists", uri=self.uri, key=key, action="creating") from e
                raise

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        """One ranged GET; a range at or past the end reads 0 bytes (``_past_end``)."""
        view = memoryview(buffer).cast("B")
        if len(view) == 0:
            self.size(key)  # a missing key still raises
            return 0
        with annotate(self.uri, key, "reading"):
            try:
                data = self.run(
                    self.fs._cat_file,
                    f"{self.bucket}/{self._key(key)}",
                    start=offset,
                    end=offset + len(view),
                    nbytes=len(view),
                )
            except FileNotFoundError:
                raise
            except Exception as e:  # the SDKs report a range past the end in several ways
                if not self._past_end(e, key, offset):
                    raise
                return 0
        view[: len(data)] = data
        return len(data)

    def list(self, prefix: str = "") -> Iterator[str]:
        base = self.base
        for name in self._list_names(base + prefix):
            if not self._hidden(name):
                yield name[len(base) :]

    def delete(self, key: str) -> None:
        with annotate(self.uri, key, "deleting"):
            self._delete_name(self._key(key))

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFoundError:
            return False
        return True
