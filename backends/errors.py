"""Storage errors: one type, raised once at the backend boundary.

Every storage failure surfaces as a :class:`StorageError` that says which action
failed on which key of which store, chained (``from e``) to the SDK or OS error
underneath. A missing object is an :class:`ObjectNotFoundError`, which is also a
``FileNotFoundError``, so callers can use the Python idiom they already know.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

#: Secrets that SDK messages can carry (signed URLs, bearer tokens, keys in query
#: strings). Every StorageError message passes through :func:`redact`.
_SECRET_RE = re.compile(
    r"(?i)((?:x-amz-(?:signature|credential|security-token)|signature|access_token|token|"
    r"aws_secret_access_key|secret(?:_access)?_key|password|key_secret)[=:]\s*)[^&\s'\"]+"
)


def redact(text: str) -> str:
    """``text`` with credential-looking values replaced by ``***``."""
    return _SECRET_RE.sub(r"\1***", text)


class StorageError(OSError):
    """A storage operation failed.

    Attributes: ``uri`` (the backend's root), ``key`` (the object, relative to the
    root; may be empty for whole-store actions) and ``action`` (a verb phrase such
    as "reading", "writing", "committing").
    """

    def __init__(self, reason: str, *, uri: str, key: str, action: str) -> None:
        reason = redact(reason)
        self.reason = reason
        self.uri = uri
        self.key = key
        self.action = action
        super().__init__(f"{action} {key!r} in {uri}: {reason}")

    def __str__(self) -> str:  # OSError.__str__ would format errno fields instead
        return self.args[0]

    def __reduce__(self):  # keep pickling (multiprocessing, collectives) working, notes and added fields too
        return (_rebuild, (type(self), self.reason, self.uri, self.key, self.action), dict(vars(self)))


def _rebuild(cls, reason, uri, key, action):
    return cls(reason, uri=uri, key=key, action=action)


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object does not exist (reading, sizing). Deleting a missing object is not an error."""


class ObjectExistsError(StorageError, FileExistsError):
    """A create-only write found the object already present: another writer won."""


class TransientError(StorageError):
    """A failure the store says may succeed if tried again (raised by fault injection
    and by backends that can tell)."""


class WriterClosedError(StorageError, ValueError):
    """An :class:`~bcp.backends.base.ObjectWriter` was used after it was committed or
    aborted (``action`` says what was attempted). Also a ``ValueError``, which some
    writers raised for this before, so older handlers still catch it."""


@contextlib.contextmanager
def annotate(uri: str, key: str, action: str) -> Iterator[None]:
    """Translate OS errors raised inside the block into StorageError, exactly once."""
    try:
        yield
    except StorageError:
        raise
    except FileNotFoundError as e:
        raise ObjectNotFoundError("no such object", uri=uri, key=key, action=action) from e
    except FileExistsError as e:
        raise ObjectExistsError("object already exists", uri=uri, key=key, action=action) from e
    except OSError as e:
        raise StorageError(e.strerror or str(e), uri=uri, key=key, action=action) from e
