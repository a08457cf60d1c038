"""Which backend class serves which URI scheme.

Three sources, consulted in this order: classes registered at run time with
:func:`register_backend`; the built-in table below (imported on first use, so an
optional dependency is needed only when its scheme is used); and the ``bcp.backends``
entry-point group, read once, lazily, the first time a scheme is not found in the
first two. A plain path (no ``scheme://``) means ``file`` and takes no options: a
``?`` in it is refused, not made part of a directory's name (docs/backends.md,
"Local paths"). ``file:/abs/path`` (RFC 8089's one-slash form) is a file URI like
``file:///abs/path``. :func:`import_plugins`
imports modules that register backends (the CLI's ``--import``) and remembers them,
so that child processes can import them too.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import re
import sys
import threading
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from bcp.backends.base import Backend
from bcp.backends.storage_errors import is_secret_name, redact, redact_uri
from bcp.backends.uri_options import refuse_uri_credentials

log = logging.getLogger(__name__)

#: scheme -> (dotted class path, install hint shown when its import fails). Keep sorted.
_BUILTIN: dict[str, tuple[str, str | None]] = {
    "file": ("bcp.backends.file.FileBackend", None),
    "gcs": ("bcp.backends.gcs.GCSBackend", "pip install 'bcp-checkpoint[gcs]' (gcsfs)"),
    "gs": ("bcp.backends.gcs.GCSBackend", "pip install 'bcp-checkpoint[gcs]' (gcsfs)"),
    "hdfs": ("bcp.backends.hdfs.HDFSBackend", "pyarrow with libhdfs (a Hadoop client install; see docs/backends.md)"),
    "memory": ("bcp.backends.memory.MemoryBackend", None),
    "s3": ("bcp.backends.s3.S3Backend", "pip install 'bcp-checkpoint[s3]' (s3fs)"),
    "webhdfs": ("bcp.backends.fsspec_backend.FsspecBackend", "fsspec's webhdfs needs requests"),
}

#: ``fsspec+<protocol>://`` selects the generic fsspec backend for any protocol.
FSSPEC_PREFIX = "fsspec+"

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
#: ``scheme:`` then one slash (or none): a URI with a slash missing, when the scheme is known
_SCHEME_COLON_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):(?!//)")
_lock = threading.Lock()
_registered: dict[str, type[Backend] | str] = {}
_entry_points: dict[str, importlib.metadata.EntryPoint] | None = None
#: Modules imported by :func:`import_plugins`, in order: child processes (the
#: conformance suite's killed saves) import them again.
_imported_plugins: list[str] = []


def split_scheme(uri: str) -> tuple[str, str]:
    """``("s3", "s3://b/k")`` for a URI, ``("file", path)`` for a plain path."""
    m = _SCHEME_RE.match(uri)
    if not m:
        return "file", uri
    return m.group(1).lower(), uri


def join_uri(uri: str, name: str) -> str:
    """``uri`` with ``/name`` appended to its path, before any query string: how bcp
    names the location ``name`` below ``uri`` (the sub-URI rule of
    docs/writing-a-backend.md: its backend sees the objects under ``name/``)."""
    base, sep, query = os.fspath(uri).partition("?")
    return f"{base.rstrip('/')}/{name}{sep}{query}"


def is_plain_path(uri: str) -> bool:
    """Whether ``uri`` is a local path rather than a URI: no ``scheme://``, and not a
    ``file:`` URI of RFC 8089's one-slash form (``file:/abs/path``)."""
    return not _SCHEME_RE.match(uri) and uri[:5].lower() != "file:"


def check_plain_path(path: str) -> None:
    """ValueError for a plain path that a user most likely meant as a URI: one with a
    ``?`` (a plain path takes no options, and the query would silently become part of
    a directory's name) or one that starts with a known scheme and one slash
    (``s3:/bucket``, which would save under ``./s3:``)."""
    m = _SCHEME_COLON_RE.match(path)
    if m:
        scheme = m.group(1).lower()
        if scheme.startswith(FSSPEC_PREFIX) or scheme in registered_backends():
            raise ValueError(
                f"{path.partition('?')[0]!r} looks like a {scheme}:// URI with a slash missing; as a plain path it "
                f"would be a local directory named {m.group(0)!r}. Write {scheme}://... (a local path that really "
                f"starts so: ./{m.group(0)}...)"
            )
    if "?" in path:
        base, _, query = path.partition("?")
        names = sorted({name for name, _value in parse_qsl(query, keep_blank_values=True)})
        given = f"options {', '.join(names)}" if names else "a query string"
        raise ValueError(
            f"{base!r} is a plain path, which takes no options, and it is followed by ?... ({given}): a '?' in a "
            "plain path is refused, not made part of a directory's name. Put options in a file URI, "
            "file:///absolute/path?fsync=false, or pass them as storage_options={'fsync': False}; a name that "
            "really holds '?' is written %3F in a file URI"
        )


def register_backend(scheme: str, backend: type[Backend] | str, *, clobber: bool = False) -> None:
    """Serve ``scheme://`` URIs with ``backend`` (a class or a dotted path to one).

    Refuses to replace a scheme that is already served unless ``clobber=True``.
    """
    scheme = scheme.lower()
    if not _SCHEME_RE.match(scheme + "://"):
        raise ValueError(f"invalid URI scheme {scheme!r}")
    with _lock:
        if not clobber and (scheme in _registered or scheme in _BUILTIN):
            raise ValueError(f"a backend for {scheme}:// is already registered; pass clobber=True to replace it")
        _registered[scheme] = backend


def import_plugins(modules: Iterable[str]) -> list[str]:
    """Import ``modules`` (each may register backends at import time) and remember
    them for child processes (:func:`imported_plugins`). The current directory is
    searched first, as ``python -m`` would: a console script does not search it.
    Raises ImportError naming the module that failed."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:  # a module that fails to import, or raises at import: name it
            detail = f"{type(e).__name__}: {e}" if not isinstance(e, ImportError) else str(e)
            raise ImportError(f"--import {module!r} failed: {detail}") from e
        with _lock:
            if module not in _imported_plugins:
                _imported_plugins.append(module)
        log.debug("imported plugin module %s", module)
    return imported_plugins()


def imported_plugins() -> list[str]:
    """The modules :func:`import_plugins` imported in this process, in order."""
    with _lock:
        return list(_imported_plugins)


def _load_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    global _entry_points
    with _lock:
        if _entry_points is None:
            found: dict[str, importlib.metadata.EntryPoint] = {}
            for ep in importlib.metadata.entry_points(group="bcp.backends"):
                found.setdefault(ep.name.lower(), ep)
            _entry_points = found
        return _entry_points


def registered_backends() -> Mapping[str, str]:
    """Read-only view: every known scheme -> where its class comes from."""
    view: dict[str, str] = {s: path for s, (path, _hint) in _BUILTIN.items()}
    for ep_scheme, ep in _load_entry_points().items():
        view.setdefault(ep_scheme, f"{ep.value} (entry point)")
    for scheme, target in _registered.items():
        view[scheme] = target if isinstance(target, str) else f"{target.__module__}.{target.__qualname__}"
    return MappingProxyType(dict(sorted(view.items())))


def _import_dotted(path: str) -> type[Backend]:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def get_backend_class(scheme: str, *, uri: str | None = None) -> type[Backend]:
    """The class serving ``scheme``; ValueError listing known schemes when none does."""
    scheme = scheme.lower()
    target = _registered.get(scheme)
    if target is None and scheme.startswith(FSSPEC_PREFIX) and scheme not in _registered:
        from bcp.backends.fsspec_backend import FsspecBackend

        return FsspecBackend
    if target is not None:
        return _import_dotted(target) if isinstance(target, str) else target
    if scheme in _BUILTIN:
        path, hint = _BUILTIN[scheme]
        try:
            return _import_dotted(path)
        except ImportError as e:
            raise ImportError(f"the {scheme}:// backend needs extra packages: {hint or e}") from e
    ep = _load_entry_points().get(scheme)
    if ep is not None:
        try:
            cls = ep.load()
        except Exception as e:
            dist = getattr(ep, "dist", None)
            origin = f" from distribution {dist.name!r}" if dist is not None else ""
            raise ImportError(
                f"backend plugin entry point {ep.name!r} = {ep.value!r}{origin} (group bcp.backends) "
                f"failed to load: {e}"
            ) from e
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise TypeError(f"entry point {ep.name!r} = {ep.value!r} is not a bcp.backends.Backend subclass")
        return cls
    known = ", ".join(f"{s}://" for s in registered_backends())
    where = f" in {redact_uri(uri)!r}" if uri else ""
    raise ValueError(f"unknown storage scheme {scheme!r}{where}; registered schemes: {known}")


def check_not_empty(uri: str, what: str = "the URI") -> None:
    """ValueError for an empty or whitespace-only ``uri``: as a plain path it would be
    the current directory, so a variable left unset would save into (or ``bcp rm``
    delete from) wherever the process happens to run. ``.`` names that directory on
    purpose. Every backend is built through :func:`backend_for`, which calls this."""
    if not uri.strip():
        raise ValueError(
            f"{what} is empty ({uri!r}): it names no location (as a path it would be the current directory); "
            "give a path or URI, or '.' for the current directory"
        )


def backend_for(uri: str | os.PathLike[str], **options: Any) -> Backend:
    """Build the backend for ``uri`` (a URI, or a local path as a string or path object).
    A URI's query parameters become options; keyword arguments override them. A plain
    path takes options as keyword arguments only (:func:`check_plain_path`). An empty
    or whitespace-only ``uri`` is refused (:func:`check_not_empty`)."""
    if not isinstance(uri, str):
        uri = str(uri)  # os.PathLike
    check_not_empty(uri)
    scheme, _ = split_scheme(uri)
    plain = is_plain_path(uri)
    if plain:
        check_plain_path(uri)
    cls = get_backend_class(scheme, uri=uri)
    base = uri
    if not plain:
        parts = urlsplit(uri)
        if "#" in uri:  # urlsplit drops everything after it, options included
            raise ValueError(
                f"{redact_uri(uri)!r}: a storage URI has no #fragment; a name that holds '#' is written %23"
            )
        query = dict(parse_qsl(parts.query, keep_blank_values=True)) if parts.query else {}
        _refuse_credentials_in_uri(cls, uri, parts.netloc, query)
        if parts.query:
            options = {**query, **options}
            base = uri[: uri.index("?")]  # not urlunsplit: it turns "x:///p" into "x:/p"
    log.debug("backend %s for %s", cls.__name__, redact_uri(base))
    try:
        if getattr(cls, "network", False):
            from bcp.backends.retry import policy_from_options
            from bcp.backends.wrappers import RetryingBackend

            policy = policy_from_options(options, default_attempts=getattr(cls, "default_retry_attempts", None))
            return RetryingBackend(cls.from_uri(base, **options), policy)
        return cls.from_uri(base, **options)
    except Exception as e:
        _redact_exception(e)
        raise


def _refuse_credentials_in_uri(cls: type[Backend], uri: str, netloc: str, query: Mapping[str, str]) -> None:
    """ValueError when the URI of a backend that takes credentials as options (one
    with ``credential_options``: S3, GCS) carries them itself: a ``user:password@``
    in its host part, or a query option that is one of its credentials or secret by
    its name. The same options are welcome as keyword arguments (``storage_options``),
    which are never printed or stored. Other backends keep such URIs, shown redacted."""
    if not cls.credential_options:
        return
    own = {name.lower() for name in cls.credential_options}
    names = [name for name in query if name.lower() in own or is_secret_name(name)]
    userinfo = ":" in netloc.rpartition("@")[0]
    refuse_uri_credentials(uri, names, userinfo=userinfo)


def _redact_exception(error: BaseException) -> None:
    """Redact the messages of ``error`` and of the errors it chains to, in place: a
    backend's ``from_uri`` (or the SDK under it) may quote the URI, credentials and
    all, and the caller will print or log it."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen and len(seen) < 20:
        seen.add(id(current))
        try:
            current.args = tuple(redact(a) if isinstance(a, str) else a for a in current.args)
            if isinstance(current, OSError):
                if isinstance(current.strerror, str):
                    current.strerror = redact(current.strerror)
                if isinstance(current.filename, str):
                    current.filename = redact(current.filename)
        except (AttributeError, TypeError):  # an exception type with read-only fields keeps its message
            pass
        current = current.__cause__ or current.__context__
