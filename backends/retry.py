"""Bounded retries with exponential backoff and full jitter, for network stores.

Object stores fail transiently all the time at scale (S3 answers ``503 SlowDown``
when a prefix is hot; connections reset). One policy, applied at the backend
boundary around each request, retries only what is safe to retry (every bcp request
is idempotent: a ranged GET, a part upload under a fixed part number, a PUT of a
whole object) and gives up after a bounded number of attempts and seconds with a
:class:`~bcp.backends.errors.StorageError` that names the object and the attempts.

The SDKs underneath have retry loops of their own; the bcp backends switch those
off so that exactly one loop, this one, decides (nested loops multiply attempts).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

# TransientError lives in .errors; importing it here keeps bcp.backends.retry.TransientError working.
from .errors import ObjectExistsError, ObjectNotFoundError, StorageError, TransientError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: errno values that mean "try again": throttled/busy (s3fs maps 503 SlowDown to
#: EBUSY), remote I/O error (HTTP 500), timeouts and dropped connections.
TRANSIENT_ERRNOS = frozenset(
    {errno.EBUSY, errno.EAGAIN, errno.EREMOTEIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED,
     errno.ECONNREFUSED, errno.EPIPE, errno.ENETUNREACH, errno.EHOSTUNREACH}
)

#: Exception class names (from botocore, aiohttp, urllib3, requests, gcsfs) that are
#: transient. Matched by name so this module needs none of those packages.
TRANSIENT_NAMES = frozenset(
    {"EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
     "ResponseStreamingError", "IncompleteReadError", "ClientPayloadError", "ServerDisconnectedError",
     "ClientConnectorError", "ClientOSError", "ServerTimeoutError", "ProtocolError", "ChunkedEncodingError",
     "ProxyError", "TransientError"}
)

#: HTTP status codes worth retrying (gcsfs' HttpError carries ``code``).
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is worth retrying."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (ObjectNotFoundError, ObjectExistsError, PermissionError)):
            return False
        if isinstance(exc, (TransientError, TimeoutError, ConnectionError)):
            return True
        if type(exc).__name__ in TRANSIENT_NAMES:
            return True
        if isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS:
            return True
        code = getattr(exc, "code", None)
        if isinstance(code, int) and code in TRANSIENT_STATUS:
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


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

    def call(self, fn: Callable[[], T], *, uri: str, key: str, action: str,
             transient: Callable[[BaseException], bool] = is_transient, sleep=time.sleep) -> T:
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
                    raise StorageError(
                        f"gave up after {attempt} attempt(s) over {elapsed:.1f} s; last error: "
                        f"{type(e).__name__}: {e}",
                        uri=uri, key=key, action=action,
                    ) from e
                pause = min(self.delay(attempt), max(self.deadline - elapsed, 0.0))
                log.info("%s %r in %s failed (%s: %s); attempt %d of %d in %.2f s",
                         action, key, uri, type(e).__name__, e, attempt + 1, self.attempts, pause)
                sleep(pause)
                attempt += 1


def policy_from_options(options: dict, *, default_attempts: int | None = None) -> RetryPolicy:
    """Pop ``retries`` (attempts after the first), ``retry_base_delay``,
    ``retry_max_delay`` and ``retry_deadline`` from URI/keyword options."""
    kw = {} if default_attempts is None else {"attempts": default_attempts}
    if "retries" in options:
        kw["attempts"] = int(options.pop("retries")) + 1
    for name, field in (("retry_base_delay", "base_delay"), ("retry_max_delay", "max_delay"),
                        ("retry_deadline", "deadline")):
        if name in options:
            kw[field] = float(options.pop(name))
    return RetryPolicy(**kw)
