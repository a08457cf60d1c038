"""bcp checkpoints inside one SQLite database file (example plugin).

Registered through the ``bcp.backends`` entry point ``sqlite`` (see pyproject.toml).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit

from bcp.backends import (
    Backend,
    Buffer,
    Capability,
    IOHints,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectWriter,
    StorageError,
    check_key,
)

_SUFFIXES = (".db", ".sqlite", ".sqlite3")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (key TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS pending (upload TEXT NOT NULL, offset INTEGER NOT NULL, data BLOB NOT NULL,
                                    PRIMARY KEY (upload, offset));
"""


def split_uri(uri: str) -> tuple[str, str]:
    """``sqlite:///data/ck.db/run1`` -> (``/data/ck.db``, ``run1``)."""
    parts = urlsplit(uri)
    if parts.netloc:
        raise ValueError(f"sqlite URI must be sqlite:///ABSOLUTE/PATH/FILE.db[/prefix], got {uri!r}")
    components = unquote(parts.path).split("/")
    for i, name in enumerate(components):
        if name.endswith(_SUFFIXES):
            return "/".join(components[: i + 1]), "/".join(c for c in components[i + 1 :] if c)
    raise ValueError(f"sqlite URI {uri!r} names no database file (a path component ending in {', '.join(_SUFFIXES)})")


class SQLiteBackend(Backend):
    scheme = "sqlite"
    capabilities = Capability.CREATE_ONLY | Capability.RANGED_READ | Capability.PARALLEL_WRITES

    def __init__(self, uri: str, path: str, prefix: str, *, synchronous: str = "full", timeout: float = 60.0) -> None:
        super().__init__(uri)
        self.path, self.prefix = path, prefix
        self.synchronous, self.timeout = synchronous, timeout
        self._local = threading.local()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._db().executescript(_SCHEMA)

    @classmethod
    def from_uri(cls, uri: str, **options) -> SQLiteBackend:
        synchronous = str(options.pop("synchronous", "full")).lower()
        timeout = float(options.pop("timeout", 60.0))
        if options:
            raise TypeError(f"unknown option(s) for the sqlite backend ({uri}): {', '.join(sorted(options))}")
        if synchronous not in ("full", "normal"):
            raise ValueError(f"option synchronous={synchronous!r}: choose full or normal")
        path, prefix = split_uri(uri)
        return cls(uri, path, prefix, synchronous=synchronous, timeout=timeout)

    @property
    def hints(self) -> IOHints:
        return IOHints(part_size=None, concurrency=2)  # SQLite serializes writers anyway

    # -- helpers ----------------------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        """One connection per thread (sqlite3 connections must not be shared)."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={self.synchronous.upper()}")
            self._local.db = db
        return db

    def _name(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, e: Exception, key: str, action: str) -> StorageError:
        return StorageError(f"sqlite: {e}", uri=self.uri, key=key, action=action)

    def _row(self, db: sqlite3.Connection, key: str, action: str) -> tuple[int, int]:
        row = db.execute("SELECT rowid, length(data) FROM objects WHERE key = ?", (self._name(key),)).fetchone()
        if row is None:
            raise ObjectNotFoundError("no such object", uri=self.uri, key=key, action=action)
        return row

    # -- the contract -------------------------------------------------------------------------

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        return _SQLiteWriter(self, key, self._name(key))

    def write_if_absent(self, key: str, data) -> None:
        try:
            self._db().execute("INSERT INTO objects (key, data) VALUES (?, ?)", (self._name(key), bytes(data)))
        except sqlite3.IntegrityError:
            raise ObjectExistsError("object already exists", uri=self.uri, key=key, action="creating") from None
        except sqlite3.Error as e:
            raise self._error(e, key, "creating") from e

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        view = memoryview(buffer).cast("B")
        db = self._db()
        try:
            db.execute("BEGIN")  # one snapshot for the lookup and the blob read
            try:
                rowid, total = self._row(db, key, "reading")
                n = max(0, min(len(view), total - offset))
                if n:
                    with db.blobopen("objects", "data", rowid, readonly=True) as blob:
                        view[:n] = blob[offset : offset + n]
            finally:
                db.execute("COMMIT")
        except sqlite3.Error as e:
            raise self._error(e, key, "reading") from e
        return n

    def size(self, key: str) -> int:
        try:
            return self._row(self._db(), key, "sizing")[1]
        except sqlite3.Error as e:
            raise self._error(e, key, "sizing") from e

    def list(self, prefix: str = "") -> Iterator[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        want = base + prefix
        try:
            rows = (
                self._db().execute("SELECT key FROM objects WHERE substr(key, 1, ?) = ?", (len(want), want)).fetchall()
            )
        except sqlite3.Error as e:
            raise self._error(e, prefix, "listing") from e
        return iter([key[len(base) :] for (key,) in rows])

    def delete(self, key: str) -> None:
        try:
            self._db().execute("DELETE FROM objects WHERE key = ?", (self._name(key),))
        except sqlite3.Error as e:
            raise self._error(e, key, "deleting") from e

    def exists(self, key: str) -> bool:
        try:
            return self._db().execute("SELECT 1 FROM objects WHERE key = ?", (self._name(key),)).fetchone() is not None
        except sqlite3.Error as e:
            raise self._error(e, key, "checking") from e

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None


class _SQLiteWriter(ObjectWriter):
    """Parts go to the ``pending`` table; commit assembles them into ``objects`` in one
    transaction. ``ObjectWriter`` keeps the lifecycle (open, then committed or aborted);
    this class implements only its three hooks."""

    def __init__(self, backend: SQLiteBackend, key: str, name: str) -> None:
        super().__init__(backend.uri, key)
        self.backend, self.name = backend, name
        self.upload = uuid.uuid4().hex

    def _write_at(self, offset: int, data: Buffer) -> None:
        try:
            self.backend._db().execute(
                "INSERT INTO pending (upload, offset, data) VALUES (?, ?, ?)", (self.upload, offset, bytes(data))
            )
        except sqlite3.Error as e:
            raise self.backend._error(e, self.key, "writing") from e

    def _commit(self) -> None:
        db = self.backend._db()
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                parts = db.execute(
                    "SELECT offset, length(data) FROM pending WHERE upload = ? ORDER BY offset", (self.upload,)
                ).fetchall()
                total = max((o + n for o, n in parts), default=0)
                db.execute("INSERT OR REPLACE INTO objects (key, data) VALUES (?, zeroblob(?))", (self.name, total))
                (rowid,) = db.execute("SELECT rowid FROM objects WHERE key = ?", (self.name,)).fetchone()
                if total:
                    with db.blobopen("objects", "data", rowid) as blob:
                        for offset, _n in parts:
                            (data,) = db.execute(
                                "SELECT data FROM pending WHERE upload = ? AND offset = ?", (self.upload, offset)
                            ).fetchone()
                            blob[offset : offset + len(data)] = data
                db.execute("DELETE FROM pending WHERE upload = ?", (self.upload,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        except sqlite3.Error as e:  # the lifecycle then aborts the writer (_abort)
            raise self.backend._error(e, self.key, "committing") from e

    def _abort(self) -> None:
        try:
            self.backend._db().execute("DELETE FROM pending WHERE upload = ?", (self.upload,))
        except sqlite3.Error:
            pass  # leftover pending rows are invisible; the next abort or a VACUUM removes them
