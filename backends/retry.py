"""Bounded retries with exponential backoff and full jitter, for network stores.

Object stores fail transiently all the time at scale (S3 answers ``503 SlowDown``
when a prefix is hot; connections reset). One policy, applied at the backend
boundary around each request, retries only what is safe to retry (every bcp request
is idempotent: a ranged GET, a part upload under a fixed part number, a PUT of a
whole object) and gives up after a bounded number of attempts and seconds with a
:class:`~bcp.backends.storage_errors.StorageError` that names the object and the attempts.

The SDKs underneath have retry loops of their own; the bcp backends switch those
off so that exactly one loop, this one, decides (nested loops multiply attempts, and
would outlast ``deadline``).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

# TransientError lives in .errors; importing it here keeps bcp.backends.retry.TransientError working.
from bcp.backends.storage_errors import ObjectExistsError, ObjectNotFoundError, StorageError, TransientError
from bcp.backends.uri_options import as_float, as_int

log = logging.getLogger(__name__)

T = TypeVar("T")

#: errno values that mean "try again": throttled/busy (s3fs maps 503 SlowDown to
#: EBUSY), remote I/O error (HTTP 500), timeouts and dropped connections.
TRANSIENT_ERRNOS = frozenset(
    {
        errno.EBUSY,
        errno.EAGAIN,
        errno.EREMOTEIO,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ECONNREFUSED,
        errno.EPIPE,
        errno.ENETUNREACH,
        errno.EHOSTUNREACH,
    }
)

#: Exception class names (from botocore, aiohttp, urllib3, requests, gcsfs) that are
#: transient. Matched by name so this module needs none of those packages.
TRANSIENT_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ClientConnectorError",
        "ClientOSError",
        "ServerTimeoutError",
        "ProtocolError",
        "ChunkedEncodingError",
        "ProxyError",
        "TransientError",
    }
)

#: HTTP status codes worth retrying (gcsfs' HttpError carries ``code``).
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is worth retrying."""
    seen = 0
    current: BaseException | None = exc  # then the error it was raised from, and so on
    while current is not None and seen < 8:
        if isinstance(current, (ObjectNotFoundError, ObjectExistsError, PermissionError)):
            return False
        if isinstance(current, (TransientError, TimeoutError, ConnectionError)):
            return True
        if type(current).__name__ in TRANSIENT_NAMES:
            return True
        if isinstance(current, OSError) and current.errno in TRANSIENT_ERRNOS:
            return True
        code = getattr(current, "status", None)  # aiohttp's name (its ``code`` is deprecated)
        if not isinstance(code, int):
            code = getattr(current, "code", None)  # gcsfs' HttpError
        if isinstance(code, int) and code in TRANSIENT_STATUS:
            return True
        current = current.__cause__ or current.__context__
        seen += 1
    return False


_retried_lock = threading.Lock()
_retried = 0


def retry_count() -> int:
    """Attempts retried in this process so far, by every backend (metrics take differences)."""
    return _retried


def _count_retry() -> None:
    global _retried
    with _retried_lock:
        _retried += 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How hard to try. Delay before attempt ``n`` (n >= 1) is uniform in
    ``[0, min(max_delay, base_delay * 2**(n-1))]`` ("full jitter": many ranks that
    were throttled together do not come back together)."""

    #: Total tries per request, the first included. 1 disables retrying.
    attempts: int = 6
    base_delay: float = 0.2
    max_delay: float = 8.0
    #: Give up once this many seconds have passed since the first try, whatever
    #: ``attempts`` says.
    deadline: float = 120.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"retries: attempts must be >= 1, got {self.attempts}")
        if self.base_delay < 0 or self.max_delay < 0 or self.deadline <= 0:
            raise ValueError("retries: delays must be >= 0 and the deadline > 0")

    def delay(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.max_delay, self.base_delay * (2 ** (attempt - 1))))

    def call(
        self,
        fn: Callable[[], T],
        *,
        uri: str,
        key: str,
        action: str,
        transient: Callable[[BaseException], bool] = is_transient,
        sleep: Callable[[float], None] = time.sleep,
    ) -> T:
        """Run ``fn`` until it succeeds, fails permanently, or the budget is spent.

        A permanent error propagates unchanged (the backend wraps it); running out
        of attempts raises StorageError naming ``key``, the attempts and the last error.
        """
        start = time.monotonic()
        attempt = 1
        while True:
            try:
                return fn()
            except BaseException as e:
                if not isinstance(e, Exception) or not transient(e):
                    raise
                elapsed = time.monotonic() - start
                if attempt >= self.attempts or elapsed >= self.deadline:
                    # a backend's StorageError already names the store; its reason is the news
                    last = e.reason if isinstance(e, StorageError) else f"{type(e).__name__}: {e}"
                    raise StorageError(
                        f"gave up after {attempt} attempt(s) over {elapsed:.1f} s; last error: {last}",
                        uri=uri,
                        key=key,
                        action=action,
                    ) from e
                pause = min(self.delay(attempt), max(self.deadline - elapsed, 0.0))
                log.info(
                    "%s %r in %s failed (%s: %s); attempt %d of %d in %.2f s",
                    action,
                    key,
                    uri,
                    type(e).__name__,
                    e,
                    attempt + 1,
                    self.attempts,
                    pause,
                )
                _count_retry()
                sleep(pause)
                attempt += 1


def policy_from_options(options: dict[str, Any], *, default_attempts: int | None = None) -> RetryPolicy:
    """Pop ``retries`` (attempts after the first), ``retry_base_delay``,
    ``retry_max_delay`` and ``retry_deadline`` from URI/keyword options."""
    defaults = RetryPolicy()
    attempts = defaults.attempts if default_attempts is None else default_attempts
    if "retries" in options:
        attempts = as_int("retries", options.pop("retries")) + 1

    def pop_float(name: str, default: float) -> float:
        return as_float(name, options.pop(name)) if name in options else default

    # Keyword arguments are evaluated in order: the options are popped, and fail, in this order.
    return RetryPolicy(
        attempts=attempts,
        base_delay=pop_float("retry_base_delay", defaults.base_delay),
        max_delay=pop_float("retry_max_delay", defaults.max_delay),
        deadline=pop_float("retry_deadline", defaults.deadline),
    )
