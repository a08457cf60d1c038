"""Storage errors: one type, raised once at the backend boundary.

Every storage failure surfaces as a :class:`StorageError` that says which action
failed on which key of which store, chained (``from e``) to the SDK or OS error
underneath. A missing object is an :class:`ObjectNotFoundError`, which is also a
``FileNotFoundError``, so callers can use the Python idiom they already know.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

#: Names whose values are secrets (signed URLs, tokens, keys, passwords), in query
#: strings, ``name=value`` / ``name: value`` text, JSON and Python reprs.
_SECRET_NAMES = (
    r"x-(?:amz|goog)-(?:signature|credential|security-token)|signature|(?<![a-z])sig|"
    r"(?:access|refresh|id|session|security|auth|sas)[_-]?token|token|"
    r"aws_secret_access_key|aws_session_token|secret(?:_access)?_key|client_secret|secret|"
    r"api[_-]?key|private[_-]?key|account[_-]?key|password|passwd|(?<![a-z])pwd|key_secret|credentials?"
)
#: ``name: "value"`` / ``"name": "value"`` / ``'name': 'value'``: the whole quoted value.
_QUOTED_RE = re.compile(rf"(?i)((?:{_SECRET_NAMES})[\"']?\s*[=:]\s*)([\"'])((?:\\.|(?!\2).)*)\2")
#: ``name=value`` / ``name: value``: up to a separator.
_PLAIN_RE = re.compile(rf"(?i)((?:{_SECRET_NAMES})[\"']?\s*[=:]\s*)[^&\s'\",;)}}\]]+")
#: ``Authorization: Bearer <token>`` and Basic credentials.
_AUTH_RE = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9\-._~+/]+=*|\b(basic\s+)[A-Za-z0-9+/]{8,}=*")
#: ``scheme://user:password@host``: the password (up to the last ``@`` of the authority).
_USERINFO_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://[^/\s:@?#]*):[^/\s?#]*@")
_SECRET_NAME_RE = re.compile(rf"(?i)(?:{_SECRET_NAMES})")


def is_secret_name(name: str) -> bool:
    """Whether an option named ``name`` carries a secret by its name alone
    (``token``, ``secret``, ``password``, ``*_access_key``, ...): such an option never
    belongs in a URI, whatever the backend."""
    return _SECRET_NAME_RE.fullmatch(name) is not None


def redact(text: str) -> str:
    """``text`` with credential-looking values replaced by ``***``: secret-named
    fields (query parameters, ``name=value``, JSON), Bearer/Basic credentials and
    passwords in ``scheme://user:password@host`` URIs."""
    text = _USERINFO_RE.sub(r"\1:***@", text)
    text = _QUOTED_RE.sub(r"\1\2***\2", text)
    text = _PLAIN_RE.sub(r"\1***", text)
    return _AUTH_RE.sub(lambda m: f"{m.group(1) or m.group(2)}***", text)


def redact_uri(uri: str) -> str:
    """``uri`` as it may be shown: the password of ``user:password@`` and the values
    of secret-named query parameters replaced by ``***``. A plain path is returned
    unchanged. Backends keep the real URI for connecting; this is for display."""
    if "://" not in uri:
        return uri
    scheme, _, rest = uri.partition("://")
    end = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:
        userinfo, _, host = authority.rpartition("@")
        if ":" in userinfo:
            authority = f"{userinfo.partition(':')[0]}:***@{host}"
    path, qmark, query = tail.partition("?")
    if qmark:
        query, hash_, fragment = query.partition("#")
        params = []
        for param in query.split("&"):
            name, eq, _value = param.partition("=")
            params.append(f"{name}=***" if eq and is_secret_name(name) else param)
        tail = f"{path}?{'&'.join(params)}{hash_}{fragment}"
    return f"{scheme}://{authority}{tail}"


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

    # keep pickling (multiprocessing, collectives) working, notes and added fields too
    def __reduce__(self) -> tuple[Callable[..., StorageError], tuple[object, ...], dict[str, object]]:
        return (_rebuild, (type(self), self.reason, self.uri, self.key, self.action), dict(vars(self)))


def _rebuild(cls: type[StorageError], reason: str, uri: str, key: str, action: str) -> StorageError:
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
